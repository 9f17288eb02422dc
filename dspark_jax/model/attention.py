"""Anchored-block attention of the DSpark/DFlash drafter, for one packed row.

Semantics (speculators 0.9.0 ``create_anchor_block_mask_mod`` + eager softmax attention):
query q of block j = q // B (anchor p = anchors[j], document d = document_ids[p]) sees
context column c iff ``document_ids[c] == d != -1`` and ``c < p`` (and ``c >= p - W`` on
sliding layers), and block token t iff ``t // B == j`` (and ``t <= q`` if causal_in_block).
Scale D**-0.5; GQA query head h reads kv head ``h // (Nh // Nkv)`` (HF ``repeat_kv``).

``anchored_block_attention`` never builds the dense [Q, S+Q] mask or scores. Queries are
tiled in groups of ``q_block_group`` blocks, the context in chunks of ``kv_chunk`` positions,
and each group runs an online (flash) softmax over only the chunks it can see; the tiny
intra-block [B, B] attention seeds that softmax. Because a dynamic trip count cannot be
reverse-differentiated, the function is a ``jax.custom_vjp``: forward keeps the output and the
per-query log-sum-exp; backward recomputes the probabilities tile by tile with the same loops.
Nothing proportional to Q x S is stored.

Under a mesh whose ``context`` axis splits the row's tokens (``parallel.context_size() > 1``),
the context keys/values stay split and the partial softmaxes of every query merge across the
devices (docs/design.md, "Context parallelism"; ``_cp_attention`` below).

One row at a time: map rows with ``jax.vmap`` or ``lax.map``. Both are exact. Under vmap the
per-row chunk loops become one batched ``while_loop`` that runs for the longest row's trip count,
with finished rows masked out by select; ``lax.map`` keeps the per-row trip counts.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dspark_jax import parallel

_F32 = jnp.float32


class _Cfg(NamedTuple):  # static (hashable) settings, a nondiff argument of the custom_vjp
    block_size: int
    sliding_window: int | None
    causal_in_block: bool
    q_block_group: int
    kv_chunk: int


def group_chunk_ranges(anchors, document_ids, *, sliding_window, q_block_group, kv_chunk):
    """Context chunks each query group can see: int32 [n_groups, 2], half-open [first, last).

    anchors [A] int, document_ids [S] int; n_groups = ceil(A / q_block_group), the last group
    padded with anchor 0. Anchor p sees context only inside [start(p), p), start(p) =
    max(start of p's document, p - W); the range is empty when p starts its document, p = 0
    (padding anchors) or p is padding (doc -1). A group's range is the hull of its anchors'
    ranges: it covers every visible column for any anchor order, its end chunks always hold a
    visible column, and with sorted anchors (select_anchors) it has few invisible chunks inside.
    Assumes each document occupies one contiguous run of positions (true for packed rows).
    """
    S = document_ids.shape[0]
    p = _group_anchors(anchors, q_block_group, S)
    lo, hi = _group_columns(p, document_ids[p], document_starts(document_ids)[p], sliding_window)
    return _chunks_of(lo, hi, 0, S, kv_chunk)


def document_starts(document_ids):
    """[S] -> [S] int32: the first position of each position's document (a run of equal
    ids)."""
    pos = jnp.arange(document_ids.shape[0], dtype=jnp.int32)
    is_start = jnp.concatenate([jnp.ones(1, bool), document_ids[1:] != document_ids[:-1]])
    return lax.cummax(jnp.where(is_start, pos, 0))


def _group_anchors(anchors, q_block_group, seq_len):
    """[A] -> [n_groups, G] anchors, the last group padded with anchor 0."""
    n_groups = -(-anchors.shape[0] // q_block_group)
    p = jnp.pad(anchors, (0, n_groups * q_block_group - anchors.shape[0]))
    return jnp.clip(p, 0, seq_len - 1).reshape(n_groups, q_block_group)


def _group_columns(p, doc_p, start_p, sliding_window):
    """Each group's hull of visible context columns, half-open [lo, hi) ([n_groups] each,
    lo >= hi when the group sees no context), from its anchors p [n_groups, G], their
    documents and their documents' first positions."""
    start = start_p if sliding_window is None else jnp.maximum(start_p, p - sliding_window)
    nonempty = (doc_p != -1) & (start < p)
    lo = jnp.min(jnp.where(nonempty, start, jnp.iinfo(jnp.int32).max), axis=1)
    hi = jnp.max(jnp.where(nonempty, p, 0), axis=1)
    return lo, hi


