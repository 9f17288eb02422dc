"""The verifier's architecture, read from its HF ``config.json`` (docs/design.md, "In-step
verifier").

One frozen dataclass describes every supported family; the differences between families
are fields (norm style, extra norms, q/k norms, biases, activation, embedding scale,
attention scale and soft-capping, per-layer sliding windows and RoPE, experts), so the
forward in :mod:`dspark_jax.verifier.forward` has no per-family branches. Any other
``model_type`` is refused before a tensor is read.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from dspark_jax import hf_folder
from dspark_jax.config import RopeScaling

# model_type -> family. Gemma 3's text checkpoints say gemma3_text; "gemma3" is the
# multimodal wrapper (4B/12B/27B): its text tower (text_config, language_model.* tensors)
# is the verifier (MULTIMODAL). Other multimodal types are refused.
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "qwen3_moe": "llama",
    "gemma2": "gemma",
    "gemma3_text": "gemma",
    "deepseek_v3": "deepseek",  # MLA + grouped sigmoid-routed experts
    "kimi_k2": "deepseek",  # Kimi-K2's config.json name for the same architecture
    "glm4_moe": "glm",  # GLM-4.5/4.6: GQA, partial RoPE, DeepSeek's sigmoid-routed experts
    "kimi_linear": "kimi",  # Kimi-Linear: KDA layers, MLA without RoPE, sigmoid-routed experts
    # Kimi-K3: Kimi-Linear + attention residuals, SITU, gates, latent experts (_kimi_k3);
    # its release nests a kimi_linear text_config in a kimi_k3 wrapper (text_tower)
    "kimi_k3": "kimi",
    "qwen3_next": "qwen3_next",  # Gated DeltaNet layers, gated attention, (1 + w) norms
    "gpt_oss": "gpt_oss",  # attention sinks, alternating windows, clamped SwiGLU experts
}
# multimodal model_type -> the model_type its text_config must have
MULTIMODAL = {"gemma3": "gemma3_text"}
SUPPORTED = (*FAMILIES, *MULTIMODAL)
ATTENTION_TYPES = ("full_attention", "sliding_attention")
# what a layer mixes tokens with (LayerKind.mixer): attention, Kimi Delta Attention, or
# Qwen3-Next's Gated DeltaNet (verifier/delta_rule.py runs both linear ones)
MIXERS = ("attention", "kda", "gdn")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class UnsupportedVerifierError(ValueError):
    """The verifier's family (or a setting of it) has no in-step forward."""


class LayerKind(NamedTuple):
    """What makes two decoder layers run the same code (their weights may differ):
    layers of one kind are stacked and scanned (dspark_jax/verifier/forward.py)."""

    window: int | None  # sliding window, None on full-attention layers
    rope: str  # key into VerifierConfig.ropes
    moe: bool
    mixer: str = "attention"  # or "kda" / "gdn" (MIXERS)
    block_start: bool = False  # Kimi-K3: an attention-residual block starts at this layer


class RopeView(NamedTuple):
    """What :func:`dspark_jax.model.layers.rope_tables` reads from a config."""

    rope_scaling: RopeScaling
    rope_theta: float
    head_dim: int
    max_position_embeddings: int


