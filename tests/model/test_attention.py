"""anchored_block_attention: memory-efficient path vs the dense oracle vs speculators 0.9.0.

Default row (S = 45): documents of 12, 9 and 15 tokens, then 9 padding positions (doc -1).
Anchors [3, 10, 12, 19, 34, 35 | 0, 0]: six valid (sorted) then two padding anchors. Blocks of
B = 4 straddle document ends (10 -> 10..13 crosses 12, 19 -> crosses 21, 35 -> into padding),
12 starts its document (no context), W = 5 cuts 19, 34 and 35 off their document starts.
kv_chunk 8 does not divide S; q_block_group 3 does not divide A = 8. GQA: Nh = 4, Nkv = 2.
Tolerances: elementwise round-off bounds from the arithmetic (``_bounds``), not observed errors.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.model import attention as att
from tests.numerics import BF16_U, U, assert_within

B, NH, NKV, D = 4, 4, 2, 8
G, C = 3, 8
LENGTHS, N_PAD = (12, 9, 15), 9
ANCHORS = (3, 10, 12, 19, 34, 35, 0, 0)
CONFIGS = [(None, False), (None, True), (5, False), (5, True)]  # (sliding_window, causal)


def _doc_ids(lengths, n_pad):
    ids = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)] + [np.full(n_pad, -1)])
    return jnp.asarray(ids, jnp.int32)


def _tensors(seed, S, A, dtype=jnp.float32):
    """q, k_ctx, v_ctx, k_blk, v_blk and a random output cotangent."""
    r = np.random.default_rng(seed)
    Q = A * B
    shapes = [(Q, NH, D), (S, NKV, D), (S, NKV, D), (Q, NKV, D), (Q, NKV, D), (Q, NH, D)]
    return [jnp.asarray(r.standard_normal(s), dtype) for s in shapes]


def _row(seed=0, dtype=jnp.float32):
    doc = _doc_ids(LENGTHS, N_PAD)
    *xs, cot = _tensors(seed, doc.shape[0], len(ANCHORS), dtype)
    return xs, jnp.asarray(ANCHORS, jnp.int32), doc, cot


@functools.cache
def _efficient(W, causal, tiled=True):
    """Jitted memory-efficient attention; tiled=False keeps the default group/chunk sizes."""
    kw = dict(q_block_group=G, kv_chunk=C) if tiled else {}
    return jax.jit(
        lambda q, kc, vc, kb, vb, anc, doc: att.anchored_block_attention(
            q,
            kc,
            vc,
            kb,
            vb,
            anc,
            doc,
            block_size=B,
            sliding_window=W,
            causal_in_block=causal,
            **kw,
        )
    )


@functools.cache
def _dense(W, causal):
    return jax.jit(
        lambda q, kc, vc, kb, vb, anc, doc: att.dense_anchored_block_attention(
            q, kc, vc, kb, vb, anc, doc, block_size=B, sliding_window=W, causal_in_block=causal
        )
    )


def _vg(f, xs, anc, doc, cot):
    """Output and the cotangent's gradients w.r.t. q, k_ctx, v_ctx, k_blk, v_blk."""
    out, vjp = jax.vjp(lambda *a: f(*a, anc, doc), *xs)
    return out, vjp(cot)


@functools.cache
def _value_and_grads_fn(f):
    return jax.jit(functools.partial(_vg, f))


def _value_and_grads(f, xs, anc, doc, cot):
    return _value_and_grads_fn(f)(xs, anc, doc, cot)


NAMES = ("out", "d q", "d k_ctx", "d v_ctx", "d k_blk", "d v_blk")


