"""The JAX verifier against transformers 5.19 (eager attention, fp32), family by family.

Each family is a tiny random model saved locally; a packed row of two documents and
padding runs through our forward (blocked attention with several query blocks and key
chunks) and each document through HF on its own, hooked as launch/hf_extract does (layer
id k = output of k layers, N before the final norm). So one comparison checks the family's
arithmetic, the packing (no attention across documents, positions restarting) and the
layout.

Tolerance (tests/numerics.py's backward-error model). For slot (t, j) we compare the
projection L = <c, h[t, j]> with c ~ N(0, 1) fixed. Each fp32 evaluation is the exact
forward of parameters perturbed by <= depth_j * U relatively, depth_j the longest chain
of roundings up to layer id j (``chain_depth``), so the two differ by at most
2 * depth_j * U * sum_p |dL/dp| |p| (first order; the gradient comes from our forward with
the dense oracle attention, which is differentiable). Planted bugs move L by O(1e-1..1),
orders of magnitude above these bounds (~1e-5).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.config import RopeScaling
from dspark_jax.model.layers import rms_norm
from dspark_jax.verifier import forward as fwd
from dspark_jax.verifier import hidden_states, load_params, load_verifier_config
from dspark_jax.verifier.config import RopeView
from tests.numerics import BF16_U, U
from tests.verifier.bounds import chain_depth, projection_sensitivity
from tests.verifier.hf_models import FAMILIES, build, hf_hidden_states

LAYER_IDS = (0, 1, 2, 3)  # embedding, every layer, the last one pre-norm
DOC_LENGTHS = (10, 14)
PAD = 4
BLOCKS = dict(q_block=8, kv_chunk=8, kda_chunk=8)  # 4 query blocks, 4 key chunks, 4 KDA chunks


def packed_row():
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 64, n) for n in DOC_LENGTHS]
    ids = np.concatenate([*docs, np.zeros(PAD, np.int64)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in DOC_LENGTHS] + [np.arange(PAD)]).astype(np.int32)
    doc = np.concatenate(
        [np.full(n, i) for i, n in enumerate(DOC_LENGTHS)] + [np.full(PAD, -1)]
    ).astype(np.int32)
    return docs, ids, pos, doc


class Case:
    """One family: HF reference, our params, the projection bound (computed once)."""

    def __init__(self, name, folder, row=None, model=None):
        """row: (documents, ids, positions, document ids) of the packed row (packed_row());
        model: transformers' model of the checkpoint in ``folder`` (default: build one)."""
        self.name = name
        self.model = model = build(name, folder) if model is None else model
        self.folder = folder
        self.cfg = load_verifier_config(folder)
        self.params = load_params(folder, self.cfg, dtype=jnp.float32)
        self.docs, self.ids, self.pos, self.doc = packed_row() if row is None else row
        ref = np.concatenate([hf_hidden_states(model, d, LAYER_IDS) for d in self.docs])
        self.n = ref.shape[0]
        self.ref = ref
        self.c = np.random.default_rng(2).standard_normal(ref.shape).astype(np.float32)
        self.sens = self._sensitivity()
        longest = max(len(d) for d in self.docs)
        depth = np.array([chain_depth(self.cfg, k, longest) for k in LAYER_IDS])
        self.bound = 2 * depth[None] * U * self.sens

    def run(self, cfg=None, params=None, **kw):
        cfg = cfg or self.cfg
        f = jax.jit(
            lambda p, a, b, c: hidden_states(p, cfg, a, b, c, LAYER_IDS, **{**BLOCKS, **kw})
        )
        out = f(self.params if params is None else params, self.ids, self.pos, self.doc)
        return np.asarray(out.astype(jnp.float32))[: self.n]

    def _sensitivity(self):
        c = np.zeros((len(self.ids), *self.c.shape[1:]), np.float32)
        c[: self.n] = self.c  # padding rows are not compared
        return projection_sensitivity(
            self.params, self.cfg, self.ids, self.pos, self.doc, LAYER_IDS, c
        )[: self.n]

    def check(self, got, bound=None, what=""):
        """|<c, got> - <c, ref>| <= bound per slot; returns the worst ratio."""
        got_p = np.einsum("tjh,tjh->tj", self.c.astype(np.float64), got.astype(np.float64))
        ref_p = np.einsum("tjh,tjh->tj", self.c.astype(np.float64), self.ref.astype(np.float64))
        bound = self.bound if bound is None else bound
        ratio = np.abs(got_p - ref_p) / bound
        assert ratio.max() <= 1.0, (
            f"{self.name}{what}: projection off by {ratio.max():.3g} x its bound at slot "
            f"{np.unravel_index(ratio.argmax(), ratio.shape)}"
        )
        print(f"{self.name}{what}: worst |diff| / bound {ratio.max():.3g}")
        return ratio.max()