def _chunks_of(lo, hi, offset, length, kv_chunk):
    """Global columns [lo, hi) -> the chunks of a shard holding columns [offset, offset +
    length) that cover them: int32 [n_groups, 2], [0, 0) when none."""
    lo = jnp.clip(lo - offset, 0, length)
    hi = jnp.clip(hi - offset, 0, length)
    first = jnp.where(hi > lo, lo // kv_chunk, 0)
    last = jnp.where(hi > lo, (hi + kv_chunk - 1) // kv_chunk, 0)
    return jnp.stack([first, last], axis=-1).astype(jnp.int32)


def anchored_block_attention(
    q,
    k_ctx,
    v_ctx,
    k_blk,
    v_blk,
    anchors,
    document_ids,
    *,
    block_size: int,
    sliding_window: int | None,
    causal_in_block: bool,
    q_block_group: int = 16,
    kv_chunk: int = 512,
):
    """Memory-efficient anchored-block attention for one packed row (differentiable).

    q [Q, Nh, D] (Q = A * block_size, already normed and RoPE'd); k_ctx, v_ctx [S, Nkv, D];
    k_blk, v_blk [Q, Nkv, D]; anchors [A] int32 (valid anchors first, sorted; padding = 0);
    document_ids [S] int32 (-1 = padding). Returns [Q, Nh, D] in q's dtype. Softmax statistics
    and all accumulators are fp32; matmul operands stay in q's dtype (fp32 accumulation), as in
    flash attention. Gradients flow to q, k_ctx, v_ctx, k_blk, v_blk (anchors, ids: none).
    Peak temporaries are O(q_block_group * block_size * Nh * kv_chunk) per step; residuals are
    the inputs, the output and an fp32 [Q, Nh] log-sum-exp. Works under jit, and over rows
    under vmap or lax.map (see the module docstring).
    """
    (Q, Nh, D), (S, Nkv, _), A = q.shape, k_ctx.shape, anchors.shape[0]
    if (
        Q != A * block_size
        or Nh % Nkv
        or document_ids.shape != (S,)
        or v_ctx.shape != (S, Nkv, D)
        or k_blk.shape != (Q, Nkv, D)
        or v_blk.shape != (Q, Nkv, D)
    ):
        raise ValueError(
            f"bad shapes: q {q.shape}, k/v_ctx {k_ctx.shape}/{v_ctx.shape}, "
            f"k/v_blk {k_blk.shape}/{v_blk.shape}, document_ids "
            f"{document_ids.shape}, {A} anchors x block_size {block_size}"
        )
    cfg = _Cfg(block_size, sliding_window, bool(causal_in_block), q_block_group, kv_chunk)
    split = parallel.context_size()
    if split == 1:
        return _attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg)
    if S % split:
        raise ValueError(f"row length {S} is not a multiple of the mesh's context={split}")
    return _cp_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg)


# ----------------------------------------------------------------------------------------------
# Layout. Queries and block keys go to [n_groups, G, B, ...] (A padded to a multiple of G with
# zero queries and anchor 0, which see only their own block); GQA query heads split into
# [Nkv, R] so that head h = k * R + r reads kv head k. The context is padded to a multiple of
# kv_chunk with document -1, which no query can see.