def _bounds(xs, anc, doc, cot, W, causal, rel=0.0):
    """Elementwise bounds on |efficient - dense| for (out, (dq, dk_ctx, dv_ctx, dk_blk, dv_blk)).

    From a float64 replay of the dense math (P, o, the cotangent terms). Both sides are fp32
    evaluations of the same sums in other orders, so each differs from exact by round-off:

    * a score is a D-term dot: within D u S_abs (S_abs = scale sum_d |q_d k_d|) per side;
      softmax turns score errors e_k into d o = sum_k P_k e_k (v_k - o), <= 2 (D + 2) u
      sum_k P_k S_abs_k |v_k - o|, and into P errors <= 4 (D + 2) u S_max P (S_max per query);
    * a sum over N visible keys (or over the Q R queries of a kv head) is within N u of its
      absolute evaluation per side; the online softmax adds ~4 roundings per kv chunk
      (ceil(S / C) + 1 of them) and the final division / rescales ~8.
    ``rel`` adds a relative round-off (bf16 operands and outputs) on the absolute evaluation.
    """
    q, kc, vc, kb, vb = (np.asarray(x, np.float64) for x in xs)
    do = np.asarray(cot, np.float64)
    mask = np.asarray(
        att.dense_anchored_block_mask(
            anc, doc, block_size=B, sliding_window=W, causal_in_block=causal
        )
    )  # [Q, S + Q]
    rep = NH // NKV
    k = np.repeat(np.concatenate([kc, kb]), rep, axis=1)  # [S + Q, Nh, D]
    v = np.repeat(np.concatenate([vc, vb]), rep, axis=1)
    scale = D**-0.5
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    s_abs = np.einsum("qhd,khd->hqk", np.abs(q), np.abs(k)) * scale
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)  # [Nh, Q, S + Q]
    o = np.einsum("hqk,khd->qhd", p, v)
    s_max = np.where(mask[None], s_abs, 0).max(-1)  # [Nh, Q]
    n_keys, n_chunks = mask.sum(-1).max(), -(-kc.shape[0] // C) + 1
    k_sum = 2 * (n_keys + 4 * n_chunks + 8)  # both sides: the key sum, rescales, division
    k_score = 4 * (D + 2) * s_max.T[:, :, None]  # [Q, Nh, 1]: P's relative error, in u
    # Output.
    o_abs = np.einsum("hqk,khd->qhd", p, np.abs(v))
    spread = np.abs(v[None] - o[:, None])  # |v_k - o_q|: [Q, S + Q, Nh, D]
    o_soft = np.einsum("hqk,hqk,qkhd->qhd", p, s_abs, spread)
    out = (k_sum * U + rel) * o_abs + 2 * (D + 2) * U * o_soft
    # Gradients: dP = dO . v, delta = dO . o, dS = P (dP - delta), dq = scale dS k,
    # dk = scale dS^T q, dv = P^T dO; |dS| <= P (|dO| . |v| + |dO| . |o|).
    ds_abs = p * (
        np.einsum("qhd,khd->hqk", np.abs(do), np.abs(v))
        + np.einsum("qhd,qhd->hq", np.abs(do), np.abs(o))[:, :, None]
    )
    dq_abs = np.einsum("hqk,khd->qhd", ds_abs, np.abs(k)) * scale
    dk_abs = np.einsum("hqk,qhd->khd", ds_abs, np.abs(q)) * scale
    dv_abs = np.einsum("hqk,qhd->khd", p, np.abs(do))
    # ... and their P-error parts (P's relative error <= k_score u, per query).
    w = 4 * (D + 2) * s_max  # [Nh, Q]
    dk_soft = np.einsum("hqk,hq,qhd->khd", ds_abs, w, np.abs(q)) * scale
    dv_soft = np.einsum("hqk,hq,qhd->khd", p, w, np.abs(do))
    n_q = mask.shape[0] * rep
    k_dq = (2 * (n_keys + 2 * D + 8)) * U + rel
    k_dkv = (2 * (n_q + 2 * D + 8)) * U + rel
    dq = k_dq * dq_abs + U * k_score * dq_abs
    dk = k_dkv * dk_abs + U * dk_soft
    dv = k_dkv * dv_abs + U * dv_soft

    def per_kv(x):  # [S + Q, Nh, D] -> GQA heads summed into their kv head: [S + Q, Nkv, D]
        return x.reshape(x.shape[0], NKV, rep, D).sum(2)

    dk, dv = per_kv(dk), per_kv(dv)
    S = kc.shape[0]
    return out, (dq, dk[:S], dv[:S], dk[S:], dv[S:])


def _assert_bounded(got, want, bounds):
    for x, y, bound, name in zip(
        jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(bounds), NAMES, strict=True
    ):
        assert_within(np.asarray(x, np.float32), np.asarray(y, np.float32), bound, name)


@pytest.mark.parametrize("W,causal", CONFIGS)
def test_matches_dense_values_and_grads(W, causal):
    xs, anc, doc, cot = _row()
    got = _value_and_grads(_efficient(W, causal), xs, anc, doc, cot)
    want = _value_and_grads(_dense(W, causal), xs, anc, doc, cot)
    _assert_bounded(got, want, _bounds(xs, anc, doc, cot, W, causal))


def test_default_tiling_and_bf16():
    """Defaults (one group, one chunk here) in bf16: dtypes kept, close to the fp32 oracle."""
    xs, anc, doc, cot = _row(seed=1, dtype=jnp.bfloat16)
    out, grads = _value_and_grads(_efficient(5, True, tiled=False), xs, anc, doc, cot)
    xs32 = [x.astype(jnp.float32) for x in xs]
    want = _value_and_grads(_dense(5, True), xs32, anc, doc, cot.astype(jnp.float32))
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    # bf16 operands multiply exactly into fp32 sums; on top of the fp32 bound, each output
    # carries <= 3 bf16 roundings of its absolute evaluation: P (or dS) rounded for the
    # P V / dS K / dS^T Q / P^T dO matmuls, delta = dO . o from the bf16 output, and the
    # bf16 result itself (2^-8 each).
    _assert_bounded((out, grads), want, _bounds(xs32, anc, doc, cot, 5, True, rel=3 * BF16_U))


def test_vmap_jit_and_lax_map_match_per_row():
    W, causal = 5, True
    f = _efficient(W, causal)
    xs0, anc0, doc0, cot0 = _row(seed=2)
    # Second row: other documents and anchors (so per-row chunk ranges differ).
    doc1 = _doc_ids((20, 18), 7)
    anc1 = jnp.asarray([5, 17, 25, 30, 36, 0, 0, 0], jnp.int32)
    *xs1, cot1 = _tensors(3, doc1.shape[0], len(ANCHORS))
    rows = [(xs0, anc0, doc0, cot0), (xs1, anc1, doc1, cot1)]
    per_row = [_value_and_grads(f, *r) for r in rows]
    stack = lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees)  # noqa: E731
    vg = lambda r: _vg(f, *r)  # noqa: E731  (f is jitted; fine inside vmap / lax.map)
    # Per row, vmap / lax.map / plain jit run the same fp32 sums, perhaps in other orders:
    # each within the round-off bound of the exact value (_bounds is for two such sides).
    bounds = [_bounds(*r, W, causal) for r in rows]
    stacked = stack(bounds)
    _assert_bounded(jax.jit(jax.vmap(vg))(stack(rows)), stack(per_row), stacked)
    _assert_bounded(jax.jit(lambda s: jax.lax.map(vg, s))(stack(rows)), stack(per_row), stacked)
    # And the per-row results are the oracle's.
    for r, got, bound in zip(rows, per_row, bounds, strict=True):
        _assert_bounded(got, _value_and_grads(_dense(W, causal), *r), bound)


