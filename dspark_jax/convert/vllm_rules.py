"""What vLLM 0.33.0 does with a DSpark drafter folder, rule by rule, and the commands
that serve it (``python -m converters check``, the default ``--target vllm``).

Every rule comes from vLLM 0.33.0's released source and names the file it is read
from (``RULES``; paths inside the wheel). A message ends with ``[rule: file]``.
Only what breaks serving is an error (a load error, a crash, or a drafter served
other than it was trained); what serves but loses something is a warning; the rest
are notes. Without ``verifier`` the verifier-dependent rules compare with the
drafter's own ``transformer_layer_config`` (a note says so).

numpy + safetensors only, like :mod:`dspark_jax.convert.check`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors reads BF16)
import numpy as np
from safetensors import safe_open

from dspark_jax import hf_folder
from dspark_jax.config import is_int, is_num

RULES: dict[str, str] = {
    # rule: the vLLM 0.33.0 file it follows
    "speculators-format": "vllm/transformers_utils/config.py",
    "speculators-config": "vllm/transformers_utils/configs/speculators/base.py",
    "algorithm": "vllm/transformers_utils/configs/speculators/algos.py",
    "verifier-name": "vllm/transformers_utils/config.py",
    "serve-form": "vllm/engine/arg_utils.py",
    "spec-tokens": "vllm/config/speculative.py",
    "layer-config": "vllm/model_executor/models/qwen3_dflash.py",
    "rope": "vllm/model_executor/models/qwen3_dflash.py",
    "sliding-window": "vllm/model_executor/models/qwen3_dflash.py",
    "aux-layers": "vllm/transformers_utils/configs/speculators/algos.py",
    "aux-order": "vllm/model_executor/models/interfaces.py",
    "aux-range": "vllm/model_executor/models/qwen2.py",
    "sample-from-anchor": "vllm/transformers_utils/configs/speculators/algos.py",
    "mask-token": "vllm/v1/worker/gpu/spec_decode/utils.py",
    "markov-head": "vllm/model_executor/models/qwen3_dspark.py",
    "confidence-head": "vllm/model_executor/models/qwen3_dspark.py",
    "confidence-fp32": "vllm/model_executor/models/qwen3_dspark.py",
    "calibration": "vllm/v1/worker/gpu/spec_decode/adaptive_verification.py",
    "verifier-vocab": "vllm/model_executor/models/qwen3_dspark.py",
    "verifier-hidden": "vllm/model_executor/models/qwen3_dflash.py",
    "tensor-parallel": "vllm/model_executor/models/qwen3_dflash.py",
    "weights": "vllm/model_executor/models/utils.py",
    "weight-shapes": "vllm/model_executor/model_loader/weight_utils.py",
    "explicit-defaults": "vllm/transformers_utils/configs/speculators/algos.py",
    "architecture": "vllm/transformers_utils/configs/speculators/algos.py",
    "vocab-roundtrip": "vllm/model_executor/models/qwen3_dspark.py",
}
# update_dspark keeps only these from the top-level 'architectures' (else Qwen3DSparkModel);
# both resolve to qwen3_dspark.Qwen3DSparkForCausalLM in vLLM's model registry.
SERVED_ARCHITECTURES = ("Qwen3DSparkModel", "Qwen3OmniDSparkModel")
# Fields update_dspark / Qwen3DSpark read with a default when absent: (default, effect).
DEFAULTED = {
    "markov_head_type": "'vanilla'",
    "block_size": "none (the --spec-model form then drafts --spec-tokens, else fails)",
    "draft_vocab_size": "transformer_layer_config.vocab_size",
    "enable_confidence_head": "false (the head is dropped)",
    "confidence_head_with_markov": "false",
}
FLOAT_DTYPES = ("BF16", "F16", "F32")
INT_DTYPES = ("I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64")
CALIBRATION_FILE = "calibration.json"  # written by export --calibration (what was folded)
# huggingface_hub.utils.validate_repo_id, which vLLM calls on the verifier name.
_REPO_ID = re.compile(r"(\b[\w\-.]{1,96}\b/)?\b[\w\-.]{1,96}\b")


def tag(rule: str) -> str:
    return f"[{rule}: {RULES[rule]}]"


@dataclasses.dataclass(frozen=True)
class Verifier:
    """The verifier geometry the rules need (its config.json; text_config if nested)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    source: str