def _to_groups(x, cfg):
    """[Q, ...] -> [n_groups, G, B, ...], zero-padded."""
    n = -(-x.shape[0] // (cfg.q_block_group * cfg.block_size))
    pad = n * cfg.q_block_group * cfg.block_size - x.shape[0]
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(n, cfg.q_block_group, cfg.block_size, *x.shape[1:])


def _ungroup(x, like):
    """Inverse of _to_groups (drops the padding), cast to like's dtype."""
    return x.reshape(-1, *like.shape[1:])[: like.shape[0]].astype(like.dtype)


def _layout(q, k_blk, v_blk, anchors, cfg):
    """Queries [n_groups, G, B, Nkv, R, D], block keys/values [n_groups, G, B, Nkv, D] and
    anchors [n_groups, G] (padded with anchor 0)."""
    Q, Nh, D = q.shape
    Nkv = k_blk.shape[1]
    qg = _to_groups(q, cfg).reshape(-1, cfg.q_block_group, cfg.block_size, Nkv, Nh // Nkv, D)
    anc = jnp.pad(anchors, (0, qg.shape[0] * cfg.q_block_group - anchors.shape[0]))
    return qg, _to_groups(k_blk, cfg), _to_groups(v_blk, cfg), anc.reshape(qg.shape[:2])


def _pad_context(k_ctx, v_ctx, document_ids, cfg):
    """Context keys, values and documents padded to a multiple of kv_chunk (document -1)."""
    pad_s = -k_ctx.shape[0] % cfg.kv_chunk
    k, v = (jnp.pad(x, ((0, pad_s), (0, 0), (0, 0))) for x in (k_ctx, v_ctx))
    return k, v, jnp.pad(document_ids, (0, pad_s), constant_values=-1)


def _dot(eq, a, b, dtype):
    """einsum with operands in the compute dtype and an fp32 result."""
    return jnp.einsum(eq, a.astype(dtype), b.astype(dtype), preferred_element_type=_F32)


# Index letters: g block in group, b query slot, t key slot, k kv head, r query head per kv head,
# c context column in the chunk, d head dim.
# Per tile kind: (scores Q K^T, output P V, key-side gradient P^T X).
_BLK = ("gbkrd,gtkd->gbkrt", "gbkrt,gtkd->gbkrd", "gbkrt,gbkrd->gtkd")
_CTX = ("gbkrd,ckd->gbkrc", "gbkrc,ckd->gbkrd", "gbkrc,gbkrd->ckd")


def _block_mask(cfg):
    """Static [query slot, key slot] visibility inside a block, shaped [1, B, 1, 1, B]."""
    m = np.ones((cfg.block_size, cfg.block_size), bool)
    if cfg.causal_in_block:
        m = np.tril(m)  # key slot <= query slot
    return jnp.asarray(m)[None, :, None, None, :]


def _chunk(i, ctx, anc, anc_doc, col0, cfg):
    """Chunk i's keys/values [C, Nkv, D] and its visibility for the group, [G, 1, 1, 1, C].

    ctx: (keys, values, documents) of the context this device holds, whose first column is
    the row's column col0; anc [G] the group's anchors and anc_doc [G] their documents.
    """
    C, start = cfg.kv_chunk, i * cfg.kv_chunk
    kc, vc, dc = (lax.dynamic_slice_in_dim(x, start, C) for x in ctx)
    cols = col0 + start + jnp.arange(C)
    d_anc = anc_doc[:, None]
    vis = (dc[None] == d_anc) & (d_anc != -1) & (cols[None] < anc[:, None])
    if cfg.sliding_window is not None:
        vis &= cols[None] >= anc[:, None] - cfg.sliding_window
    return kc, vc, vis[:, None, None, None, :]


# ----------------------------------------------------------------------------------------------
# Forward and backward. fori_loop bounds come from group_chunk_ranges, so the work per group is
# proportional to the context it can see; chunks outside [first, last) are never touched.


def _block_scores(qb, kb, cfg):
    return jnp.where(_block_mask(cfg), _dot(_BLK[0], qb, kb, qb.dtype) * qb.shape[-1] ** -0.5,
                     -jnp.inf)  # fmt: skip


def _block_softmax(qb, kb, vb, cfg):
    """The intra-block attention's (max, sum, unnormalised output). The own block always
    has a visible column (the query itself), so the max is finite."""
    s = _block_scores(qb, kb, cfg)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    return m, p.sum(-1), _dot(_BLK[1], p, vb, qb.dtype)


def _context_pass(qb, anc, anc_doc, rng, ctx, col0, init, cfg):
    """Online softmax of one group over the context chunks [rng[0], rng[1]), from the
    running (max, sum, unnormalised output) init."""
    scale, cd = qb.shape[-1] ** -0.5, qb.dtype

    def body(i, carry):
        m, l, acc = carry
        kc, vc, vis = _chunk(i, ctx, anc, anc_doc, col0, cfg)
        s = jnp.where(vis, _dot(_CTX[0], qb, kc, cd) * scale, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + _dot(_CTX[1], p, vc, cd)

    return lax.fori_loop(rng[0], rng[1], body, init)


def _forward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg):
    qg, kbg, vbg, ancg = _layout(q, k_blk, v_blk, anchors, cfg)
    ranges = group_chunk_ranges(
        anchors,
        document_ids,
        sliding_window=cfg.sliding_window,
        q_block_group=cfg.q_block_group,
        kv_chunk=cfg.kv_chunk,
    )
    ctx = _pad_context(k_ctx, v_ctx, document_ids, cfg)

    def group(xs):
        qb, kb, vb, anc, rng = xs
        # The block seeds the softmax: m starts finite, so masked -inf scores give no NaN.
        init = _block_softmax(qb, kb, vb, cfg)
        m, l, acc = _context_pass(qb, anc, ctx[2][anc], rng, ctx, 0, init, cfg)
        return acc / l[..., None], m + jnp.log(l)

    out, lse = lax.map(group, (qg, kbg, vbg, ancg, ranges))
    return _ungroup(out, q), lse  # lse stays grouped: [n_groups, G, B, Nkv, R] fp32


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg):
    return _forward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg)[0]


