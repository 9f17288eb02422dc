"""Causal attention of a packed row, within each document, forward only.

Query t of document d sees key s iff ``document_ids[s] == d``, ``s <= t`` and, on a
sliding layer with window W, ``s > t - W`` (transformers' ``sliding_window_overlay``:
W keys including its own). Scores are ``q k^T * scale``, then soft-capped
(``cap * tanh(x / cap)``) when the layer has a cap, as transformers' eager attention. With
``sinks`` (gpt-oss, one logit per head) the softmax also counts a key of that logit whose
value is zero.

``document_causal_attention`` never builds the [S, S] scores: queries are tiled in blocks
of ``q_block`` rows, keys in chunks of ``kv_chunk`` columns, and each query block runs an
online softmax over only the chunks it can see (from its earliest visible key, its
documents' start or its window, to its own last row). Softmax statistics and accumulators
are fp32; matmul operands stay in q's dtype with fp32 accumulation. No gradient: the
verifier is frozen. ``dense_document_causal_attention`` is the test oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dspark_jax import parallel

_F32 = jnp.float32
_MASKED_MAX = -1e30  # finite running-max start: a chunk with no visible key gives p = 0, not NaN


def _dot(eq, a, b, dtype):
    return jnp.einsum(eq, a.astype(dtype), b.astype(dtype), preferred_element_type=_F32)


def _scores(q, k, scale, softcap, dtype, eq):
    s = _dot(eq, q, k, dtype) * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    return s


def document_starts(document_ids: jax.Array) -> jax.Array:
    """First position of each position's document, [S] int32 (documents are contiguous runs)."""
    pos = jnp.arange(document_ids.shape[0], dtype=jnp.int32)
    is_start = jnp.concatenate([jnp.ones(1, bool), document_ids[1:] != document_ids[:-1]])
    return lax.cummax(jnp.where(is_start, pos, 0))


def document_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    document_ids: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    q_block: int = 128,
    kv_chunk: int = 512,
) -> jax.Array:
    """q [S, Nh, D], k [S, Nkv, D], v [S, Nkv, Dv], document_ids [S] int (-1 = padding,
    attends to padding only) -> [S, Nh, Dv] in q's dtype (Dv = D but for MLA). GQA: query
    head h reads kv head h // (Nh/Nkv). Peak temporaries O(q_block * Nh * kv_chunk).

    Under a mesh whose ``context`` axis splits the row (``parallel.context_size() > 1``)
    each device keeps its shard of the queries and gathers the layer's keys, values and
    documents (see :func:`_split_attention`)."""
    S, Nh, D = q.shape
    Nkv = k.shape[1]
    bad_v = v.shape[:2] != k.shape[:2]
    if k.shape != (S, Nkv, D) or bad_v or document_ids.shape != (S,) or Nh % Nkv:
        raise ValueError(
            f"bad shapes: q {q.shape}, k {k.shape}, v {v.shape}, document_ids {document_ids.shape}"
        )
    opts = dict(scale=scale, sliding_window=sliding_window, softcap=softcap,
                q_block=q_block, kv_chunk=kv_chunk)  # fmt: skip
    if parallel.context_size() > 1:
        return _split_attention(q, k, v, document_ids.astype(jnp.int32), sinks, **opts)
    doc = document_ids.astype(jnp.int32)
    return _attend(q, k, v, doc, doc, jnp.int32(0), document_starts(doc), sinks, **opts)


# Context split (docs/design.md, "In-step verifier under a context split"): shard s of C
# holds query rows [s L, (s + 1) L). Per layer it all-gathers the row's keys, values and
# document ids (the keys a causal query can need lie anywhere before it) and runs the same
# blocked online softmax over the chunks its queries see, with global positions. No
# activation [S, H] is gathered; the transient per layer is the row's K and V.


def _shard_keys(k, v, doc):
    """Inside the shard_map: the row's keys, values and documents gathered, and the
    global position of this shard's first query."""
    axis = parallel.CONTEXT_AXIS
    offset = lax.axis_index(axis).astype(jnp.int32) * k.shape[0]
    gathered = (lax.all_gather(x, axis, axis=0, tiled=True) for x in (k, v, doc))
    return *gathered, offset


def _split_attention(q, k, v, doc, sinks, **opts):
    def shard(q, k, v, doc_q, *sinks):
        k_all, v_all, doc_all, offset = _shard_keys(k, v, doc_q)
        start = lax.dynamic_slice_in_dim(document_starts(doc_all), offset, q.shape[0])
        return _attend(q, k_all, v_all, doc_q, doc_all, offset, start, *sinks, **opts)

    seq = P(parallel.CONTEXT_AXIS)
    sinks = () if sinks is None else (sinks,)  # one logit per head, on every shard
    specs = (seq, seq, seq, seq) + (P(),) * len(sinks)
    return parallel.context_shard_map(shard, specs, seq)(q, k, v, doc, *sinks)