# --- skipping -------------------------------------------------------------------------------


def test_group_chunk_ranges_hand_case():
    anc, doc = jnp.asarray(ANCHORS, jnp.int32), _doc_ids(LENGTHS, N_PAD)

    def r(W):
        return att.group_chunk_ranges(
            anc, doc, sliding_window=W, q_block_group=G, kv_chunk=C
        ).tolist()

    # Group 0 (anchors 3, 10, 12): docs 0 (+ 12 opens doc 1: empty) -> columns [0, 10).
    # Group 1 (19, 34, 35): full -> [12 (doc 1 start), 35); W=3 -> [16, 35).
    # Group 2 (0, 0, pad): nothing. Full attention reads 2 + 4 = 6 of 3 x 6 chunk tiles.
    assert r(None) == [[0, 2], [1, 5], [0, 0]]
    assert r(3) == [[0, 2], [2, 5], [0, 0]]


@functools.cache
def _ranges_and_ctx_mask(W):
    def f(anc, doc):
        ranges = att.group_chunk_ranges(anc, doc, sliding_window=W, q_block_group=G, kv_chunk=C)
        mask = att.dense_anchored_block_mask(
            anc, doc, block_size=B, sliding_window=W, causal_in_block=False
        )
        return ranges, mask[:, : doc.shape[0]]

    return jax.jit(f)


def _random_row(r, S=40, A=7):
    """Random packed row like the data pipeline's: docs, -1 tail, select_anchors layout."""
    doc, start = np.full(S, -1, np.int32), 0
    for i, n in enumerate(r.integers(1, 15, r.integers(1, 5))):
        doc[start : start + n], start = i, min(start + n, S)
    valid = np.flatnonzero(doc >= 0)
    valid = valid[valid < S - B]
    k = min(int(r.integers(0, A + 1)), len(valid))
    anc = np.zeros(A, np.int32)
    anc[:k] = np.sort(r.choice(valid, k, replace=False))
    return jnp.asarray(anc), jnp.asarray(doc)