def _attention_fwd(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg):
    out, lse = _forward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg)
    return out, (q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, out, lse)


# Flash-attention backward: P = exp(S - lse) is recomputed per tile from the saved lse.
# Groups run sequentially (lax.scan) because they all add into dk_ctx/dv_ctx [S, Nkv, D]
# fp32; dq and the block-token dk/dv belong to one group and come out as scan outputs.
# Padded queries have dout = 0, so they contribute nothing.


def _dout_groups(dout, out, shape, cfg):
    """dout in groups, and delta = rowsum(dP * P) = rowsum(dout * out), the softmax-backward
    correction per query (fp32)."""
    dog = _to_groups(dout, cfg).reshape(shape)
    delta = jnp.sum(dog.astype(_F32) * _to_groups(out, cfg).reshape(shape).astype(_F32), -1)
    return dog, delta


def _tile_grads(p, do, dl, qb, k, v, eqs):
    """dq, dk, dv of one tile from its probabilities p (masked entries exactly 0)."""
    scale, cd = qb.shape[-1] ** -0.5, qb.dtype
    qk_eq, pv_eq, kv_eq = eqs
    ds = p * (_dot(qk_eq, do, v, cd) - dl[..., None])  # dS = P * (dP - delta), dP = dO V^T
    return (
        _dot(pv_eq, ds, k, cd) * scale,
        _dot(kv_eq, ds, qb, cd) * scale,
        _dot(kv_eq, p, do, cd),
    )


