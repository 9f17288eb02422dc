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
    S, A, G, C = document_ids.shape[0], anchors.shape[0], q_block_group, kv_chunk
    n_groups = -(-A // G)
    p = jnp.clip(jnp.pad(anchors, (0, n_groups * G - A)), 0, S - 1).reshape(n_groups, G)
    pos = jnp.arange(S)
    is_start = jnp.concatenate([jnp.ones(1, bool), document_ids[1:] != document_ids[:-1]])
    doc_start = lax.cummax(jnp.where(is_start, pos, 0))  # first position of each position's doc
    start = doc_start[p]
    if sliding_window is not None:
        start = jnp.maximum(start, p - sliding_window)
    nonempty = (document_ids[p] != -1) & (start < p)
    lo = jnp.min(jnp.where(nonempty, start, S), axis=1)
    hi = jnp.max(jnp.where(nonempty, p, 0), axis=1)
    first = jnp.where(hi > lo, lo // C, 0)
    last = jnp.where(hi > lo, (hi + C - 1) // C, 0)
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
    return _attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg)


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


def _layout(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg):
    Q, Nh, D = q.shape
    Nkv = k_ctx.shape[1]
    qg = _to_groups(q, cfg).reshape(-1, cfg.q_block_group, cfg.block_size, Nkv, Nh // Nkv, D)
    ranges = group_chunk_ranges(
        anchors,
        document_ids,
        sliding_window=cfg.sliding_window,
        q_block_group=cfg.q_block_group,
        kv_chunk=cfg.kv_chunk,
    )
    anc = jnp.pad(anchors, (0, ranges.shape[0] * cfg.q_block_group - anchors.shape[0]))
    pad_s = -k_ctx.shape[0] % cfg.kv_chunk
    ctx = [jnp.pad(x, ((0, pad_s), (0, 0), (0, 0))) for x in (k_ctx, v_ctx)]
    doc = jnp.pad(document_ids, (0, pad_s), constant_values=-1)
    groups = (
        qg,
        _to_groups(k_blk, cfg),
        _to_groups(v_blk, cfg),
        anc.reshape(-1, cfg.q_block_group),
        ranges,
    )
    return groups, ctx, doc


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


def _chunk(i, k_ctx, v_ctx, doc, anc, cfg):
    """Chunk i's keys/values [C, Nkv, D] and its visibility for the group, [G, 1, 1, 1, C]."""
    C, start = cfg.kv_chunk, i * cfg.kv_chunk
    kc, vc, dc = (lax.dynamic_slice_in_dim(x, start, C) for x in (k_ctx, v_ctx, doc))
    cols = start + jnp.arange(C)
    d_anc = doc[anc][:, None]  # the anchors' documents, [G, 1]
    vis = (dc[None] == d_anc) & (d_anc != -1) & (cols[None] < anc[:, None])
    if cfg.sliding_window is not None:
        vis &= cols[None] >= anc[:, None] - cfg.sliding_window
    return kc, vc, vis[:, None, None, None, :]


# ----------------------------------------------------------------------------------------------
# Forward and backward. fori_loop bounds come from group_chunk_ranges, so the work per group is
# proportional to the context it can see; chunks outside [first, last) are never touched.


def _forward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg):
    (qg, kbg, vbg, ancg, ranges), (kc_all, vc_all), doc = _layout(
        q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg
    )
    scale, cd = q.shape[-1] ** -0.5, q.dtype

    def group(xs):
        qb, kb, vb, anc, rng = xs
        # The own block always has a visible column (the query itself), so m starts finite
        # and the -inf of masked scores never produces NaN below.
        s = jnp.where(_block_mask(cfg), _dot(_BLK[0], qb, kb, cd) * scale, -jnp.inf)
        m = s.max(-1)
        p = jnp.exp(s - m[..., None])
        init = (m, p.sum(-1), _dot(_BLK[1], p, vb, cd))

        def body(i, carry):
            m, l, acc = carry
            kc, vc, vis = _chunk(i, kc_all, vc_all, doc, anc, cfg)
            s = jnp.where(vis, _dot(_CTX[0], qb, kc, cd) * scale, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + _dot(_CTX[1], p, vc, cd)

        m, l, acc = lax.fori_loop(rng[0], rng[1], body, init)
        return acc / l[..., None], m + jnp.log(l)

    out, lse = lax.map(group, (qg, kbg, vbg, ancg, ranges))
    out = _ungroup(out, q)
    return out, lse  # lse stays grouped: [n_groups, G, B, Nkv, R] fp32


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg):
    return _forward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg)[0]


def _attention_fwd(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg):
    out, lse = _forward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg)
    return out, (q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, out, lse)


