"""Kimi-K3's additions to Kimi-Linear in the step, against a float64 definition.

UNVERIFIED against Moonshot's own modeling code, which is not public. The definition is
written from sglang-jax's K3 port (sgl-project/sglang-jax @ 403d8dd,
``python/sgl_jax/srt/models/kimi_k3.py``, ``kimi_k3_layers.py``, ``kimi_k3_residual.py``;
docs/design.md, "Kimi-K3"), which says it follows "KimiDecoderLayer.forward in the PyTorch
reference exactly": attention residuals over depth blocks (two per layer and one before
the final norm), the SITU activation, a sigmoid gate on the MLA output before o_proj, a
full-rank KDA output gate, routed experts in a latent (down, experts, RMSNorm, up). The
checkpoint is in K3's release layout: a ``kimi_k3`` wrapper, tensors under
``language_model.``, A_log padded, the experts packed as compressed-tensors' MXFP4 (the
definition uses the weights compressed-tensors itself decodes them to).

The oracle reuses transformers 5.19's Kimi-Linear modules in float64 for what K3 shares
with it (KDA, MLA, the router: each checked against our forward in test_forward.py) and
writes K3's additions by hand; our fp32 forward of the packed row (two documents and
padding) must match it per document within test_forward's derived bound, with the depth
counting the additions' roundings. Planted bugs (a plain residual instead of the attention
residual, its scorer without the norm, SITU's up branch unclipped, the MLA gate left out,
the latent norm left out) must break it.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_jax.verifier import (
    UnsupportedVerifierError,
    VerifierCheckpointError,
    load_params,
    load_verifier_config,
)
from dspark_jax.verifier import forward as fwd
from tests.numerics import U
from tests.verifier.bounds import chain_depth
from tests.verifier.hf_models import build
from tests.verifier.test_forward import LAYER_IDS, Case, packed_row
from tests.verifier.test_mxfp4 import _corrupt

# 3 layers (KDA, MLA, KDA; dense, then experts): blocks start at layers 0 and 2, so layer
# 2's attention residual sees two candidates and its MLP's three; layer id 3 is the last
# attention residual. SITU's clips at 1.5 and 2 bite on O(1) activations. The latent (64)
# differs from the hidden size (32); MXFP4 needs inputs in multiples of 32.
K3 = dict(
    attn_res_block_size=2,
    hidden_act="situ",
    activation_situ_beta=1.5,
    activation_situ_linear_beta=2.0,
    mla_use_output_gate=True,
    routed_expert_hidden_size=64,
    latent_moe_use_norm=True,
)
LINEAR = dict(head_dim=8, num_heads=4, short_conv_kernel_size=4, kda_layers=[1, 3],
              full_attn_layers=[2])  # fmt: skip


def _k3_tensors(model, seed=3) -> dict[str, np.ndarray]:
    """K3's tensors the Kimi-Linear model lacks (names without ``model.``), random."""
    cfg = model.config
    h, lat, mi = cfg.hidden_size, K3["routed_expert_hidden_size"], cfg.moe_intermediate_size
    g = np.random.default_rng(seed)

    def mat(rows, cols):
        return (g.standard_normal((rows, cols)) / cols**0.5).astype(np.float32)

    def norm(n):
        return (1.0 + 0.3 * g.standard_normal(n)).astype(np.float32)

    out = {}
    for name in ("output_attn_res",):
        out[name + "_norm.weight"], out[name + "_proj.weight"] = norm(h), mat(1, h)
    for i, layer in enumerate(model.model.layers):
        p = f"layers.{i}."
        for name in ("self_attention_res", "mlp_res"):
            out[p + name + "_norm.weight"], out[p + name + "_proj.weight"] = norm(h), mat(1, h)
        att = layer.self_attn
        if hasattr(att, "g_a_proj"):  # KDA: the full-rank output gate
            out[p + "self_attn.g_proj.weight"] = mat(att.g_b_proj.out_features, h)
        else:  # MLA's output gate
            out[p + "self_attn.g_proj.weight"] = mat(cfg.num_attention_heads * cfg.v_head_dim, h)
        if hasattr(layer.mlp, "experts"):
            m = p + "block_sparse_moe."
            out[m + "routed_expert_down_proj.weight"] = mat(lat, h)
            out[m + "routed_expert_up_proj.weight"] = mat(h, lat)
            out[m + "routed_expert_norm.weight"] = norm(lat)
            for e in range(cfg.num_experts):
                out[m + f"experts.{e}.w1.weight"] = mat(mi, lat)
                out[m + f"experts.{e}.w3.weight"] = mat(mi, lat)
                out[m + f"experts.{e}.w2.weight"] = mat(lat, mi)
    return out