def _block_grads(qb, kb, vb, do, lse_g, dl, cfg):
    p = jnp.exp(_block_scores(qb, kb, cfg) - lse_g[..., None])
    return _tile_grads(p, do, dl, qb, kb, vb, _BLK)


def _context_grads(qb, do, lse_g, dl, anc, anc_doc, rng, ctx, col0, carry, cfg):
    """Adds one group's context tiles into carry = (dq, dk_ctx, dv_ctx), the last two
    [padded context, Nkv, D] fp32 accumulators of the context this device holds."""
    scale, cd = qb.shape[-1] ** -0.5, qb.dtype

    def body(i, carry):
        dq, dk_ctx, dv_ctx = carry
        kc, vc, vis = _chunk(i, ctx, anc, anc_doc, col0, cfg)
        s = jnp.where(vis, _dot(_CTX[0], qb, kc, cd) * scale, -jnp.inf)
        dq_i, dk_i, dv_i = _tile_grads(jnp.exp(s - lse_g[..., None]), do, dl, qb, kc, vc, _CTX)
        start = i * cfg.kv_chunk
        add = lambda acc, x: lax.dynamic_update_slice_in_dim(  # noqa: E731
            acc, lax.dynamic_slice_in_dim(acc, start, cfg.kv_chunk) + x, start, 0
        )
        return dq + dq_i, add(dk_ctx, dk_i), add(dv_ctx, dv_i)

    return lax.fori_loop(rng[0], rng[1], body, carry)


def _attention_bwd(cfg, res, dout):
    q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, out, lse = res
    qg, kbg, vbg, ancg = _layout(q, k_blk, v_blk, anchors, cfg)
    ranges = group_chunk_ranges(
        anchors,
        document_ids,
        sliding_window=cfg.sliding_window,
        q_block_group=cfg.q_block_group,
        kv_chunk=cfg.kv_chunk,
    )
    ctx = _pad_context(k_ctx, v_ctx, document_ids, cfg)
    dog, delta = _dout_groups(dout, out, qg.shape, cfg)

    def group(carry, xs):
        qb, kb, vb, anc, rng, do, lse_g, dl = xs
        dq, dkb, dvb = _block_grads(qb, kb, vb, do, lse_g, dl, cfg)
        dq, dk_ctx, dv_ctx = _context_grads(
            qb, do, lse_g, dl, anc, ctx[2][anc], rng, ctx, 0, (dq, *carry), cfg
        )
        return (dk_ctx, dv_ctx), (dq, dkb, dvb)

    zeros = jnp.zeros(ctx[0].shape, _F32)
    (dk_ctx, dv_ctx), (dq, dkb, dvb) = lax.scan(
        group, (zeros, zeros), (qg, kbg, vbg, ancg, ranges, dog, lse, delta)
    )
    S = k_ctx.shape[0]
    return (
        _ungroup(dq, q),
        dk_ctx[:S].astype(k_ctx.dtype),
        dv_ctx[:S].astype(v_ctx.dtype),
        _ungroup(dkb, k_blk),
        _ungroup(dvb, v_blk),
        None,
        None,
    )


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------------------------
# Context parallelism (docs/design.md, "Context parallelism"): the row's context keys, values
# and documents are split over the mesh axis ``context`` in C equal shards; the queries, block
# keys/values and anchors are on every device. Each device runs the online softmax of every
# query group over the chunks of its own shard that the group can see (global column numbers:
# shard s holds columns [s L, (s + 1) L)), and the C partial (max, sum, output) merge with a
# pmax and two psums; the intra-block part is added after, once. The backward recomputes the
# tiles per shard from the merged lse: dk/dv stay on their shard, the partial dq are psummed.