_CASES: dict[str, Case] = {}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    def get(name):
        if name not in _CASES:
            _CASES[name] = Case(name, tmp_path_factory.mktemp(name))
        return _CASES[name]

    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_matches_hf_fp32(case, name):
    c = case(name)
    got = c.run()
    assert got.shape == c.ref.shape
    c.check(got)


@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen3_moe"])
def test_bf16_within_bf16_rounding(case, name):
    """bf16 parameters and matmul operands (fp32 residual), bf16 output. Against HF fp32:
    every bf16 rounding on the chain (weights, both operands of every matmul, the
    probabilities, the output) is one more relative perturbation <= BF16_U, 18 per layer
    plus embedding and output, on top of the fp32 bound.

    Measured: 0.12-0.18 of this bound. It stays a worst case: every rounding at its
    maximum (half an ulp; a quarter on average) and all aligned in sign. A deterministic
    bound cannot drop the alignment; a tighter one would be statistical (independent
    signs), which the backward-error model does not license: one rounding of a matmul
    output scales every term of its row alike."""
    c = case(name)
    p16 = {k: v.astype(jnp.bfloat16) for k, v in c.params.items()}
    got = c.run(params=p16)  # upcast to fp32 by run()

    def out_dtype(**kw):  # traced only: no second compile of the same forward
        def f(p):
            return hidden_states(p, c.cfg, c.ids, c.pos, c.doc, LAYER_IDS, **BLOCKS, **kw)

        return jax.eval_shape(f, p16).dtype

    assert out_dtype() == jnp.bfloat16 and out_dtype(out_dtype=jnp.float32) == jnp.float32
    k16 = np.array([2 + 18 * k for k in LAYER_IDS], np.float64)
    bound = c.bound + k16[None] * BF16_U * c.sens
    c.check(got, bound, " (bf16)")


def test_blocked_equals_dense_oracle(case):
    c = case("mistral")  # sliding window on every layer
    dense = c.run(dense_attention=True)
    c.check(dense, what=" (dense oracle)")
    # the blocked and the dense forward differ only in the softmax accumulation order
    c.check(c.run(q_block=4, kv_chunk=16), what=" (other tiling)")


# ------------------------------------------------------------------------- planted bugs


def _fails(c, got):
    with pytest.raises(AssertionError, match="projection off"):
        c.check(got)


def test_planted_norm_style_flipped(case, monkeypatch):
    c = case("gemma3")
    monkeypatch.setattr(fwd, "gemma_rms_norm", lambda x, w, eps: rms_norm(x, w, eps))
    _fails(c, c.run())


def test_planted_rope_type_ignored(case):
    for name in ("llama_yarn", "llama3", "llama_dynamic", "llama_longrope", "gemma3"):
        c = case(name)
        ropes = tuple(
            (k, RopeView(RopeScaling(), v.rope_theta, v.head_dim, v.max_position_embeddings))
            for k, v in c.cfg.ropes
        )
        _fails(c, c.run(cfg=dataclasses.replace(c.cfg, ropes=ropes)))


@pytest.mark.parametrize("delta", [-1, 1])
def test_planted_sliding_window_off_by_one(case, delta):
    for name in ("mistral", "gemma2", "gpt_oss"):
        c = case(name)
        windows = tuple(None if w is None else w + delta for w in c.cfg.layer_windows)
        _fails(c, c.run(cfg=dataclasses.replace(c.cfg, layer_windows=windows)))