def _attend(q, k, v, doc_q, doc_k, offset, start, sinks=None, *, scale, sliding_window,
            softcap, q_block, kv_chunk):  # fmt: skip
    """Queries q [T, Nh, D] at global rows offset .. offset + T - 1 (documents doc_q, their
    documents' first rows ``start``, [T]) over the keys k/v [S, Nkv, D] at rows 0 .. S - 1
    (documents doc_k [S]); ``sinks`` [Nh] or None."""
    T, Nh, D = q.shape
    S, Nkv, Dv = v.shape
    R, Bq, C = Nh // Nkv, min(q_block, T), min(kv_chunk, S)
    n_q, n_kv = -(-T // Bq), -(-S // C)
    pad_q, pad_kv = n_q * Bq - T, n_kv * C - S
    pos = offset + jnp.arange(T, dtype=jnp.int32)
    if sliding_window is not None:
        start = jnp.maximum(start, pos - (sliding_window - 1))
    # Padded query rows get an empty-free range (they see their own padded block only).
    start_q = jnp.pad(start, (0, pad_q), constant_values=S).reshape(n_q, Bq)
    first = start_q.min(axis=1) // C
    last = jnp.minimum(offset + (jnp.arange(n_q) + 1) * Bq - 1, offset + T - 1) // C + 1
    ranges = jnp.stack([jnp.minimum(first, last - 1), last], axis=-1).astype(jnp.int32)

    qg = jnp.pad(q, ((0, pad_q), (0, 0), (0, 0))).reshape(n_q, Bq, Nkv, R, D)
    pos_q = jnp.pad(pos, (0, pad_q), constant_values=S).reshape(n_q, Bq)
    doc_q = jnp.pad(doc_q, (0, pad_q), constant_values=-2).reshape(n_q, Bq)
    kp, vp = (jnp.pad(x, ((0, pad_kv), (0, 0), (0, 0))) for x in (k, v))
    doc_k = jnp.pad(doc_k, (0, pad_kv), constant_values=-3)
    cd = q.dtype

    def block(xs):
        qb, pq, dq, rng = xs  # [Bq, Nkv, R, D], [Bq], [Bq], [2]

        def body(i, carry):
            m, l, acc = carry
            kc, vc, dk = (lax.dynamic_slice_in_dim(x, i * C, C) for x in (kp, vp, doc_k))
            pk = i * C + jnp.arange(C, dtype=jnp.int32)
            vis = (dk[None] == dq[:, None]) & (pk[None] <= pq[:, None])
            if sliding_window is not None:
                vis &= pk[None] > pq[:, None] - sliding_window
            s = _scores(qb, kc, scale, softcap, cd, "bkrd,ckd->bkrc")
            s = jnp.where(vis[:, None, None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            return (
                m_new,
                alpha * l + p.sum(-1),
                alpha[..., None] * acc + _dot("bkrc,ckd->bkrd", p, vc, cd),
            )

        init = (
            jnp.full(qb.shape[:-1], _MASKED_MAX, _F32),
            jnp.zeros(qb.shape[:-1], _F32),
            jnp.zeros((*qb.shape[:-1], Dv), _F32),
        )
        m, l, acc = lax.fori_loop(rng[0], rng[1], body, init)
        if sinks is not None:  # the sink: one more key, of logit sinks[h] and value 0
            sink = sinks.astype(_F32).reshape(Nkv, R)
            m_new = jnp.maximum(m, sink)
            alpha = jnp.exp(m - m_new)
            l, acc = alpha * l + jnp.exp(sink - m_new), alpha[..., None] * acc
        return acc / jnp.where(l > 0, l, 1.0)[..., None]  # l = 0 only on padded query rows

    out = lax.map(block, (qg, pos_q, doc_q, ranges))
    return out.reshape(n_q * Bq, Nh, Dv)[:T].astype(q.dtype)


def dense_document_causal_attention(
    q, k, v, document_ids, *, scale, sliding_window=None, softcap=None, sinks=None
) -> jax.Array:
    """Test oracle: the full [S, S] mask and an fp32 softmax (transformers' eager order);
    the sinks as one more column of scores, dropped after the softmax."""
    S = q.shape[0]
    i, j = jnp.arange(S)[:, None], jnp.arange(S)[None]
    mask = (document_ids[:, None] == document_ids[None]) & (j <= i)
    if sliding_window is not None:
        mask &= j > i - sliding_window
    rep = q.shape[1] // k.shape[1]
    kk = jnp.repeat(k.astype(_F32), rep, axis=1)
    vv = jnp.repeat(v.astype(_F32), rep, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q.astype(_F32), kk) * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    s = jnp.where(mask[None], s, -jnp.inf)
    if sinks is not None:
        column = jnp.broadcast_to(sinks.astype(_F32)[:, None, None], (*s.shape[:2], 1))
        p = jax.nn.softmax(jnp.concatenate([s, column], axis=-1), axis=-1)[..., :-1]
    else:
        p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("hqk,khd->qhd", p, vv).astype(q.dtype)