def _shard_document_starts(doc, offset):
    """Inside the shard_map: document_starts of this shard's columns doc [L] (global
    positions). Needs two ints per shard from the others: the previous shard's last
    document (does this shard's first column start one?) and the latest start before."""
    L, axis = doc.shape[0], parallel.CONTEXT_AXIS
    s = lax.axis_index(axis)
    lasts = lax.all_gather(doc[-1], axis)
    first = (s == 0) | (doc[0] != lasts[jnp.maximum(s - 1, 0)])
    is_start = jnp.concatenate([first[None], doc[1:] != doc[:-1]])
    starts = jnp.where(is_start, offset + jnp.arange(L, dtype=jnp.int32), -1)
    latest = lax.all_gather(starts.max(), axis)  # -1 for a shard without a start
    before = jnp.max(jnp.where(jnp.arange(latest.shape[0]) < s, latest, 0))
    return lax.cummax(jnp.maximum(starts, before))


def _shard_view(k_loc, v_loc, doc_loc, ancg, cfg):
    """Inside the shard_map: this shard's padded context, its first column, the anchors'
    documents [n_groups, G] and the chunks of this shard each group sees [n_groups, 2]."""
    L = doc_loc.shape[0]
    offset = lax.axis_index(parallel.CONTEXT_AXIS) * L
    starts = _shard_document_starts(doc_loc, offset)
    flat = ancg.reshape(-1)
    anc_doc = parallel.shard_take(doc_loc, flat).reshape(ancg.shape)
    anc_start = parallel.shard_take(starts, flat).reshape(ancg.shape)
    lo, hi = _group_columns(ancg, anc_doc, anc_start, cfg.sliding_window)
    ranges = _chunks_of(lo, hi, offset, L, cfg.kv_chunk)
    return _pad_context(k_loc, v_loc, doc_loc, cfg), offset, anc_doc, ranges


_SEQ = P(parallel.CONTEXT_AXIS)


def _cp_forward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg):
    qg, kbg, vbg, ancg = _layout(q, k_blk, v_blk, anchors, cfg)
    axis = parallel.CONTEXT_AXIS

    def shard(qg, k_loc, v_loc, doc_loc, ancg):
        ctx, offset, anc_doc, ranges = _shard_view(k_loc, v_loc, doc_loc, ancg, cfg)

        def group(xs):
            qb, anc, a_doc, rng = xs
            # A finite floor instead of -inf: a shard the group cannot see keeps (floor, 0, 0)
            # and exp(score - floor) = 0 for masked scores, never NaN.
            floor = jnp.full(qb.shape[:-1], jnp.finfo(_F32).min, _F32)
            init = (floor, jnp.zeros_like(floor), jnp.zeros(qb.shape, _F32))
            return _context_pass(qb, anc, a_doc, rng, ctx, offset, init, cfg)

        m, l, acc = lax.map(group, (qg, ancg, anc_doc, ranges))
        m_all = lax.pmax(m, axis)
        w = jnp.exp(m - m_all)
        return m_all, lax.psum(l * w, axis), lax.psum(acc * w[..., None], axis)

    m_c, l_c, acc_c = parallel.context_shard_map(
        shard, (P(), _SEQ, _SEQ, _SEQ, P()), (P(), P(), P())
    )(qg, k_ctx, v_ctx, document_ids, ancg)
    m_b, l_b, acc_b = lax.map(lambda xs: _block_softmax(*xs, cfg), (qg, kbg, vbg))
    m = jnp.maximum(m_b, m_c)
    w_b, w_c = jnp.exp(m_b - m), jnp.exp(m_c - m)
    l = l_b * w_b + l_c * w_c
    acc = acc_b * w_b[..., None] + acc_c * w_c[..., None]
    return _ungroup(acc / l[..., None], q), m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _cp_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg):
    return _cp_forward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg)[0]


def _cp_attention_fwd(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg):
    out, lse = _cp_forward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg)
    return out, (q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, out, lse)