def test_planted_documents_not_separated(case):
    c = case("qwen3")
    # one document id for the whole row: the second document then sees the first
    doc = np.where(c.doc >= 0, 0, -1).astype(np.int32)
    f = jax.jit(lambda p, a, b, d: hidden_states(p, c.cfg, a, b, d, LAYER_IDS, **BLOCKS))
    _fails(c, np.asarray(f(c.params, c.ids, c.pos, doc))[: c.n])


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_planted_epsilon_off_by_10x(case, name):
    """A small bug: every norm's epsilon 10x (the families' eps is 1e-2 here, so that it
    shows: hf_models.COMMON)."""
    c = case(name)
    _fails(c, c.run(cfg=dataclasses.replace(c.cfg, rms_norm_eps=10 * c.cfg.rms_norm_eps)))


@pytest.mark.parametrize(
    "change",
    [
        dict(topk_group=4),  # the group limit missing: any 2 of the 8 experts
        dict(rope_interleave=False),  # RoPE pairs the wrong halves
        dict(routed_scaling_factor=1.0),
        dict(n_shared_experts=0),
        dict(query_scale=12**-0.5),  # yarn's mscale**2 left out of the softmax scale
    ],
    ids=lambda c: next(iter(c)),
)
def test_planted_deepseek_bugs(case, change):
    c = case("deepseek_v3")
    params = c.params
    if change == dict(n_shared_experts=0):
        params = {k: v for k, v in params.items() if "shared_experts" not in k}
    _fails(c, c.run(cfg=dataclasses.replace(c.cfg, **change), params=params))


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_linear", "qwen3_next", "gpt_oss"])
def test_hf_extractor_equals_in_step(case, name):
    """launch.extract_hidden_states --backend hf (its HFExtractor, fp32) on the DeepSeek-V3,
    Kimi-Linear, Qwen3-Next and gpt-oss verifiers equals the in-step forward within the same
    bound (it bounds each side's distance from the exact forward)."""
    from launch.hf_extract import HFExtractor

    c = case(name)
    ex = HFExtractor(str(c.folder), [1, 2], device="cpu", dtype="float32",
                     compute_dtype="float32", attn_implementation="eager")  # fmt: skip
    got = np.concatenate([t.float().numpy() for t in ex.extract([d.tolist() for d in c.docs])])
    ours = c.run()[:, 1:]  # layer ids 1, 2 and the last (3): the extractor's slots
    assert got.shape == ours.shape
    proj = np.einsum("tjh,tjh->tj", c.c[:, 1:].astype(np.float64), (got - ours).astype(np.float64))
    assert (np.abs(proj) <= c.bound[:, 1:]).all(), np.abs(proj / c.bound[:, 1:]).max()


def test_planted_glm_rotates_another_part(case):
    """GLM rotates half of each head (partial_rotary_factor 0.5): rotating a quarter fails."""
    c = case("glm4_moe")
    assert c.cfg.rotary_dim == c.cfg.head_dim // 2 and c.cfg.qk_norm and c.cfg.qkv_bias
    quarter = c.cfg.head_dim // 4
    ropes = tuple((k, v._replace(head_dim=quarter)) for k, v in c.cfg.ropes)
    _fails(c, c.run(cfg=dataclasses.replace(c.cfg, rotary_dim=quarter, ropes=ropes)))


LINEAR = {"kimi_linear": "kda", "qwen3_next": "gdn"}  # families with linear attention


@pytest.mark.parametrize("name", list(LINEAR))
def test_linear_attention_chunked_equals_recurrent(case, name):
    """The delta rule's chunked form (chunks of 4, 8 and 64 tokens: document edges inside
    chunks and on their edges) and its token-by-token recurrence are the same function."""
    c = case(name)
    assert c.cfg.layer_mixers == (LINEAR[name], "attention", LINEAR[name])
    c.check(c.run(dense_attention=True), what=" (recurrent, dense attention)")
    for chunk in (4, 64):
        c.check(c.run(kda_chunk=chunk), what=f" (chunks of {chunk})")


def _merged_documents(doc):
    return jnp.where(doc >= 0, 0, doc)