def _pack_experts(extra, seed=5):
    """The routed experts as K3 ships them, compressed-tensors' MXFP4 (random codes,
    scales 2**-6 .. 2**-4): ``weight_packed`` / ``weight_scale`` for the checkpoint, and
    in ``extra`` the weights compressed-tensors 0.20.1 decodes them to (the definition's)."""
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    g = np.random.default_rng(seed)
    packed = {}
    for key in [k for k in extra if ".experts." in k]:
        rows, cols = extra[key].shape
        codes = g.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        scale = g.integers(121, 124, (rows, cols // 32), dtype=np.uint8)
        w = unpack_fp4_from_uint8(torch.from_numpy(codes), rows, cols, torch.float32)
        w = w * decompress_mx_scale(torch.from_numpy(scale)).float().repeat_interleave(32, 1)
        extra[key] = w.numpy()
        stem = key.removesuffix(".weight")
        packed[stem + ".weight_packed"], packed[stem + ".weight_scale"] = codes, scale
    return packed


QUANT = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
         "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                       "weights": {"num_bits": 4, "type": "float",
                                                   "group_size": 32}}}}  # fmt: skip


def build_k3(folder):
    """A tiny Kimi-Linear saved in K3's release layout: its tensors with K3's added or
    replacing theirs (the KDA's g_a/g_b_proj dropped for g_proj, experts in the latent,
    packed as MXFP4; A_log flat and padded to head_dim), under ``language_model.``, and
    K3's fields in the text_config of a ``kimi_k3`` wrapper (its quantization_config
    compressed-tensors'). Returns (the Kimi-Linear torch model, K3's tensors)."""
    model = build("kimi_linear", folder, q_lora_rank=6, linear_attn_config=LINEAR,
                  moe_intermediate_size=32)  # fmt: skip
    extra = _k3_tensors(model)
    packed = _pack_experts(extra)
    path = folder / "model.safetensors"
    replaced = (".g_a_proj.", ".g_b_proj.", ".experts.")  # the experts: packed, in the latent
    tensors = {k: v for k, v in load_file(path).items() if not any(r in k for r in replaced)}
    tensors |= {"model." + k: torch.from_numpy(v) for k, v in extra.items()
                if ".experts." not in k}  # fmt: skip
    tensors |= {"model." + k: torch.from_numpy(v) for k, v in packed.items()}
    for k in [k for k in tensors if k.endswith("A_log")]:  # [1, 1, H, 1] -> [head_dim]
        heads = tensors[k].reshape(-1)
        tensors[k] = torch.cat([heads, torch.full((LINEAR["head_dim"] - len(heads),), 7.0)])
    save_file({"language_model." + k: v for k, v in tensors.items()}, path,
              metadata={"format": "pt"})  # fmt: skip
    text = json.loads((folder / "config.json").read_text()) | K3
    text["linear_attn_config"] = {**text["linear_attn_config"], "use_full_rank_gate": True}
    wrapper = dict(model_type="kimi_k3", architectures=["KimiK3ForConditionalGeneration"],
                   text_config=text, quantization_config=QUANT)  # fmt: skip
    (folder / "config.json").write_text(json.dumps(wrapper))
    return model, extra