@dataclass(frozen=True)
class VerifierConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    gemma_norms: bool  # x * (1 + w) norms, pre/post feed-forward norms, scaled embedding
    qk_norm: bool  # q_norm / k_norm over head_dim (Qwen3, Gemma 3)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    query_scale: float  # scores = q k^T * query_scale
    attn_softcap: float | None
    final_softcap: float | None  # logits only: not part of any hidden state
    layer_windows: tuple[int | None, ...]  # keys q - W < k <= q on sliding layers
    layer_rope: tuple[str, ...]  # key into ropes, per layer
    ropes: tuple[tuple[str, RopeView], ...]
    # Qwen3-MoE (router "softmax") and DeepSeek-V3 (router "sigmoid": sigmoid scores plus
    # e_score_correction_bias choose, group-limited to the topk_group best of n_group
    # groups by their top-2 sums; the chosen raw scores weigh, renormalised when
    # norm_topk_prob, times routed_scaling_factor; n_shared_experts always-on experts)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    layer_moe: tuple[bool, ...] = ()
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): q through a q_lora_rank
    # bottleneck (None: q_proj), keys and values from a kv_lora_rank latent; per head
    # qk_nope_head_dim + qk_rope_head_dim for q and k (the rotary part of k shared by the
    # heads), v_head_dim for v; rope_interleave: the rotary dims are pairs (x0, x1) ...
    mla: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # partial RoPE (GLM): only the first rotary_dim dims of each head rotate (None: all)
    rotary_dim: int | None = None
    # Kimi-Linear: MLA layers without RoPE (mla_rope False: the "rotary" part of k is
    # shared by the heads but never rotated). Linear-attention layers (layer_mixers[i]
    # "kda": Kimi's KimiLinearDeltaAttention, per-channel forget gates; "gdn": Qwen3-Next's
    # Gated DeltaNet, one forget gate per head): linear_heads value heads of linear_v_dim,
    # linear_k_heads key heads of linear_k_dim (each serving linear_heads / linear_k_heads
    # value heads), a causal depthwise convolution of linear_conv taps on q, k, v
    mla_rope: bool = True
    layer_mixers: tuple[str, ...] = ()
    linear_heads: int = 0
    linear_v_dim: int = 0
    linear_k_heads: int = 0
    linear_k_dim: int = 0
    linear_conv: int = 0
    # Qwen3-Next: every norm x * (1 + w) (Gemma's, without Gemma's other changes); q_proj
    # also gives a per-head output gate (attention output * sigmoid(gate)); the shared
    # expert is shared_intermediate_size wide and scaled by sigmoid(shared_expert_gate(x))
    zero_centred_norms: bool = False
    attn_output_gate: bool = False
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # gpt-oss: a learned sink logit per head joins every softmax (value 0); router
    # "topk_softmax" (softmax over the top-k biased logits); experts stored [E, H, 2I]
    # with gate and up interleaved, biases, and the clamped SwiGLU
    # (up.clip(-L, L) + 1) * g * sigmoid(alpha g), g = gate.clip(max=L)
    attn_sinks: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # Kimi-K3's additions to Kimi-Linear (docs/design.md, "Kimi-K3"; read from sglang-jax's
    # port, not verified against Moonshot's modeling code): attention residuals over depth
    # blocks of attn_res_block layers; the SITU gated activation (situ: beta, linear_beta);
    # a sigmoid output gate on MLA (g_proj); KDA's output gate from one full-rank g_proj;
    # routed experts in a latent of latent_moe width (down, experts, norm, up)
    attn_res_block: int | None = None
    situ: tuple[float, float | None] | None = None
    mla_output_gate: bool = False
    kda_full_rank_gate: bool = False
    latent_moe: int | None = None
    latent_moe_norm: bool = False

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of q and k (the scores' contraction)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def shared_width(self) -> int:
        """The shared expert's (DeepSeek: experts') intermediate width."""
        return self.shared_intermediate_size or self.n_shared_experts * self.moe_intermediate_size

    @property
    def embed_scale(self) -> float | None:
        """Gemma multiplies the embedding by sqrt(hidden_size) (in the weights' dtype)."""
        return math.sqrt(self.hidden_size) if self.gemma_norms else None

    def rope(self, layer: int) -> RopeView:
        return dict(self.ropes)[self.layer_rope[layer]]

    def is_moe(self, layer: int) -> bool:
        return bool(self.layer_moe) and self.layer_moe[layer]

    def mixer(self, layer: int) -> str:
        return self.layer_mixers[layer] if self.layer_mixers else "attention"

    def kind(self, layer: int) -> LayerKind:
        block_start = self.attn_res_block is not None and layer % self.attn_res_block == 0
        return LayerKind(
            self.layer_windows[layer], self.layer_rope[layer], self.is_moe(layer),
            self.mixer(layer), block_start,
        )  # fmt: skip

    @property
    def layer_stacks(self) -> tuple[tuple[LayerKind, tuple[int, ...]], ...]:
        """The layers of each kind, ascending; kinds in order of first appearance. Stack
        ``j``'s parameters are ``stacks.{j}.*`` with a leading layer axis (weights.py)."""
        stacks: dict[LayerKind, list[int]] = {}
        for i in range(self.num_hidden_layers):
            stacks.setdefault(self.kind(i), []).append(i)
        return tuple((k, tuple(v)) for k, v in stacks.items())

    def check_layer_ids(self, layer_ids, where: str = "--target-layer-ids") -> tuple[int, ...]:
        """Ascending, unique ids in [0, N] (id k: the residual stream after k layers)."""
        ids = tuple(sorted({int(i) for i in layer_ids}))
        n = self.num_hidden_layers
        bad = [i for i in ids if not 0 <= i <= n]
        if bad or not ids:
            raise ValueError(
                f"{where}: layer ids {list(layer_ids)} must lie in [0, {n}] "
                f"(the verifier has {n} layers; id k = the output of k layers)"
            )
        return ids


def read_config_dict(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no config.json in the verifier folder") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def check_supported(d: dict[str, Any], where: str = "config.json") -> str:
    """The model_type, or a one-line refusal naming it and the supported list."""
    mt = d.get("model_type")
    if mt not in FAMILIES and mt not in MULTIMODAL:
        near = nearest_supported(mt)
        raise UnsupportedVerifierError(
            f"{where}: model_type {mt!r} has no in-step verifier forward"
            + (f" (nearest supported: {near})" if near else "")
            + f"; supported: {', '.join(SUPPORTED)} (for others, extract hidden-state files "
            "with launch.extract_hidden_states, or generate them online with --on-missing "
            "generate)"
        )
    return mt


def nearest_supported(model_type) -> str | None:
    """The supported model_type sharing the longest prefix with ``model_type`` (at least
    its first 4 characters: deepseek_v32 -> deepseek_v3), or None."""
    if not isinstance(model_type, str):
        return None

    def shared(s: str) -> int:
        return next(
            (i for i, (a, b) in enumerate(zip(s, model_type)) if a != b),
            min(len(s), len(model_type)),
        )

    best = max(SUPPORTED, key=shared)
    return best if shared(best) >= 4 else None


def _rope_view(params: dict | None, theta: float | None, hd: int, max_pos: int, where: str):
    params = dict(params or {})
    theta = params.pop("rope_theta", theta)
    if theta is None:
        raise ValueError(f"{where}: no rope_theta")
    try:
        scaling = RopeScaling.from_dict(params)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    prf = scaling.get("partial_rotary_factor", 1.0)
    if prf != 1.0 and scaling.rope_type != "proportional":
        raise UnsupportedVerifierError(f"{where}: partial_rotary_factor {prf} is not supported")
    if scaling.get("mrope_section") is not None:
        raise UnsupportedVerifierError(f"{where}: mrope_section (multimodal RoPE) is not supported")
    return RopeView(scaling, float(theta), hd, int(max_pos))


def _layer_types(d: dict, mt: str, n: int) -> list[str]:
    """transformers 5.19's defaults when config.json predates ``layer_types``."""
    if d.get("layer_types") is not None:
        return list(d["layer_types"])
    window = d.get("sliding_window")
    if mt == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if mt == "gemma3_text":
        pattern = d.get("sliding_window_pattern", 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if mt == "mistral":
        return ["sliding_attention" if window else "full_attention"] * n
    if mt == "gpt_oss":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if mt in ("qwen2", "qwen3", "qwen3_moe"):
        on = bool(d.get("use_sliding_window")) and window is not None
        first = d.get("max_window_layers", 28) if mt != "qwen3_moe" else 0
        return ["sliding_attention" if on and i >= first else "full_attention" for i in range(n)]
    return ["full_attention"] * n


def text_tower(d: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The config of the language model: ``d`` itself, or a multimodal wrapper's
    ``text_config`` (the wrapper's ``tie_word_embeddings`` applies to it)."""
    mt = d.get("model_type")
    if mt == "kimi_k3" and isinstance(d.get("text_config"), dict):  # K3's release layout
        text = d["text_config"]
        if text.get("model_type") not in ("kimi_linear", "kimi_k3"):
            raise ValueError(
                f"{where}: model_type 'kimi_k3' needs a text_config of model_type "
                f"'kimi_linear', got {text.get('model_type')!r}"
            )
        return text
    if mt not in MULTIMODAL:
        return d
    text = hf_folder.text_config(d)
    if text is d or text.get("model_type") != MULTIMODAL[mt]:
        raise ValueError(
            f"{where}: model_type {mt!r} needs a text_config of model_type "
            f"{MULTIMODAL[mt]!r}, got {text.get('model_type') if text is not d else None!r}"
        )
    tied = d.get("tie_word_embeddings")
    return {**text, **({} if tied is None else {"tie_word_embeddings": tied})}


def verifier_config(d: dict[str, Any], where: str = "config.json") -> VerifierConfig:
    """A checked VerifierConfig from a config.json dict (refuses unsupported families)."""
    check_supported(d, where)
    quant = d.get("quantization_config")  # a multimodal wrapper's applies to its text tower
    d = text_tower(d, where)
    quant = d.get("quantization_config") or quant
    mt = d["model_type"]
    gemma = FAMILIES[mt] == "gemma"

    def need(key: str, default: Any = None):
        v = d.get(key, default)
        if v is None:
            raise ValueError(f"{where}: missing field {key!r}")
        return v

    # gpt-oss's MXFP4 experts and Kimi's in compressed-tensors' MXFP4 packing are
    # dequantized while reading (verifier/mxfp4.py); other schemes (FP8 DeepSeek/Kimi,
    # int4 compressed-tensors) are not read
    if quant and not _mxfp4_experts(quant, mt):
        raise UnsupportedVerifierError(
            f"{where}: quantization_config ({quant.get('quant_method', quant)}): the in-step "
            "verifier reads bf16/fp32 tensors and MXFP4 experts (gpt-oss's, Kimi's "
            "mxfp4-pack-quantized); use a dequantized checkpoint"
        )
    if d.get("use_bidirectional_attention"):
        raise UnsupportedVerifierError(f"{where}: use_bidirectional_attention is not causal")
    h, nh = int(need("hidden_size")), int(need("num_attention_heads"))
    n = int(need("num_hidden_layers"))
    nkv = int(d.get("num_key_value_heads") or nh)
    hd = int(d.get("head_dim") or h // nh)
    moe, mla, partial, mixers = {}, {}, {}, {}
    if FAMILIES[mt] == "deepseek":  # hd: the rotary part's width (RoPE's tables)
        moe, mla, hd, query_scale = _deepseek(d, n, need, where)
    elif FAMILIES[mt] == "kimi":
        if "max_position_embeddings" not in d:  # transformers 5.19 saves model_max_length
            d = {**d, "max_position_embeddings": d.get("model_max_length")}
        moe, mla, hd, query_scale = _deepseek(d, n, need, where, _kimi_moe(d, n, where))
        mla["mla_rope"] = False
        mixers = _kimi_mixers(d, n, need, where) | _kimi_k3(d, where)
    elif FAMILIES[mt] == "qwen3_next":
        mixers = _qwen3_next_mixers(d, n, need, where)
    elif FAMILIES[mt] == "glm":
        moe = _sigmoid_moe(d, n, need, where)
    elif FAMILIES[mt] == "gpt_oss":
        moe = dict(
            num_experts=int(need("num_local_experts")),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("intermediate_size")),
            layer_moe=(True,) * n,
            router="topk_softmax",
            attn_sinks=True,
            swiglu_limit=float(d.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
        )
    max_pos = int(need("max_position_embeddings"))
    act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    if act == "gelu_pytorch_tanh" or (gemma and act in ("gelu", "gelu_new")):
        act = "gelu_pytorch_tanh"
    if act not in ACTIVATIONS and not (act == "situ" and mixers.get("situ")):
        raise UnsupportedVerifierError(f"{where}: hidden_act {act!r}; supported {ACTIVATIONS}")
    if nh % nkv:
        raise ValueError(f"{where}: num_attention_heads {nh} % num_key_value_heads {nkv} != 0")

    types = ["full_attention"] * n if mixers else _layer_types(d, mt, n)
    if len(types) != n or any(t not in ATTENTION_TYPES for t in types):
        raise ValueError(f"{where}: layer_types {types} must be {n} of {ATTENTION_TYPES}")
    window = d.get("sliding_window")
    if "sliding_attention" in types and not window:
        raise ValueError(f"{where}: sliding_attention layers need a sliding_window")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)

    rp = d.get("rope_parameters")
    if mt == "gemma3_text":
        rp = dict(rp or {})
        full = dict(rp.get("full_attention") or {"rope_type": "default"})
        if d.get("rope_scaling"):
            full.update(d["rope_scaling"])
        full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
        local = dict(rp.get("sliding_attention") or {"rope_type": "default"})
        local.setdefault("rope_theta", d.get("rope_local_base_freq", 10_000.0))
        ropes = (
            ("full_attention", _rope_view(full, None, hd, max_pos, f"{where} rope (full)")),
            ("sliding_attention", _rope_view(local, None, hd, max_pos, f"{where} rope (sliding)")),
        )
        layer_rope = tuple(types)
    else:
        params = rp if rp is not None else (d.get("rope_scaling") or {})
        theta = d.get("rope_theta", 10_000.0)
        rd = hd
        if FAMILIES[mt] in ("glm", "qwen3_next"):  # RoPE tables of the rotary part only
            params = dict(params)
            prf = float(params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
            rd = int(hd * prf)
            if rd < hd:
                partial = {"rotary_dim": rd}
        ropes = (("all", _rope_view(params, theta, rd, max_pos, f"{where} rope_parameters")),)
        layer_rope = ("all",) * n

    qkv_bias = {"qwen2": True, "qwen3_moe": bool(d.get("attention_bias"))}.get(
        mt, bool(d.get("attention_bias"))
    )
    o_bias = False if mt in ("qwen2", "glm4_moe") else qkv_bias
    if mt in ("qwen3_moe", "qwen3_next"):
        e = int(d.get("num_experts") or need("num_local_experts"))  # 5.19 saves the latter
        step = int(d.get("decoder_sparse_step", 1))
        dense_layers = set(d.get("mlp_only_layers") or [])
        moe = dict(
            num_experts=e,
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            layer_moe=tuple(
                i not in dense_layers and e > 0 and (i + 1) % step == 0 for i in range(n)
            ),
        )
        if mt == "qwen3_next":  # one shared expert, gated
            moe["shared_intermediate_size"] = int(need("shared_expert_intermediate_size"))
            moe["shared_expert_gate"] = True
    if mt == "gemma3_text" and d.get("attn_logit_softcapping") is not None:
        # transformers 5.19's Gemma 3 attention never applies it (Gemma 2's does), so the
        # reference forward and ours would disagree on what the checkpoint means.
        raise UnsupportedVerifierError(
            f"{where}: attn_logit_softcapping on gemma3_text is ignored by transformers' "
            "Gemma 3; set it to null (the released Gemma 3 configs do)"
        )
    scalar = d.get("query_pre_attn_scalar") if gemma else None
    if not mla:  # MLA set its own scale
        query_scale = float(scalar) ** -0.5 if scalar else hd**-0.5
    return VerifierConfig(
        model_type=mt,
        vocab_size=int(need("vocab_size")),
        hidden_size=h,
        num_hidden_layers=n,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=hd,
        intermediate_size=int(need("intermediate_size")),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        hidden_act=act,
        gemma_norms=gemma,
        qk_norm=mt in ("qwen3", "qwen3_moe", "gemma3_text", "qwen3_next")
        or bool(d.get("use_qk_norm")),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(d.get("mlp_bias", False)) and mt == "llama",
        query_scale=query_scale,
        attn_softcap=d.get("attn_logit_softcapping") if gemma else None,
        final_softcap=d.get("final_logit_softcapping") if gemma else None,
        layer_windows=windows,
        layer_rope=layer_rope,
        ropes=ropes,
        **moe,
        **mla,
        **partial,
        **mixers,
        zero_centred_norms=mt == "qwen3_next",
        attn_output_gate=mt == "qwen3_next",
    )


def _sigmoid_moe(d: dict[str, Any], n: int, need, where: str) -> dict[str, Any]:
    """DeepSeek-V3's (and GLM-4.5's) experts: dense layers before first_k_dense_replace,
    then sigmoid-routed experts with the group limit and the shared experts."""
    e = int(need("n_routed_experts"))
    first_dense = int(d.get("first_k_dense_replace", 0))
    n_group, topk_group = int(d.get("n_group", 1)), int(d.get("topk_group", 1))
    if e % n_group or not 0 < topk_group <= n_group:
        raise ValueError(
            f"{where}: n_routed_experts {e}, n_group {n_group}, topk_group {topk_group}"
        )
    return dict(
        num_experts=e,
        num_experts_per_tok=int(need("num_experts_per_tok")),
        moe_intermediate_size=int(need("moe_intermediate_size")),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        layer_moe=tuple(i >= first_dense for i in range(n)),
        router="sigmoid",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        n_shared_experts=int(d.get("n_shared_experts", 0)),
    )


# Kimi-Linear's config.json names of DeepSeek-V3's expert fields (transformers 5.19's
# KimiLinearConfig.attribute_map)
KIMI_MOE_NAMES = {
    "num_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_expert_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
    "num_shared_experts": "n_shared_experts",
}


def _kimi_moe(d: dict[str, Any], n: int, where: str) -> dict[str, Any]:
    """Kimi-Linear's experts: DeepSeek-V3's sigmoid routing under Kimi's names, its dense
    layers from ``mlp_layer_types`` or ``first_k_dense_replace`` (and ``moe_layer_freq``)."""
    act = d.get("moe_router_activation_func", "sigmoid")
    if act != "sigmoid":
        raise UnsupportedVerifierError(f"{where}: moe_router_activation_func {act!r}")
    if not d.get("num_experts"):
        return {}
    types = d.get("mlp_layer_types")
    if types is None:
        first = int(d.get("first_k_dense_replace", 1))
        freq = int(d.get("moe_layer_freq", 1))
        types = ["sparse" if i >= first and i % freq == 0 else "dense" for i in range(n)]
    if len(types) != n or any(t not in ("dense", "sparse") for t in types):
        raise ValueError(f"{where}: mlp_layer_types {types} must be {n} of dense/sparse")
    as_deepseek = {**d, **{ds: d[k] for k, ds in KIMI_MOE_NAMES.items() if k in d}}
    kimi_name = {ds: k for k, ds in KIMI_MOE_NAMES.items()}

    def need(key: str, default: Any = None):
        v = as_deepseek.get(key, default)
        if v is None:
            raise ValueError(f"{where}: missing field {kimi_name.get(key, key)!r}")
        return v

    moe = _sigmoid_moe(as_deepseek, n, need, where)
    return {**moe, "layer_moe": tuple(t == "sparse" for t in types)}


def _kimi_mixers(d: dict[str, Any], n: int, need, where: str) -> dict[str, Any]:
    """Which layers are KDA, and KDA's shape: ``layer_types`` (linear_attention /
    full_attention), else ``linear_attn_config``'s 1-indexed ``kda_layers`` and
    ``full_attn_layers`` (the Hub's), else transformers' default (every 4th layer but the
    first full)."""
    lac = d.get("linear_attn_config") or {}
    types = d.get("layer_types")
    if types is None and "kda_layers" in lac and "full_attn_layers" in lac:
        types = [None] * n
        for i in lac["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in lac["kda_layers"]:
            types[i - 1] = "linear_attention"
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or any(t not in ("full_attention", "linear_attention") for t in types):
        raise ValueError(
            f"{where}: layer_types {types} must be {n} of full_attention/linear_attention"
        )
    if d.get("mla_use_nope") is False:
        raise UnsupportedVerifierError(
            f"{where}: mla_use_nope false: transformers' Kimi-Linear MLA never applies RoPE"
        )
    heads = int(lac.get("num_heads", d.get("linear_num_heads", 32)))
    dim = int(lac.get("head_dim", d.get("linear_head_dim", 128)))
    return dict(
        layer_mixers=tuple("kda" if t == "linear_attention" else "attention" for t in types),
        linear_heads=heads,
        linear_v_dim=dim,
        linear_conv=int(lac.get("short_conv_kernel_size", d.get("linear_conv_kernel_dim", 4))),
    ) | dict(linear_k_heads=heads, linear_k_dim=dim)


def _mxfp4_experts(quant: dict[str, Any], mt: str) -> bool:
    """A quantization_config the reader dequantizes: gpt-oss's ``mxfp4``, or on Kimi's
    families compressed-tensors whose every format is ``mxfp4-pack-quantized`` (the
    experts' ``weight_packed`` / ``weight_scale``; an unpacked tensor is read as is)."""
    if FAMILIES.get(mt) == "gpt_oss":
        return quant.get("quant_method") == "mxfp4"
    if FAMILIES.get(mt) != "kimi" or quant.get("quant_method") != "compressed-tensors":
        return False
    groups = (quant.get("config_groups") or {}).values()
    formats = {quant.get("format")} | {g.get("format") for g in groups if isinstance(g, dict)}
    return formats - {None} == {"mxfp4-pack-quantized"}


def _kimi_k3(d: dict[str, Any], where: str) -> dict[str, Any]:
    """Kimi-K3's fields on its Kimi-Linear text config, as sglang-jax's port reads them
    (``attn_res_block_size``, ``hidden_act: situ`` with ``activation_situ_beta`` and
    ``activation_situ_linear_beta``, ``mla_use_output_gate``,
    ``linear_attn_config.use_full_rank_gate``, ``routed_expert_hidden_size``,
    ``latent_moe_use_norm``)."""
    out: dict[str, Any] = {}
    block = d.get("attn_res_block_size")
    if block is not None:
        if int(block) < 1:
            raise ValueError(f"{where}: attn_res_block_size {block} must be >= 1")
        out["attn_res_block"] = int(block)
    if d.get("hidden_act") == "situ":
        beta, linear = d.get("activation_situ_beta"), d.get("activation_situ_linear_beta")
        if beta is None:
            raise ValueError(f"{where}: hidden_act situ needs activation_situ_beta")
        out["situ"] = (float(beta), None if linear is None else float(linear))
    out["mla_output_gate"] = bool(d.get("mla_use_output_gate", False))
    out["kda_full_rank_gate"] = bool((d.get("linear_attn_config") or {}).get("use_full_rank_gate"))
    latent = d.get("routed_expert_hidden_size")
    if latent is not None:
        out["latent_moe"] = int(latent)
        out["latent_moe_norm"] = bool(d.get("latent_moe_use_norm", False))
    return out


def _qwen3_next_mixers(d: dict[str, Any], n: int, need, where: str) -> dict[str, Any]:
    """Which layers are Gated DeltaNet (``layer_types`` linear_attention, else transformers'
    default: every ``full_attention_interval``-th layer full) and its shape."""
    types = d.get("layer_types")
    if types is None:
        every = int(d.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or any(t not in ("full_attention", "linear_attention") for t in types):
        raise ValueError(
            f"{where}: layer_types {types} must be {n} of full_attention/linear_attention"
        )
    out = dict(
        layer_mixers=tuple("gdn" if t == "linear_attention" else "attention" for t in types),
        linear_heads=int(need("linear_num_value_heads")),
        linear_v_dim=int(need("linear_value_head_dim")),
        linear_k_heads=int(need("linear_num_key_heads")),
        linear_k_dim=int(need("linear_key_head_dim")),
        linear_conv=int(need("linear_conv_kernel_dim")),
    )
    if out["linear_heads"] % out["linear_k_heads"]:
        raise ValueError(f"{where}: linear_num_value_heads {out['linear_heads']} % "
                         f"linear_num_key_heads {out['linear_k_heads']} != 0")  # fmt: skip
    return out


def _deepseek(d: dict[str, Any], n: int, need, where: str, moe: dict | None = None):
    """DeepSeek-V3's MoE (unless given) and MLA fields, its rotary head width and query
    scale (transformers 5.19 ``modeling_deepseek_v3``: ``scaling = qk_head_dim**-0.5``,
    times yarn's ``mscale(factor, mscale_all_dim)**2`` for a scaled rope)."""
    from dspark_jax.config import yarn_get_mscale

    nh, nkv = int(need("num_attention_heads")), int(d.get("num_key_value_heads") or 0)
    if nkv and nkv != nh:
        raise UnsupportedVerifierError(
            f"{where}: num_key_value_heads {nkv} != num_attention_heads {nh}: MLA expands "
            "its latent to every head"
        )
    if d.get("attention_bias"):
        raise UnsupportedVerifierError(f"{where}: attention_bias on MLA is not supported")
    moe = _sigmoid_moe(d, n, need, where) if moe is None else moe
    q_lora = d.get("q_lora_rank")
    mla = dict(
        mla=True,
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(need("kv_lora_rank")),
        qk_nope_head_dim=int(need("qk_nope_head_dim")),
        qk_rope_head_dim=int(need("qk_rope_head_dim")),
        v_head_dim=int(need("v_head_dim")),
        rope_interleave=bool(d.get("rope_interleave", True)),
    )
    scale = (mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]) ** -0.5
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rp.get("rope_type", rp.get("type", "default")) != "default" and rp.get("mscale_all_dim"):
        scale *= yarn_get_mscale(rp["factor"], rp["mscale_all_dim"]) ** 2
    return moe, mla, mla["qk_rope_head_dim"], scale


def load_verifier_config(folder: str | os.PathLike) -> VerifierConfig:
    """The VerifierConfig of an HF folder; refuses unsupported families first."""
    path = Path(folder) / "config.json"
    return verifier_config(read_config_dict(folder), str(path))
