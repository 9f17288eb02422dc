"""Round-off bounds of the verifier forward (tests/numerics.py's backward-error model).

For slot (t, j) and a fixed vector c, L = <c, h[t, j]>. Each fp32 evaluation of the
forward equals the exact forward of parameters perturbed by <= depth_j * U relatively,
depth_j the longest chain of roundings up to layer id j, so two evaluations differ by at
most 2 * depth_j * U * sum_p |dL/dp| |p| (first order).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.verifier import hidden_states


def chain_depth(cfg, layer_id: int, seq: int, chunk: int = 64) -> int:
    """Longest rounding chain up to layer id ``layer_id`` (fp32 roundings; each
    transcendental, rsqrt, exp, tanh, cos/sin, silu/gelu, counted as 4)."""
    h, d = cfg.hidden_size, cfg.head_dim
    if cfg.mla:  # q: q_a (h), its norm and q_b (q_lora); kv: kv_a (h), its norm and kv_b
        q = cfg.q_lora_rank or 0
        attn = h + 2 * q + h + 2 * cfg.kv_lora_rank + cfg.qk_head_dim + seq + seq
        attn += cfg.num_attention_heads * cfg.v_head_dim + 4  # o_proj; the rope's cos/sin
    else:
        attn = h + d + seq + seq + cfg.num_attention_heads * d
    if cfg.linear_heads:  # the forget gate's projection(s), softplus (exp, log) and rate
        dk = cfg.linear_k_dim
        gate = h + dk + 1 + 12
        # q/k/v: projection, convolution, SiLU, l2 norm; the state's chain over the
        # document (per token a decay (exp), S^T k, the write) or, chunked, the chunk's
        # triangular solve and decays; the gated norm and o_proj
        kda = max(gate, h + cfg.linear_conv + 4 + dk + 4) + 4 + seq * (dk + 12)
        kda += min(chunk, seq) * (dk + 8) + dk + 4 + 4 + cfg.linear_heads * cfg.linear_v_dim
    rest = h + h + h + cfg.intermediate_size + (2 * h if cfg.gemma_norms else 0)
    rest += (d if cfg.qk_norm else 0) + 4 * 6
    if cfg.num_experts:
        rest += h + cfg.num_experts + 2 * cfg.num_experts_per_tok + cfg.moe_intermediate_size
        rest += cfg.shared_width + 4 + (h + 4 if cfg.shared_expert_gate else 0)  # shared
    if cfg.attn_output_gate:  # the gate's sigmoid and product
        attn += 4 + 1
    return 8 + sum(rest + (attn if cfg.mixer(i) == "attention" else kda) for i in range(layer_id))


def projection_sensitivity(params, cfg, ids, pos, doc, layer_ids, c) -> np.ndarray:
    """sum_p |dL_tj/dp| |p| for every slot (t, j) of the row, [S, len(layer_ids)] float64;
    L_tj = <c[t, j], h[t, j]>. Gradients of our forward with the dense oracle attention
    (differentiable), one compile per config, layer ids and shapes (rows are arguments:
    the rows of a batch share it)."""
    ids, pos, doc = map(jnp.asarray, (ids, pos, doc))
    out = _sensitivity(params, cfg, ids, pos, doc, tuple(layer_ids), jnp.asarray(c, jnp.float32))
    return np.asarray(out, np.float64)


@functools.partial(jax.jit, static_argnums=(1, 5))
def _sensitivity(params, cfg, ids, pos, doc, layer_ids, c):
    S, n = ids.shape[0], len(layer_ids)

    def proj(p, t, j):
        h = hidden_states(p, cfg, ids, pos, doc, layer_ids, dense_attention=True)
        return jnp.vdot(c[t, j], h[t, j])

    def sens(t, j):
        g = jax.grad(proj)(params, t, j)
        return sum(jnp.sum(jnp.abs(g[k]) * jnp.abs(params[k])) for k in params)

    tj = np.stack(np.meshgrid(np.arange(S), np.arange(n), indexing="ij"), -1).reshape(-1, 2)
    # lax.map, not vmap: lax.ragged_dot (Qwen3-MoE experts) cannot batch its weights
    out = jax.lax.map(lambda a: sens(*a), (jnp.asarray(tj[:, 0]), jnp.asarray(tj[:, 1])))
    return out.reshape(S, n)


def pack_documents(prefixes, length):
    """Sequences as the documents of one row padded to ``length``: ids, positions
    (restarting per document), document ids (-1 on padding) and each document's end."""
    ends = np.cumsum([len(x) for x in prefixes])
    seq = np.zeros(length, np.int32)
    seq[: ends[-1]] = np.concatenate(prefixes)
    pos = np.zeros(length, np.int32)
    docs = np.full(length, -1, np.int32)
    for i, (x, e) in enumerate(zip(prefixes, ends, strict=True)):
        pos[e - len(x) : e] = np.arange(len(x))
        docs[e - len(x) : e] = i
    return seq, pos, docs, ends