@torch.no_grad()
def k3_reference(model, extra, input_ids) -> np.ndarray:
    """One document through K3 as sglang-jax's port defines it, float64 ->
    [T, len(LAYER_IDS), H] (id k: the layer's returned partial sum; id N: the last
    attention residual, what the final norm reads)."""
    import copy

    m = copy.deepcopy(model).double()
    t = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in extra.items()}
    cfg, eps, block = m.config, m.config.rms_norm_eps, K3["attn_res_block_size"]
    beta, linear_beta = K3["activation_situ_beta"], K3["activation_situ_linear_beta"]
    F = torch.nn.functional

    def situ(gate, up):
        return (
            beta
            * torch.tanh(gate / beta)
            * torch.sigmoid(gate)
            * (linear_beta * torch.tanh(up / linear_beta))
        )

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def attn_res(name, partial, blocks):
        values = torch.stack([*blocks, partial], dim=-2)  # [1, T, n + 1, H]
        scores = rms(values, t[name + "_norm.weight"]) @ t[name + "_proj.weight"].T
        return (torch.softmax(scores, dim=-2) * values).sum(-2)

    def ffn(i, layer, h):
        mlp = layer.mlp
        if not hasattr(mlp, "experts"):
            return mlp.down_proj(situ(mlp.gate_proj(h), mlp.up_proj(h)))
        x = h.reshape(-1, h.shape[-1])
        _, weights, chosen = mlp.gate(x)  # transformers' router (fp32 logits)
        se = mlp.shared_experts
        shared = se.down_proj(situ(se.gate_proj(x), se.up_proj(x)))
        p = f"layers.{i}.block_sparse_moe."
        z = F.linear(x, t[p + "routed_expert_down_proj.weight"])
        routed = torch.zeros(len(x), z.shape[-1], dtype=torch.float64)
        for tok in range(len(x)):
            for w, e in zip(weights[tok].double(), chosen[tok].tolist(), strict=True):
                w1, w3, w2 = (t[p + f"experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2"))
                routed[tok] += w * (w2 @ situ(w1 @ z[tok], w3 @ z[tok]))
        routed = F.linear(rms(routed, t[p + "routed_expert_norm.weight"]),
                          t[p + "routed_expert_up_proj.weight"])  # fmt: skip
        return (routed + shared).reshape(h.shape)

    state = {"blocks": [], "captured": {}}

    def layer_forward(i, layer, hidden_states, attention_mask=None, position_ids=None, **kw):
        kw = {k: v for k, v in kw.items() if k not in ("past_key_values", "use_cache")}
        partial, blocks = hidden_states, state["blocks"]
        if i == 0:
            state["captured"][0] = hidden_states
        h = attn_res(f"layers.{i}.self_attention_res", partial, blocks) if blocks else partial
        if i % block == 0:
            blocks.append(partial)
            partial = None
        hn = layer.input_layernorm(h)
        if layer.block_type == "linear_attention":
            a = layer.self_attn(hidden_states=hn, cache_params=None,
                                attention_mask=attention_mask, **kw)  # fmt: skip
        else:
            gate = torch.sigmoid(F.linear(hn, t[f"layers.{i}.self_attn.g_proj.weight"]))
            hook = layer.self_attn.o_proj.register_forward_pre_hook(
                lambda _m, args: (args[0] * gate,)
            )
            try:
                a, _ = layer.self_attn(hidden_states=hn, attention_mask=attention_mask,
                                       position_ids=position_ids, **kw)  # fmt: skip
            finally:
                hook.remove()
        partial = a if partial is None else partial + a
        h = layer.post_attention_layernorm(attn_res(f"layers.{i}.mlp_res", partial, blocks))
        out = partial + ffn(i, layer, h)
        state["captured"][i + 1] = out
        return out

    for i, layer in enumerate(m.model.layers):
        att = layer.self_attn
        if hasattr(att, "g_a_proj"):  # KDA's output gate: g_proj(x) through the same code
            att.g_a_proj = torch.nn.Identity()
            att.g_b_proj = torch.nn.Linear(cfg.hidden_size, att.g_b_proj.out_features,
                                           bias=False, dtype=torch.float64)  # fmt: skip
            att.g_b_proj.weight.copy_(t[f"layers.{i}.self_attn.g_proj.weight"])
        layer.forward = lambda *a, i=i, layer=layer, **kw: layer_forward(i, layer, *a, **kw)
    m.model(input_ids=torch.as_tensor(input_ids)[None], use_cache=False)
    n = cfg.num_hidden_layers
    state["captured"][n] = attn_res("output_attn_res", state["captured"][n], state["blocks"])
    return torch.stack([state["captured"][k][0] for k in LAYER_IDS], dim=1).numpy()


class K3Case(Case):
    """test_forward's Case with K3's checkpoint and the float64 definition as reference."""

    def __init__(self, folder):
        self.name, self.folder = "kimi_k3", folder
        self.model, self.extra = build_k3(folder)
        self.cfg = load_verifier_config(folder)
        self.params = load_params(folder, self.cfg, dtype=jnp.float32)
        self.docs, self.ids, self.pos, self.doc = packed_row()
        self.ref = np.concatenate([k3_reference(self.model, self.extra, d) for d in self.docs])
        self.n = self.ref.shape[0]
        self.c = np.random.default_rng(2).standard_normal(self.ref.shape).astype(np.float32)
        self.sens = self._sensitivity()
        longest = max(len(d) for d in self.docs)
        depth = np.array([chain_depth(self.cfg, k, longest) + _k3_depth(self.cfg, k)
                          for k in LAYER_IDS])  # fmt: skip
        self.bound = 2 * depth[None] * U * self.sens