def _attention_bwd(cfg, res, dout):
    # Flash-attention backward: P = exp(S - lse) is recomputed per tile from the saved lse.
    # Groups run sequentially (lax.scan) because they all add into dk_ctx/dv_ctx [S, Nkv, D]
    # fp32; dq and the block-token dk/dv belong to one group and come out as scan outputs.
    # Padded queries have dout = 0, so they contribute nothing.
    q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, out, lse = res
    (qg, kbg, vbg, ancg, ranges), (kc_all, vc_all), doc = _layout(
        q, k_ctx, v_ctx, k_blk, v_blk, anchors, document_ids, cfg
    )
    scale, cd = q.shape[-1] ** -0.5, q.dtype
    shape = qg.shape  # [n_groups, G, B, Nkv, R, D]
    dog = _to_groups(dout, cfg).reshape(shape)
    # delta = rowsum(dP * P) = rowsum(dout * out): the softmax-backward correction per query.
    delta = jnp.sum(dog.astype(_F32) * _to_groups(out, cfg).reshape(shape).astype(_F32), -1)

    def grads(p, do, dl, qb, k, v, eqs):
        """dq, dk, dv of one tile from its probabilities p (masked entries exactly 0)."""
        qk_eq, pv_eq, kv_eq = eqs
        ds = p * (_dot(qk_eq, do, v, cd) - dl[..., None])  # dS = P * (dP - delta), dP = dO V^T
        return (
            _dot(pv_eq, ds, k, cd) * scale,
            _dot(kv_eq, ds, qb, cd) * scale,
            _dot(kv_eq, p, do, cd),
        )

    def group(carry, xs):
        dk_ctx, dv_ctx = carry
        qb, kb, vb, anc, rng, do, lse_g, dl = xs
        s = jnp.where(_block_mask(cfg), _dot(_BLK[0], qb, kb, cd) * scale, -jnp.inf)
        dq, dkb, dvb = grads(jnp.exp(s - lse_g[..., None]), do, dl, qb, kb, vb, _BLK)

        def body(i, carry):
            dq, dk_ctx, dv_ctx = carry
            kc, vc, vis = _chunk(i, kc_all, vc_all, doc, anc, cfg)
            s = jnp.where(vis, _dot(_CTX[0], qb, kc, cd) * scale, -jnp.inf)
            dq_i, dk_i, dv_i = grads(jnp.exp(s - lse_g[..., None]), do, dl, qb, kc, vc, _CTX)
            start = i * cfg.kv_chunk
            add = lambda acc, x: lax.dynamic_update_slice_in_dim(  # noqa: E731
                acc, lax.dynamic_slice_in_dim(acc, start, cfg.kv_chunk) + x, start, 0
            )
            return dq + dq_i, add(dk_ctx, dk_i), add(dv_ctx, dv_i)

        dq, dk_ctx, dv_ctx = lax.fori_loop(rng[0], rng[1], body, (dq, dk_ctx, dv_ctx))
        return (dk_ctx, dv_ctx), (dq, dkb, dvb)

    zeros = jnp.zeros(kc_all.shape, _F32)
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