def read_verifier(path_or_config: str | os.PathLike) -> Verifier:
    """A verifier folder (its config.json) or a config.json file -> :class:`Verifier`."""
    path = Path(path_or_config)
    cfg_path = path / "config.json" if path.is_dir() else path
    try:
        d = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"--verifier {path}: expected a folder with config.json or a config.json file"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--verifier {cfg_path}: not valid JSON ({e})") from None
    if isinstance(d, dict):
        d = hf_folder.text_config(d)
    values = {}
    for name in ("vocab_size", "hidden_size", "num_hidden_layers"):
        v = d.get(name) if isinstance(d, dict) else None
        if not is_int(v) or v <= 0:
            raise ValueError(f"--verifier {cfg_path}: {name!r} must be a positive int, got {v!r}")
        values[name] = v
    return Verifier(**values, source=str(path))


def valid_repo_id(name: Any) -> bool:
    """huggingface_hub's ``validate_repo_id``: 'name' or 'namespace/name'."""
    return (
        isinstance(name, str)
        and name.count("/") <= 1
        and _REPO_ID.fullmatch(name) is not None
        and "--" not in name
        and ".." not in name
        and not name.endswith(".git")
    )


def draft_layer_tensors(
    num_layers: int, h: int, nh: int, nkv: int, hd: int, inter: int, attention_bias: bool
) -> dict[str, tuple[int, ...]]:
    """The decoder layers' tensors of a DSpark draft, torch layout ([out, in]): the
    Qwen3 layer names both engines map (vLLM's Qwen3DSpark, sglang-jax's dflash.py)."""
    out = {}
    for i in range(num_layers):
        p = f"layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (nh * hd, h),
                p + "self_attn.k_proj.weight": (nkv * hd, h),
                p + "self_attn.v_proj.weight": (nkv * hd, h),
                p + "self_attn.o_proj.weight": (h, nh * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
        if attention_bias:
            for name, n in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
                out[p + f"self_attn.{name}.bias"] = (n,)
            out[p + "self_attn.o_proj.bias"] = (h,)
    return out


@dataclasses.dataclass(frozen=True)
class Served:
    """The drafter vLLM 0.33 builds from config.json, its own defaults applied
    (``update_dspark`` in algos.py, ``Qwen3DSparkForCausalLM`` in qwen3_dspark.py)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int  # transformer_layer_config.vocab_size: embed_tokens and markov_w1 rows
    draft_vocab_size: int  # lm_head and markov_w2 rows; default vocab_size
    target_hidden_size: int | None
    aux_layer_ids: tuple[int, ...]
    markov_rank: int
    attention_bias: bool
    confidence_head: bool  # enable_confidence_head, default False
    confidence_with_markov: bool  # confidence_head_with_markov, default False
    sample_from_anchor: bool  # default False
    block_size: int | None
    speculative_tokens: int | None  # speculators_config.proposal_methods[0]
    verifier_name: Any

    @property
    def trained_tokens(self) -> int | None:
        """Draft positions the drafter was trained on (None without block_size)."""
        if self.block_size is None:
            return None
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def required_tensors(self) -> dict[str, tuple[int, ...]]:
        """Parameters vLLM leaves uninitialised when their tensor is missing."""
        h, nh, nkv, hd, inter = (
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.intermediate_size,
        )
        fc_in = len(self.aux_layer_ids) * (self.target_hidden_size or h)
        out = {"fc.weight": (h, fc_in), "hidden_norm.weight": (h,), "norm.weight": (h,)}
        out |= draft_layer_tensors(
            self.num_hidden_layers, h, nh, nkv, hd, inter, self.attention_bias
        )
        out["markov_head.markov_w1.weight"] = (self.vocab_size, self.markov_rank)
        out["markov_head.markov_w2.weight"] = (self.draft_vocab_size, self.markov_rank)
        return out

    def optional_tensors(self) -> dict[str, tuple[int, ...]]:
        """Tensors vLLM loads when present (else shares the verifier's, or drops them)."""
        h = self.hidden_size
        extra = self.markov_rank if self.confidence_with_markov else 0
        return {
            "lm_head.weight": (self.draft_vocab_size, h),
            "embed_tokens.weight": (self.vocab_size, h),
            "d2t": (self.draft_vocab_size,),
            "confidence_head.proj.weight": (1, h + extra),
            "confidence_head.proj.bias": (1,),
        }


@dataclasses.dataclass
class Findings:
    errors: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    served: Served | None = None
    folder_form: bool = True  # `vllm serve <folder>` works (verifier-name)
    rule_tag = staticmethod(tag)  # "[rule: file]" of the engine's rules (not a field)

    def err(self, rule: str, msg: str) -> None:
        self.errors.append(f"{msg} {self.rule_tag(rule)}")

    def warn(self, rule: str, msg: str) -> None:
        self.warnings.append(f"{msg} {self.rule_tag(rule)}")

    def note(self, rule: str, msg: str) -> None:
        self.notes.append(f"{msg} {self.rule_tag(rule)}")


# ---------------------------------------------------------------- config.json
def _field(f: Findings, d: dict, name: str, kind: str, rule: str, where: str, why: str = ""):
    """``d[name]`` when present and of ``kind`` (int, num, bool, str); None otherwise."""
    if d.get(name) is None:
        f.err(rule, f"config.json: {where}{name!r} is missing{why}")
        return None
    v = d[name]
    ok = {
        "int": is_int(v) and v > 0,
        "num": is_num(v),
        "bool": isinstance(v, bool),
        "str": isinstance(v, str),
    }[kind]
    if not ok:
        want = "a positive int" if kind == "int" else kind
        f.err(rule, f"config.json: {where}{name!r} must be {want}, got {v!r}")
        return None
    return v


def _format(d: dict, f: Findings) -> dict | None:
    """Speculators detection and the structure vLLM validates; the speculators_config."""
    if "model_type" in d:
        f.err(
            "speculators-format",
            f"config.json: top-level 'model_type' ({d['model_type']!r}) must be absent: vLLM "
            "reads a folder as speculators format only without it",
        )
    sc = d.get("speculators_config")
    if not isinstance(sc, dict):
        f.err(
            "speculators-format",
            f"config.json: 'speculators_config' must be an object, got {sc!r} (vLLM detects "
            "the speculators format by it)",
        )
        sc = None
    algo = d.get("speculators_model_type")
    if algo != "dspark":
        f.err("algorithm", f"config.json: 'speculators_model_type' must be 'dspark', got {algo!r}")
    if not isinstance(d.get("transformer_layer_config"), dict):
        f.err(
            "speculators-config",
            "config.json: 'transformer_layer_config' must be an object (it becomes the "
            f"draft's config), got {d.get('transformer_layer_config')!r}",
        )
    if sc is None:
        return None
    methods = sc.get("proposal_methods")
    if (
        not isinstance(methods, list)
        or not methods
        or not isinstance(methods[0], dict)
        or "speculative_tokens" not in methods[0]
    ):
        f.err(
            "speculators-config",
            "config.json: speculators_config.proposal_methods[0].speculative_tokens is "
            "missing (vLLM: 'Invalid speculators config structure')",
        )
    elif not is_int(methods[0]["speculative_tokens"]) or methods[0]["speculative_tokens"] < 1:
        f.err(
            "speculators-config",
            "config.json: speculators_config.proposal_methods[0].speculative_tokens must be "
            f"a positive int, got {methods[0]['speculative_tokens']!r}",
        )
    verifier = sc.get("verifier")
    if not isinstance(verifier, dict) or "name_or_path" not in verifier:
        f.err(
            "speculators-config",
            "config.json: speculators_config.verifier.name_or_path is missing (vLLM: "
            "'Invalid speculators config structure')",
        )
    return sc


def _verifier_name(name: Any, f: Findings) -> None:
    """`vllm serve <folder>` replaces the model by this name: a Hub repo id only."""
    if not valid_repo_id(name):
        why = "is not set" if name is None else f"{name!r} is not a Hugging Face repo id"
    elif Path(name).exists() or Path(name).is_symlink():
        why = f"{name!r} is an existing local path (relative to {Path.cwd()})"
    else:
        return
    f.folder_form = False
    f.warn(
        "verifier-name",
        f"config.json: speculators_config.verifier.name_or_path {why}: `vllm serve <folder>` "
        "fails ('Speculators verifier must name a remote model repository'); serve with "
        "--spec-model, or export with --verifier-name ORG/NAME",
    )


def _layer_config(tl: dict, f: Findings) -> dict[str, Any] | None:
    """The Qwen3 fields DFlashQwen3DecoderLayer reads (no defaults: AttributeError)."""
    w = "transformer_layer_config."
    out: dict[str, Any] = {}
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "vocab_size",
        "max_position_embeddings",
    ):
        out[name] = _field(f, tl, name, "int", "layer-config", w)
    _field(f, tl, "rms_norm_eps", "num", "layer-config", w)
    act = _field(f, tl, "hidden_act", "str", "layer-config", w)
    if act is not None and act != "silu":
        f.err("layer-config", f"config.json: {w}hidden_act must be 'silu' (Qwen2MLP), got {act!r}")
    head_dim = tl.get("head_dim")
    if head_dim is not None and (not is_int(head_dim) or head_dim <= 0):
        f.err("layer-config", f"config.json: {w}head_dim must be a positive int, got {head_dim!r}")
        head_dim = None
    bias = tl.get("attention_bias", False)
    if not isinstance(bias, bool):
        f.err("layer-config", f"config.json: {w}attention_bias must be bool, got {bias!r}")
    # RoPE: a legacy top-level rope_theta is moved into rope_parameters (patch_rope_parameters).
    rope = tl.get("rope_parameters") if isinstance(tl.get("rope_parameters"), dict) else {}
    theta = rope.get("rope_theta", tl.get("rope_theta"))
    if not is_num(theta):
        f.err(
            "rope",
            f"config.json: {w}rope_parameters.rope_theta is missing: vLLM defaults it to 1e6 "
            "(set_default_rope_theta), whatever the drafter was trained with",
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        f.note("rope", f"config.json: {w}rope_type {rope_type!r}: served as configured")
    layer_types = tl.get("layer_types")
    sliding = False
    if layer_types is not None:
        n = out["num_hidden_layers"]
        if not isinstance(layer_types, list) or any(
            t not in ("full_attention", "sliding_attention") for t in layer_types
        ):
            f.err(
                "sliding-window",
                f"config.json: {w}layer_types must list 'full_attention' / 'sliding_attention', "
                f"got {layer_types!r}",
            )
        elif n is not None and len(layer_types) != n:
            f.err(
                "sliding-window",
                f"config.json: {w}layer_types has {len(layer_types)} entries, "
                f"num_hidden_layers is {n}",
            )
        else:
            sliding = "sliding_attention" in layer_types
    if sliding:
        sw = tl.get("sliding_window")
        if not is_int(sw) or sw <= 0:
            f.err(
                "sliding-window",
                f"config.json: {w}sliding_window must be a positive int for sliding_attention "
                f"layers, got {sw!r}",
            )
    if None in out.values():
        return None
    out["head_dim"] = head_dim or out["hidden_size"] // out["num_attention_heads"]
    out["attention_bias"] = bias is True
    out["sliding"] = sliding
    return out


def _dspark_fields(d: dict, geo: dict, sc: dict | None, f: Findings) -> Served | None:
    """update_dspark's fields, with vLLM's defaults for the missing optional ones."""
    missing = [k for k in DEFAULTED if d.get(k) is None]
    if missing:
        f.warn(
            "explicit-defaults",
            "config.json: "
            + ", ".join(f"{k!r} (vLLM uses {DEFAULTED[k]})" for k in missing)
            + " not written: served with vLLM's default, which need not be what was trained "
            "(export writes every one)",
        )
    arch = d.get("architectures")
    arch = arch if isinstance(arch, list) else []
    chosen = [a for a in arch if a in SERVED_ARCHITECTURES] or ["Qwen3DSparkModel"]
    dropped = [a for a in arch if a not in SERVED_ARCHITECTURES]
    f.note(
        "architecture",
        f"vLLM 0.33 serves it as {chosen[0]} (qwen3_dspark.Qwen3DSparkForCausalLM, Qwen3 "
        "decoder layers)"
        + (
            f"; 'architectures' {dropped} dropped (update_dspark keeps only "
            f"{list(SERVED_ARCHITECTURES)}; vLLM's registry maps 'DSparkDraftModel' to the "
            "DeepSeek-V4 DSpark)"
            if dropped
            else ""
        ),
    )
    aux = d.get("aux_hidden_state_layer_ids")
    if aux is None:
        f.err(
            "aux-layers", "config.json: 'aux_hidden_state_layer_ids' is missing (vLLM indexes it)"
        )
    elif not isinstance(aux, list) or not aux or not all(is_int(i) and i >= 0 for i in aux):
        f.err(
            "aux-layers",
            f"config.json: 'aux_hidden_state_layer_ids' must be a non-empty list of "
            f"non-negative ints, got {aux!r}",
        )
        aux = None
    elif len(set(aux)) != len(aux) or aux != sorted(aux):
        f.err(
            "aux-order",
            f"config.json: 'aux_hidden_state_layer_ids' {aux} must be distinct and ascending: "
            "vLLM captures each layer once and concatenates them in ascending order, so fc "
            "would see its inputs permuted",
        )
    sfa = d.get("sample_from_anchor")
    if not isinstance(sfa, bool):
        f.err(
            "sample-from-anchor",
            f"config.json: 'sample_from_anchor' must be true or false, got {sfa!r} (vLLM reads "
            "a missing value as false, speculators' DSpark as true: a mismatch drafts from "
            "the wrong slots, <1% acceptance)",
        )
    mask = d.get("mask_token_id")
    if not is_int(mask) or not 0 <= mask < geo["vocab_size"]:
        f.err(
            "mask-token",
            f"config.json: 'mask_token_id' must be an int in [0, vocab_size="
            f"{geo['vocab_size']}) (vLLM fills the draft slots with it), got {mask!r}",
        )
    rank = d.get("markov_rank")
    if not is_int(rank) or rank <= 0:
        f.err(
            "markov-head",
            f"config.json: 'markov_rank' must be a positive int (vLLM always builds the "
            f"Markov head from it), got {rank!r}",
        )
    head = d.get("markov_head_type", "vanilla")
    if head != "vanilla":
        f.err(
            "markov-head",
            f"config.json: markov_head_type={head!r} is not served by vLLM: its Qwen3DSpark "
            "has only the vanilla Markov head (export gated/rnn heads with --target "
            "speculators)",
        )
    vd = d.get("draft_vocab_size", geo["vocab_size"])
    if vd is None:
        vd = geo["vocab_size"]
    if not is_int(vd) or vd <= 0:
        f.err(
            "verifier-vocab", f"config.json: 'draft_vocab_size' must be a positive int, got {vd!r}"
        )
    ths = d.get("target_hidden_size")
    if ths is not None and (not is_int(ths) or ths <= 0):
        f.err(
            "verifier-hidden",
            f"config.json: 'target_hidden_size' must be a positive int or null, got {ths!r}",
        )
    flags = {}
    for name in ("enable_confidence_head", "confidence_head_with_markov"):
        v = d.get(name, False)
        if not isinstance(v, bool):
            f.err("confidence-head", f"config.json: {name!r} must be bool, got {v!r}")
        flags[name] = v is True
    block = d.get("block_size")
    if block is not None and (not is_int(block) or block < 1):
        f.err("spec-tokens", f"config.json: 'block_size' must be a positive int, got {block!r}")
        block = None
    if d.get("sliding_window_non_causal") is True and geo["sliding"]:
        f.err(
            "sliding-window",
            "config.json: sliding_window_non_causal=true is not served: vLLM runs "
            "sliding_attention layers causal inside the block (update_dspark does not "
            "forward the setting; the drafter was trained bidirectional there)",
        )
    if f.errors:
        return None
    methods = sc.get("proposal_methods") if sc else None
    return Served(
        hidden_size=geo["hidden_size"],
        intermediate_size=geo["intermediate_size"],
        num_attention_heads=geo["num_attention_heads"],
        num_key_value_heads=geo["num_key_value_heads"],
        head_dim=geo["head_dim"],
        num_hidden_layers=geo["num_hidden_layers"],
        vocab_size=geo["vocab_size"],
        draft_vocab_size=vd,
        target_hidden_size=ths,
        aux_layer_ids=tuple(aux),
        markov_rank=rank,
        attention_bias=geo["attention_bias"],
        confidence_head=flags["enable_confidence_head"],
        confidence_with_markov=flags["confidence_head_with_markov"],
        sample_from_anchor=sfa,
        block_size=block,
        speculative_tokens=methods[0]["speculative_tokens"] if methods else None,
        verifier_name=(sc.get("verifier") or {}).get("name_or_path") if sc else None,
    )


def _spec_tokens(s: Served, f: Findings) -> None:
    """`--spec-model` drafts block_size tokens unless --spec-tokens is given; the folder
    form drafts speculative_tokens. Either way: no more than were trained."""
    trained = s.trained_tokens
    if trained is None:
        f.note(
            "spec-tokens",
            "config.json: no 'block_size': the --spec-model form needs --spec-tokens "
            f"(given below: {s.speculative_tokens})",
        )
        return
    n = s.speculative_tokens
    why = (
        f"block_size={s.block_size} with sample_from_anchor={str(s.sample_from_anchor).lower()} "
        f"trains {trained} draft positions"
    )
    if n > trained:
        f.err(
            "spec-tokens",
            f"config.json: speculators_config.proposal_methods[0].speculative_tokens is {n}, "
            f"but {why}: vLLM would draft untrained positions",
        )
    elif n < trained:
        f.warn(
            "spec-tokens",
            f"config.json: speculators_config.proposal_methods[0].speculative_tokens is {n}, "
            f"but {why}: vLLM drafts only {n}",
        )


def _verifier_rules(s: Served, v: Verifier | None, f: Findings) -> int:
    """Layer range and hidden size against the verifier; returns its vocabulary size."""
    if v is None:
        f.note(
            "verifier-vocab",
            "no --verifier: its vocabulary is taken to be transformer_layer_config.vocab_size "
            f"({s.vocab_size}); aux layer range and hidden size are not checked",
        )
        return s.vocab_size
    n = v.num_hidden_layers
    beyond = [i for i in s.aux_layer_ids if i > n]
    if beyond:
        f.err(
            "aux-range",
            f"config.json: aux_hidden_state_layer_ids {list(s.aux_layer_ids)} include {beyond}, "
            f"beyond the verifier's {n} layers ({v.source}): vLLM captures layers 0..{n} only, "
            "and fc then gets fewer features than it expects",
        )
    width = s.target_hidden_size or s.hidden_size
    if width != v.hidden_size:
        f.err(
            "verifier-hidden",
            f"config.json: fc takes {len(s.aux_layer_ids)} x {width} features "
            f"(target_hidden_size or hidden_size), but the verifier ({v.source}) has hidden "
            f"size {v.hidden_size}",
        )
    return v.vocab_size


def _tensor_parallel(s: Served, tp: int, f: Findings) -> None:
    if tp <= 1:
        return
    kv = s.num_key_value_heads
    bad = []
    if s.num_attention_heads % tp:
        bad.append(f"num_attention_heads={s.num_attention_heads}")
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        bad.append(f"num_key_value_heads={kv}")
    if s.intermediate_size % tp:
        bad.append(f"intermediate_size={s.intermediate_size}")
    if bad:
        f.err(
            "tensor-parallel",
            f"config.json: {', '.join(bad)} not divisible by --tensor-parallel-size {tp} (heads "
            "and MLP are split over the ranks; KV heads must divide or be divided by it): "
            "serve the drafter unsplit with --speculative-config "
            "'{\"draft_tensor_parallel_size\": 1}'",
        )


# ---------------------------------------------------------------- tensors
def _tensors(
    s: Served,
    headers: dict[str, tuple[tuple, str, Path]],
    target_vocab: int,
    folder: Path,
    f: Findings,
) -> None:
    required, optional = s.required_tensors(), s.optional_tensors()
    reduced = s.draft_vocab_size < target_vocab
    for key, shape in required.items():
        if key not in headers:
            f.err(
                "weights",
                f"missing tensor {key!r} {list(shape)}: vLLM never reports it and serves it "
                "uninitialised",
            )
    need = []
    if s.draft_vocab_size != target_vocab:
        need.append("lm_head.weight")  # the verifier head has another row count
    if reduced:
        need.append("d2t")
    if s.vocab_size > target_vocab:
        need.append("embed_tokens.weight")
    for key in need:
        if key not in headers:
            f.err(
                "verifier-vocab",
                f"missing tensor {key!r}: the drafter's vocabulary (draft {s.draft_vocab_size}, "
                f"input {s.vocab_size}) differs from the verifier's ({target_vocab}), which vLLM "
                "compares with, so it cannot share the verifier's",
            )
    if "d2t" in headers and not reduced:
        f.err(
            "verifier-vocab",
            f"unexpected tensor 'd2t': draft_vocab_size {s.draft_vocab_size} is not below the "
            f"verifier's vocabulary ({target_vocab}), so vLLM has no draft_id_to_target_id to "
            "load it into (load error)",
        )
    if s.vocab_size < target_vocab:
        f.err(
            "verifier-vocab",
            f"markov_w1 has vocab_size={s.vocab_size} rows but the verifier emits ids up to "
            f"{target_vocab - 1}: vLLM indexes it with the sampled verifier token",
        )
    conf = [k for k in headers if k.startswith("confidence_head.")]
    if conf and not s.confidence_head:
        f.warn(
            "confidence-head",
            f"tensors {sorted(conf)} are dropped: enable_confidence_head is false or missing "
            "(vLLM's default)",
        )
    elif s.confidence_head and not conf:
        f.warn(
            "confidence-head",
            "enable_confidence_head=true but no confidence_head tensors: vLLM drops the head",
        )
    for key in sorted(headers):
        shape, dtype, _ = headers[key]
        if "t2d" in key or "mask_embedding" in key:
            continue  # skipped / dropped by Qwen3DSparkForCausalLM.load_weights
        if key.startswith("confidence_head.") and not s.confidence_head:
            continue
        want = required.get(key, optional.get(key))
        if want is None:
            kind = "a bias vLLM silently drops" if key.endswith(".bias") else "a load error"
            f.err(
                "weights",
                f"unexpected tensor {key!r} {list(shape)}: not a parameter of vLLM's "
                f"Qwen3DSpark ({kind})",
            )
            continue
        if shape != want:
            hint = ""
            if key == "confidence_head.proj.weight":
                hint = (
                    f" (confidence_head_with_markov={str(s.confidence_with_markov).lower()}; "
                    "vLLM reads a missing value as false)"
                )
            f.err(
                "weight-shapes",
                f"tensor {key!r} has shape {list(shape)}, vLLM's parameter is {list(want)}{hint}",
            )
        if key == "d2t":
            if dtype not in INT_DTYPES:
                f.err("weights", f"tensor 'd2t' has dtype {dtype}, expected an integer dtype")
        elif dtype not in FLOAT_DTYPES:
            f.err("weights", f"tensor {key!r} has dtype {dtype}, expected BF16/F16/F32")
        elif key.startswith("confidence_head.") and dtype != "F32":
            f.warn(
                "confidence-fp32",
                f"tensor {key!r} is {dtype}: vLLM holds the confidence head in fp32, so the "
                "trained fp32 values were rounded (export writes F32)",
            )
    if s.confidence_head and conf and not (folder / CALIBRATION_FILE).is_file():
        f.note(
            "calibration",
            "the confidence head is uncalibrated: vLLM's adaptive verification multiplies the "
            "raw per-slot sigmoids and reads no temperature (export --calibration folds one in)",
        )
    if f.errors:
        return
    # Values: finite floats, d2t inside the verifier vocabulary.
    for key, (_, _, path) in headers.items():
        if "t2d" in key:
            continue
        with safe_open(path, "np") as fh:
            value = fh.get_tensor(key)
        if key == "d2t":
            ids = value.astype(np.int64) + np.arange(len(value))
            if ids.min() < 0 or ids.max() >= target_vocab:
                f.err(
                    "verifier-vocab",
                    f"tensor 'd2t': draft_id + d2t must be verifier ids in [0, {target_vocab})",
                )
            else:
                _vocab_roundtrip(ids, headers, target_vocab, f)
        elif not np.isfinite(value.astype(np.float32)).all():
            f.errors.append(f"tensor {key!r} has non-finite values (NaN/inf)")


def _vocab_roundtrip(ids: np.ndarray, headers, target_vocab: int, f: Findings) -> None:
    """vLLM maps draft id i to ``i + d2t[i]`` (map_draft_to_target) and skips t2d; the
    trainer maps verifier token t to draft id ``cumsum(t2d)[t] - 1``. Both must be the
    same bijection, or the served drafter proposes other tokens than it scored."""
    if np.any(np.diff(ids) <= 0):
        f.err(
            "vocab-roundtrip",
            "tensor 'd2t': draft_id + d2t must be strictly increasing (vLLM maps two draft "
            "ids to one verifier token, or in another order than the trainer's t2d)",
        )
        return
    if "t2d" not in headers:
        return
    with safe_open(headers["t2d"][2], "np") as fh:
        t2d = fh.get_tensor("t2d").astype(bool)
    if t2d.shape != (target_vocab,):
        f.err(
            "vocab-roundtrip",
            f"tensor 't2d' has shape {list(t2d.shape)}, expected [{target_vocab}] (the "
            "verifier vocabulary)",
        )
        return
    back = np.cumsum(t2d) - 1  # the trainer's verifier token -> draft id
    bad = np.flatnonzero(~t2d[ids] | (back[ids] != np.arange(len(ids))))
    if bad.size:
        i = int(bad[0])
        f.err(
            "vocab-roundtrip",
            f"tensors 'd2t' and 't2d' disagree: vLLM sends draft id {i} to verifier token "
            f"{int(ids[i])}, which t2d does not map back to draft id {i}",
        )
    elif int(t2d.sum()) != len(ids):
        f.err(
            "vocab-roundtrip",
            f"tensor 't2d' marks {int(t2d.sum())} verifier tokens, d2t has {len(ids)} draft "
            "ids: the extra tokens were trained as draft ids vLLM never proposes",
        )


# ---------------------------------------------------------------- entry points
def check(
    d: dict,
    headers: dict[str, tuple[tuple, str, Path]],
    folder: Path,
    *,
    verifier: Verifier | None = None,
    tensor_parallel_size: int = 1,
) -> Findings:
    """Every rule of ``RULES`` on one folder's config dict and tensor headers."""
    f = Findings()
    sc = _format(d, f)
    tl = d.get("transformer_layer_config")
    geo = _layer_config(tl, f) if isinstance(tl, dict) else None
    if geo is None or f.errors:
        return f
    s = _dspark_fields(d, geo, sc, f)
    if s is None:
        return f
    f.served = s
    _verifier_name(s.verifier_name, f)
    _spec_tokens(s, f)
    target_vocab = _verifier_rules(s, verifier, f)
    _tensor_parallel(s, tensor_parallel_size, f)
    if not headers:
        f.err("weights", "no weights: no model.safetensors (or index) in the folder")
        return f
    _tensors(s, headers, target_vocab, folder, f)
    return f


def serve_commands(
    folder: str | os.PathLike,
    s: Served,
    *,
    folder_form: bool,
    verifier: str | None = None,
    tensor_parallel_size: int = 1,
) -> list[str]:
    """The `vllm serve` commands that work for this folder ([serve-form: arg_utils.py]).

    `vllm serve <folder>` takes method and token count from the folder, so adding
    --spec-method/--spec-tokens there is an error ("mutually exclusive"); the
    --spec-model form names the verifier and passes --spec-tokens (vLLM would otherwise
    draft block_size tokens, one more than trained with sample_from_anchor=false).
    """
    tp = f" --tensor-parallel-size {tensor_parallel_size}" if tensor_parallel_size > 1 else ""
    q = shlex.quote
    out = []
    if folder_form:
        out.append(f"vllm serve {q(str(folder))}{tp}")
    name = verifier or s.verifier_name
    name = q(name) if isinstance(name, str) else "<verifier>"
    out.append(
        f"vllm serve {name} --spec-method dspark --spec-model {q(str(folder))} "
        f"--spec-tokens {s.speculative_tokens}{tp}"
    )
    return out