def _k3_depth(cfg, layer_id: int) -> int:
    """K3's added roundings up to layer id k: per layer two attention residuals (the norm
    over h, rsqrt, the scorer's h terms, softmax's exp and its sum and division over the
    n + 1 candidates, the weighted sum), SITU (two tanh, a sigmoid, three products), the
    gates' projections (h) and sigmoid, the latent's down (h), norm (latent + 4) and up
    (latent); the last attention residual at id N."""
    h, lat, nb = cfg.hidden_size, cfg.latent_moe or 0, cfg.num_hidden_layers
    res = h + 4 + h + 4 + 2 * (nb + 1) + 1 + nb + 1
    per_layer = 2 * res + 3 * 4 + 3 + h + 4 + 1 + h + lat + 4 + lat
    return layer_id * per_layer + (res if layer_id == cfg.num_hidden_layers else 0)


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return K3Case(tmp_path_factory.mktemp("kimi_k3"))


def test_k3_config(k3):
    cfg = k3.cfg
    assert cfg.attn_res_block == 2 and cfg.situ == (1.5, 2.0) and cfg.latent_moe == 64
    assert cfg.mla_output_gate and cfg.kda_full_rank_gate and cfg.latent_moe_norm
    assert [cfg.kind(i).block_start for i in range(3)] == [True, False, True]


def test_k3_matches_float64_definition(k3):
    got = k3.run()
    assert got.shape == k3.ref.shape
    k3.check(got)


def _plain_residual(cfg, params, name, partial, blocks):
    return partial + blocks.sum(axis=1)


def _scorer_without_norm(cfg, params, name, partial, blocks):
    values = jnp.concatenate([blocks, partial[:, None]], axis=1)
    scores = values @ params[name + "_proj.weight"][0]
    return (fwd.jax.nn.softmax(scores, axis=-1)[..., None] * values).sum(1)


@pytest.mark.parametrize(
    "bug", ["plain_residual", "scorer_without_norm", "situ_up_unclipped", "mla_gate_dropped",
            "latent_norm_dropped"],
)  # fmt: skip
def test_planted_k3_bugs(k3, monkeypatch, bug):
    cfg = k3.cfg
    if bug == "plain_residual":
        monkeypatch.setattr(fwd, "attn_res", _plain_residual)
    elif bug == "scorer_without_norm":
        monkeypatch.setattr(fwd, "attn_res", _scorer_without_norm)
    else:
        cfg = dataclasses.replace(
            cfg,
            **{
                "situ_up_unclipped": dict(situ=(cfg.situ[0], None)),
                "mla_gate_dropped": dict(mla_output_gate=False),
                "latent_norm_dropped": dict(latent_moe_norm=False),
            }[bug],
        )
    with pytest.raises(AssertionError, match="projection off"):
        k3.check(k3.run(cfg=cfg), what=f" ({bug})")


@pytest.mark.parametrize(
    "suffix, change, message",
    [
        ("experts.3.w2.weight_scale", lambda t, k: t.pop(k), r"no tensor language_model\.model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight_scale"),
        ("experts.0.w1.weight_packed", lambda t, k: t.update({k: t[k][:, :8]}), r"experts\.0\.w1\.weight_packed is U8 \(32, 8\), MXFP4 of .*experts\.0\.w1\.weight \(32, 64\) is U8 \(32, 32\)"),
        ("experts.5.w3.weight_scale", lambda t, k: t.update({k: t[k].astype(np.float32)}), r"experts\.5\.w3\.weight_scale is F32"),
        ("experts.2.w1.weight_scale", lambda t, k: t[k].__setitem__((3, 1), 255), r"experts\.2\.w1\.weight_scale holds E8M0's NaN scale \(255\): the checkpoint is corrupt"),
    ],
)  # fmt: skip
def test_corrupt_packed_experts_are_named(k3, tmp_path, suffix, change, message):
    bad, _ = _corrupt(k3.folder, tmp_path, suffix, change)
    with pytest.raises(VerifierCheckpointError, match=message):
        jax.block_until_ready(load_params(bad, load_verifier_config(bad), dtype=jnp.float32))


def test_other_compressed_tensors_formats_are_refused(k3, tmp_path):
    """int4 (pack-quantized) is not read: one line naming the scheme."""
    config = json.loads((k3.folder / "config.json").read_text())
    config["quantization_config"] = {**QUANT, "format": "pack-quantized"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedVerifierError, match=r"quantization_config \(compressed-tensors\)"
    ):
        load_verifier_config(tmp_path)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_k3_split_over_context_matches_the_definition(k3):
    """Over context=4 (shards of 7 tokens; both documents cross shard edges): the
    attention residuals' blocks stay split with the tokens, the KDA state is handed over."""
    from tests.verifier.test_context_split import _split_run

    k3.check(_split_run(k3, 4), what=" (context=4)")