def test_group_chunk_ranges_cover_dense_mask():
    """No visible context column lies outside its group's range (hand row + random rows)."""
    r = np.random.default_rng(4)
    hand = (jnp.asarray(ANCHORS, jnp.int32), _doc_ids(LENGTHS, N_PAD))
    cases = [(W, *hand) for W in (None, 3, 5)]
    cases += [(W, *_random_row(r)) for W in (None, 3, 9) for _ in range(8)]
    for W, anc, doc in cases:
        ranges, mask = map(np.asarray, _ranges_and_ctx_mask(W)(anc, doc))
        for g, (first, last) in enumerate(ranges):
            cols = np.flatnonzero(mask[g * G * B : (g + 1) * G * B].any(0))
            if cols.size == 0:
                assert first == last == 0, (g, W, anc, doc)
            else:  # covering, and tight: both end chunks hold visible columns
                assert cols.min() // C == first and cols.max() // C == last - 1, (g, W, anc, doc)


def test_invisible_chunks_are_never_read():
    """NaN in v_ctx outside a group's chunk range leaves that group's output exact.

    An invisible chunk that was computed would still leak NaN through 0 * NaN in P @ V, so a
    clean output proves the chunk was skipped, not merely masked.
    """
    W, causal = 3, False
    xs, anc, doc, _ = _row(seed=5)
    f = _efficient(W, causal)
    want = np.asarray(_dense(W, causal)(*xs, anc, doc))
    bound = _bounds(xs, anc, doc, jnp.zeros_like(xs[0]), W, causal)[0]
    ranges = att.group_chunk_ranges(anc, doc, sliding_window=W, q_block_group=G, kv_chunk=C)
    chunk_of_col = np.arange(doc.shape[0]) // C
    for g, (first, last) in enumerate(np.asarray(ranges)):
        outside = (chunk_of_col < first) | (chunk_of_col >= last)
        v_ctx = jnp.where(jnp.asarray(outside)[:, None, None], jnp.nan, xs[2])
        out = np.asarray(f(xs[0], xs[1], v_ctx, xs[3], xs[4], anc, doc))
        rows = slice(g * G * B, min((g + 1) * G * B, out.shape[0]))
        assert_within(out[rows], want[rows], bound[rows], f"group {g}")


# --- the oracle vs speculators 0.9.0 ------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("W,non_causal", [(None, False), (5, False), (5, True)])
def test_oracle_matches_reference(W, non_causal):
    import torch
    from speculators.models.attention import create_float_mask
    from speculators.models.dflash.attention import create_anchor_block_mask_mod
    from torch.nn.attention.flex_attention import create_mask
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    xs, anc, doc, _ = _row(seed=6)
    S = doc.shape[0]
    causal = W is not None and not non_causal  # the reference's rule for causal_in_block
    mask_mod, q_len, kv_len = create_anchor_block_mask_mod(
        torch.tensor(np.asarray(doc), dtype=torch.long),
        S,
        torch.tensor(np.asarray(anc), dtype=torch.long),
        B,
        sliding_window=W,
        sliding_window_non_causal=non_causal,
    )
    ref_mask = create_mask(mask_mod, None, None, q_len, kv_len, device="cpu")[0, 0].numpy()
    ours = np.asarray(
        att.dense_anchored_block_mask(
            anc, doc, block_size=B, sliding_window=W, causal_in_block=causal
        )
    )
    np.testing.assert_array_equal(ours, ref_mask)

    # The reference's eager path: float mask + transformers' Qwen3 eager_attention_forward.
    float_mask = create_float_mask(
        mask_mod, None, None, q_len, kv_len, device="cpu", dtype=torch.float32
    )
    t = lambda x: torch.tensor(np.asarray(x)).transpose(0, 1)[None]  # noqa: E731  [1, H, T, D]
    q, kc, vc, kb, vb = xs
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = NH // NKV, False
    ref_out, _ = eager_attention_forward(
        module,
        t(q),
        torch.cat([t(kc), t(kb)], 2),
        torch.cat([t(vc), t(vb)], 2),
        float_mask,
        scaling=D**-0.5,
    )
    ref_out = ref_out[0].numpy()  # [Q, Nh, D]
    # Ours (dense and efficient) and torch's eager softmax are fp32 evaluations of the same
    # sums in other orders: the elementwise round-off bound of two such sides (_bounds).
    bound = _bounds(xs, anc, doc, jnp.zeros_like(xs[0]), W, causal)[0]
    assert_within(np.asarray(_dense(W, causal)(*xs, anc, doc)), ref_out, bound, "dense")
    assert_within(np.asarray(_efficient(W, causal)(*xs, anc, doc)), ref_out, bound, "efficient")