def _cp_attention_bwd(cfg, res, dout):
    q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, out, lse = res
    qg, kbg, vbg, ancg = _layout(q, k_blk, v_blk, anchors, cfg)
    dog, delta = _dout_groups(dout, out, qg.shape, cfg)

    def shard(qg, dog, lse, delta, k_loc, v_loc, doc_loc, ancg):
        ctx, offset, anc_doc, ranges = _shard_view(k_loc, v_loc, doc_loc, ancg, cfg)

        def group(carry, xs):
            qb, do, lse_g, dl, anc, a_doc, rng = xs
            init = (jnp.zeros(qb.shape, _F32), *carry)
            dq, dk, dv = _context_grads(qb, do, lse_g, dl, anc, a_doc, rng, ctx, offset, init, cfg)
            return (dk, dv), dq

        zeros = jnp.zeros(ctx[0].shape, _F32)
        (dk, dv), dq = lax.scan(group, (zeros, zeros), (qg, dog, lse, delta, ancg, anc_doc, ranges))
        L = k_loc.shape[0]
        return lax.psum(dq, parallel.CONTEXT_AXIS), dk[:L], dv[:L]

    specs = (P(), P(), P(), P(), _SEQ, _SEQ, _SEQ, P())
    dq_c, dk_ctx, dv_ctx = parallel.context_shard_map(shard, specs, (P(), _SEQ, _SEQ))(
        qg, dog, lse, delta, k_ctx, v_ctx, document_ids, ancg
    )
    dq_b, dkb, dvb = lax.map(lambda xs: _block_grads(*xs, cfg), (qg, kbg, vbg, dog, lse, delta))
    return (
        _ungroup(dq_b + dq_c, q),
        dk_ctx.astype(k_ctx.dtype),
        dv_ctx.astype(v_ctx.dtype),
        _ungroup(dkb, k_blk),
        _ungroup(dvb, v_blk),
        None,
        None,
    )


_cp_attention.defvjp(_cp_attention_fwd, _cp_attention_bwd)


# ----------------------------------------------------------------------------------------------
# Dense oracle (tests only): the reference's full boolean mask and a plain fp32 softmax.


def dense_anchored_block_mask(
    anchors, document_ids, *, block_size, sliding_window, causal_in_block
):
    """Bool [Q, S + Q], True = visible; columns are [context | block tokens] as in the reference."""
    Q, S = anchors.shape[0] * block_size, document_ids.shape[0]
    qi = jnp.arange(Q)
    p = anchors[qi // block_size][:, None]
    d = document_ids[p]
    c = jnp.arange(S)[None]
    ctx = (document_ids[None] == d) & (d != -1) & (c < p)
    if sliding_window is not None:
        ctx &= c >= p - sliding_window
    t = jnp.arange(Q)[None]
    blk = t // block_size == qi[:, None] // block_size
    if causal_in_block:
        blk &= t <= qi[:, None]
    return jnp.concatenate([ctx, blk], axis=1)


def dense_anchored_block_attention(
    q,
    k_ctx,
    v_ctx,
    k_blk,
    v_blk,
    anchors,
    document_ids,
    *,
    block_size,
    sliding_window,
    causal_in_block,
):
    """Test oracle with the shapes and semantics of ``anchored_block_attention`` (fp32 math)."""
    mask = dense_anchored_block_mask(
        anchors,
        document_ids,
        block_size=block_size,
        sliding_window=sliding_window,
        causal_in_block=causal_in_block,
    )
    rep = q.shape[1] // k_ctx.shape[1]
    k = jnp.repeat(jnp.concatenate([k_ctx, k_blk]).astype(_F32), rep, axis=1)  # repeat_kv
    v = jnp.repeat(jnp.concatenate([v_ctx, v_blk]).astype(_F32), rep, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q.astype(_F32), k) * q.shape[-1] ** -0.5
    p = jax.nn.softmax(jnp.where(mask[None], s, -jnp.inf), axis=-1)
    return jnp.einsum("hqk,khd->qhd", p, v).astype(q.dtype)