@pytest.mark.parametrize("name", list(LINEAR))
@pytest.mark.parametrize(
    "bug", ["state_not_reset", "state_dropped_between_chunks", "conv_across_documents"]
)
def test_planted_linear_attention_bugs(case, monkeypatch, name, bug):
    """The recurrent state carried into the next document, or not carried from one chunk
    to the next; the convolution reading the previous document's last tokens."""
    c = case(name)
    rule, conv = fwd.delta_rule.chunked, fwd._causal_conv
    if bug == "state_not_reset":
        monkeypatch.setattr(
            fwd.delta_rule, "chunked",
            lambda *a, chunk: rule(*a[:5], _merged_documents(a[5]), chunk=chunk),
        )  # fmt: skip
    elif bug == "state_dropped_between_chunks":  # every chunk a document of its own
        monkeypatch.setattr(
            fwd.delta_rule, "chunked",
            lambda *a, chunk: rule(*a[:5], a[5] * 1000 + jnp.arange(len(a[5])) // chunk,
                                   chunk=chunk),
        )  # fmt: skip
    else:
        monkeypatch.setattr(fwd, "_causal_conv", lambda x, w, d: conv(x, w, _merged_documents(d)))
    _fails(c, c.run())


def test_planted_qwen3_next_bugs(case, monkeypatch):
    """Llama-style norms instead of (1 + w); the whole head rotated instead of a quarter;
    the attention's output gate left out."""
    c = case("qwen3_next")
    assert c.cfg.zero_centred_norms and c.cfg.rotary_dim == c.cfg.head_dim // 4
    _fails(c, c.run(cfg=dataclasses.replace(c.cfg, zero_centred_norms=False)))
    ropes = tuple((k, v._replace(head_dim=c.cfg.head_dim)) for k, v in c.cfg.ropes)
    _fails(c, c.run(cfg=dataclasses.replace(c.cfg, rotary_dim=None, ropes=ropes)))
    qkv = fwd._qkv
    monkeypatch.setattr(fwd, "_qkv", lambda *a: (*qkv(*a)[:3], None))  # no output gate
    _fails(c, c.run())


def test_planted_gpt_oss_bugs(case):
    """The sinks left out of the softmax; the SwiGLU unclamped; gate and up read as the
    two halves of gate_up_proj instead of its even and odd columns."""
    c = case("gpt_oss")
    assert c.cfg.attn_sinks and c.cfg.layer_windows == (4, None, 4)
    _fails(c, c.run(cfg=dataclasses.replace(c.cfg, attn_sinks=False)))
    _fails(c, c.run(cfg=dataclasses.replace(c.cfg, swiglu_limit=1e9)))

    def halves_as_pairs(w):  # what interleaved reading of these gives: the halves' split
        g, u = jnp.split(w, 2, axis=-1)
        return jnp.stack([g, u], axis=-1).reshape(w.shape)

    params = {
        k: halves_as_pairs(v) if k.endswith(("gate_up_proj", "gate_up_proj_bias")) else v
        for k, v in c.params.items()
    }
    _fails(c, c.run(params=params))


def test_planted_kimi_mla_rotated(case):
    """Kimi-Linear's MLA has no RoPE: rotating its shared part (as DeepSeek does) fails."""
    c = case("kimi_linear")
    _fails(c, c.run(cfg=dataclasses.replace(c.cfg, mla_rope=True)))


def test_planted_deepseek_routing_bias_ignored(case):
    c = case("deepseek_v3")
    params = {k: v * 0 if k.endswith("e_score_correction_bias") else v for k, v in c.params.items()}
    _fails(c, c.run(params=params))


def test_planted_softcap_dropped(case):
    c = case("gemma2")
    _fails(c, c.run(cfg=dataclasses.replace(c.cfg, attn_softcap=None)))


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])  # vmapped rows; lax.map for experts
def test_batch_of_rows(case, name):
    c = case(name)
    batch = {
        "input_ids": np.stack([c.ids, c.ids]),
        "position_ids": np.stack([c.pos, c.pos]),
        "document_ids": np.stack([c.doc, c.doc]),
    }
    f = jax.jit(lambda p, b: fwd.batch_hidden_states(p, c.cfg, b, LAYER_IDS, **BLOCKS))
    out = np.asarray(f(c.params, batch))
    assert out.shape == (2, len(c.ids), len(LAYER_IDS), c.cfg.hidden_size)
    for r in range(2):
        c.check(out[r][: c.n], what=f" (batch row {r})")
