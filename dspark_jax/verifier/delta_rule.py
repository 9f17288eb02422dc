"""The gated delta rule of Kimi Delta Attention (KDA) over one packed row, fp32.

Per head, a state S [dk, dv] runs over the tokens (transformers 5.19
``recurrent_kimi_delta_attention``; docs/design.md, "KDA"):

    S <- diag(exp(g_t)) S                      (per-channel forget gate, g_t <= 0)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T    (the delta rule's write)
    o_t = S^T (q_t / sqrt(dk))

and restarts at zero at every document of the row (each document's outputs are those of
its own forward). :func:`chunked` is the training form: chunks of C tokens, each solved in
parallel (a unit lower-triangular system for the chunk's writes, transformers'
``chunk_kimi_delta_attention`` in WY form), the state carried from chunk to chunk by a
``lax.scan``. A document edge inside a chunk masks the pairs across it and keeps the
carried state from the tokens after it. Per step the chunk's [H, C, C, dk] decays are
built, never anything of the row's length squared. :func:`recurrent` is the token-by-token
definition (the tests' oracle and the dense path).

Under a context split (``parallel.context_size() > 1``; docs/design.md, "In-step verifier
under a context split") each device runs its own tokens: a chunk's state update is affine
in the incoming state (S' = K S + c, K [dk, dk] per head), and so are its outputs. One
pass from the state [0 | I] (the value columns, then dk columns that carry the linear
part) gives every token's output as out0 + R S_in and the shard's end state as A S_in + B.
The devices all-gather their (A, B) (H dk (dk + dv) values each, never a token) and each
composes those of the shards before it into its S_in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dspark_jax import parallel

_F32 = jnp.float32
_NO_DOCUMENT = jnp.iinfo(jnp.int32).min  # a document id no token has


def recurrent(q, k, v, g, beta, document_ids):
    """q, k [T, H, dk] (l2-normalised), v [T, H, dv], g [T, H, dk] log forget gates,
    beta [T, H], document_ids [T] -> [T, H, dv] fp32, one token at a time."""
    q = q.astype(_F32) * q.shape[-1] ** -0.5
    T, H, dk = k.shape
    prev = jnp.concatenate([jnp.full((1,), _NO_DOCUMENT, jnp.int32), document_ids[:-1]])

    def step(S, t):
        qt, kt, vt, gt, bt, same = t
        S = jnp.where(same, S, 0.0) * jnp.exp(gt)[..., None]
        delta = (vt - jnp.einsum("hk,hkv->hv", kt, S)) * bt[:, None]
        S = S + kt[..., None] * delta[:, None, :]
        return S, jnp.einsum("hk,hkv->hv", qt, S)

    xs = (q, k.astype(_F32), v.astype(_F32), g.astype(_F32), beta.astype(_F32),
          document_ids == prev)  # fmt: skip
    _, out = jax.lax.scan(step, jnp.zeros((H, dk, v.shape[-1]), _F32), xs)
    return out


def chunked(q, k, v, g, beta, document_ids, chunk: int = 64):
    """Same arguments and result as :func:`recurrent`, chunk by chunk."""
    doc = document_ids.astype(jnp.int32)
    if parallel.context_size() > 1:
        return _split_chunked(q, k, v, g, beta, doc, chunk)
    H, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    start = jnp.zeros((H, dk, dv), _F32)
    return _chunks(q, k, v, g, beta, doc, start, jnp.int32(_NO_DOCUMENT), chunk)[0]


def _chunks(q, k, v, g, beta, doc, state, state_doc, chunk):
    """The chunked rule from ``state`` [H, dk, dv] (the carried state of document
    ``state_doc``) -> (outputs [T, H, dv], the state after the last token [H, dk, dv])."""
    T, H, dk = k.shape
    C = chunk
    pad = -T % C
    n = (T + pad) // C

    def chunks(x, fill=0):  # [T, ...] -> [n, C, ...]
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape(n, C, *x.shape[1:])

    # padding tokens change nothing: in the last token's document, no decay (g = 0), no
    # write (beta = 0), so the state after them is the state after the row's last token
    docs = chunks(doc, doc[-1])
    q = chunks(q.astype(_F32) * dk**-0.5)
    k, v, g, beta = (chunks(x.astype(_F32)) for x in (k, v, g, beta))
    causal = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    eye = jnp.eye(C, dtype=_F32)

    def step(carry, xs):
        S, state_doc = carry  # S [H, dk, dv]; the document the state belongs to
        qc, kc, vc, gc, bc, dc = xs  # [C, H, ...], dc [C]
        qc, kc, vc, gc = (jnp.swapaxes(x, 0, 1) for x in (qc, kc, vc, gc))  # [H, C, d]
        bc = bc.T  # [H, C]
        G = jnp.cumsum(gc, axis=1)  # log decay from the chunk's start, [H, C, dk]
        same = dc[:, None] == dc[None, :]
        # exp(G_i - G_j): the decay from token j to token i, zero where j > i or across
        # a document edge (-inf before exp: no inf * 0)
        diff = G[:, :, None, :] - G[:, None, :, :]  # [H, C, C, dk]
        decay = jnp.exp(jnp.where((causal & same)[None, :, :, None], diff, -jnp.inf))
        kb = kc * bc[..., None]
        # the chunk's writes: (I + L) W = I, L[i, j] = beta_i k_i . diag(decay_ij) k_j, j < i
        L = jnp.where(strict, jnp.einsum("hid,hjd,hijd->hij", kb, kc, decay), 0.0)
        W = jax.scipy.linalg.solve_triangular(
            eye + L, jnp.broadcast_to(eye, L.shape), lower=True, unit_diagonal=True
        )
        # tokens still in the carried state's document see it, decayed to their position
        from_state = (dc == state_doc)[None, :, None]
        eG = jnp.where(from_state, jnp.exp(G), 0.0)
        u = W @ (vc * bc[..., None]) - W @ (kb * eG) @ S  # the writes' values, [H, C, dv]
        scores = jnp.einsum("hid,hjd,hijd->hij", qc, kc, decay)  # causal, in-document
        out = (qc * eG) @ S + scores @ u
        # the state after the chunk: the last token's document only
        last = dc[-1]
        to_end = jnp.exp(jnp.where((dc == last)[None, :, None], G[:, -1:, :] - G, -jnp.inf))
        keep = jnp.where(last == state_doc, jnp.exp(G[:, -1, :]), 0.0)  # [H, dk]
        S = S * keep[..., None] + jnp.swapaxes(kc * to_end, 1, 2) @ u
        return (S, last), jnp.swapaxes(out, 0, 1)

    (end, _), out = lax.scan(step, (state, state_doc), (q, k, v, g, beta, docs))
    return out.reshape(n * C, H, -1)[:T], end


def _split_chunked(q, k, v, g, beta, doc, chunk):
    """:func:`chunked` of a row whose tokens are split over ``context``, inside a
    shard_map: each device its tokens, the carried state handed over by :func:`hand_off`."""

    def shard(q, k, v, g, beta, doc):
        axis = parallel.CONTEXT_AXIS
        s = lax.axis_index(axis)
        T, H, dk = k.shape
        dv = v.shape[-1]
        state_doc = incoming_document(doc)
        # from [0 | I]: value columns from a zero state, then the linear part's dk columns
        v = jnp.concatenate([v.astype(_F32), jnp.zeros((T, H, dk), _F32)], axis=-1)
        eye = jnp.broadcast_to(jnp.eye(dk, dtype=_F32), (H, dk, dk))
        start = jnp.concatenate([jnp.zeros((H, dk, dv), _F32), eye], axis=-1)
        out, end = _chunks(q, k, v, g, beta, doc, start, state_doc, chunk)
        S_in = hand_off(lax.all_gather(end, axis), s, dv)
        return out[..., :dv] + jnp.einsum("thk,hkv->thv", out[..., dv:], S_in)

    seq = P(parallel.CONTEXT_AXIS)
    return parallel.context_shard_map(shard, (seq,) * 6, seq)(q, k, v, g, beta, doc)


def incoming_document(doc):
    """Inside the shard_map: the document of the state entering this shard, that of the
    previous shard's last token (none on the first shard)."""
    return parallel.previous_shard_rows(doc, 1, _NO_DOCUMENT)[0]


def hand_off(maps, s, dv):
    """The state entering shard s: maps [C, H, dk, dv + dk] holds each shard's end state
    as [B | A] (end = A S_in + B); the shards before s applied in order to a zero state."""

    def apply(j, S):
        nxt = maps[j, ..., dv:] @ S + maps[j, ..., :dv]
        return jnp.where(j < s, nxt, S)

    H, dk = maps.shape[1:3]
    return lax.fori_loop(0, maps.shape[0], apply, jnp.zeros((H, dk, dv), _F32))
