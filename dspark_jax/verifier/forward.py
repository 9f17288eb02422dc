"""The frozen verifier's forward over one packed row, capturing hidden states.

Layer id k is the residual stream after k decoder layers: 0 is the (Gemma: scaled)
embedding, N the last layer's output before the final norm (docs/formats.md, "Layer
ids"). :func:`hidden_states` returns the requested ids stacked ``[S, n, Ht]``, ascending,
the layout of ``hs_{i}.safetensors``; rows are mapped with ``jax.vmap``.

Numerics (docs/design.md, "In-step verifier"): the residual stream, norms, RoPE, softmax
and router are fp32; matmul operands are in the parameters' dtype (bf16 by default) with
fp32 accumulation. With fp32 parameters this is transformers' fp32 forward up to
accumulation order; the captured states are rounded once to ``out_dtype``, as
``launch.extract_hidden_states --compute-dtype float32`` rounds its fp32 forward.

Documents of a packed row never see each other and their positions restart at 0, so
each document's states are those of its own forward; RoPE types whose frequencies depend
on the sequence length (dynamic, longrope) use each document's own length.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import dspark_jax.verifier.delta_rule as delta_rule
import dspark_jax.verifier.experts as experts
from dspark_jax import parallel
from dspark_jax.model.attention import anchored_block_attention
from dspark_jax.model.layers import (
    apply_rope,
    gemma_rms_norm,
    rms_norm,
    rope_frequencies,
    rope_tables,
)
from dspark_jax.verifier.attention import (
    dense_document_causal_attention,
    document_causal_attention,
)
from dspark_jax.verifier.config import LayerKind, VerifierConfig

_F32 = jnp.float32
Params = dict[str, jax.Array]


def _norm(cfg: VerifierConfig, x: jax.Array, w: jax.Array) -> jax.Array:
    """fp32 in, fp32 out: Llama-style ``w * normed`` or Gemma's (and Qwen3-Next's)
    ``normed * (1 + w)``."""
    if cfg.gemma_norms or cfg.zero_centred_norms:
        return gemma_rms_norm(x, w, cfg.rms_norm_eps)
    return rms_norm(x, w.astype(_F32), cfg.rms_norm_eps)


def _linear(params: Params, name: str, x: jax.Array) -> jax.Array:
    """x [..., in] @ W[out, in]^T (+ b) -> fp32; operands in W's dtype."""
    w = params[name + ".weight"]
    y = jnp.einsum("...i,oi->...o", x.astype(w.dtype), w, preferred_element_type=_F32)
    b = params.get(name + ".bias")
    return y if b is None else y + b.astype(_F32)


def _act(cfg: VerifierConfig, x: jax.Array) -> jax.Array:
    if cfg.hidden_act == "gelu_pytorch_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.silu(x)


def _glu(cfg: VerifierConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    """act(gate) * up, or Kimi-K3's SITU (sglang-jax's ``situ_and_mul``): beta tanh(gate /
    beta) sigmoid(gate) times up, the up soft-clipped to linear_beta tanh(up / linear_beta)
    when set (fp32)."""
    if cfg.situ is None:
        return _act(cfg, gate) * up
    beta, linear = cfg.situ
    if linear is not None:
        up = linear * jnp.tanh(up / linear)
    return beta * jnp.tanh(gate / beta) * jax.nn.sigmoid(gate) * up


def _mlp(cfg: VerifierConfig, params: Params, p: str, x: jax.Array) -> jax.Array:
    up = _linear(params, p + "up_proj", x)
    return _linear(params, p + "down_proj", _glu(cfg, _linear(params, p + "gate_proj", x), up))


def _route(cfg: VerifierConfig, params: Params, p: str, x: jax.Array):
    """Each token's k experts and their weights, [T, k] each (fp32 scores)."""
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    if cfg.router == "topk_softmax":  # gpt-oss: the k best biased logits, softmaxed
        top_v, top_i = jax.lax.top_k(_linear(params, p + "router", x), k)
        return jax.nn.softmax(top_v, axis=-1), top_i
    if cfg.router == "softmax":  # Qwen3-MoE
        probs = jax.nn.softmax(_linear(params, p + "gate", x), axis=-1)  # [T, E]
        top_w, top_i = jax.lax.top_k(probs, k)
        if cfg.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdims=True)
        return top_w, top_i
    # DeepSeek-V3 (transformers' DeepseekV3TopkRouter): fp32 logits, sigmoid scores; the
    # biased scores choose, within the topk_group groups whose two best biased scores sum
    # highest; the chosen raw scores weigh.
    w = params[p + "gate.weight"].astype(_F32)
    scores = jax.nn.sigmoid(jnp.einsum("th,eh->te", x.astype(_F32), w))
    choice = scores + params[p + "gate.e_score_correction_bias"].astype(_F32)
    groups = choice.reshape(-1, cfg.n_group, E // cfg.n_group)
    group_score = jax.lax.top_k(groups, 2)[0].sum(-1)  # [T, n_group]
    _, best = jax.lax.top_k(group_score, cfg.topk_group)
    keep = jnp.zeros_like(group_score, bool).at[jnp.arange(len(x))[:, None], best].set(True)
    choice = jnp.where(jnp.repeat(keep, E // cfg.n_group, axis=-1), choice, -jnp.inf)
    _, top_i = jax.lax.top_k(choice, k)
    top_w = jnp.take_along_axis(scores, top_i, axis=-1)
    if cfg.norm_topk_prob:
        top_w = top_w / (top_w.sum(-1, keepdims=True) + 1e-20)
    return top_w * cfg.routed_scaling_factor, top_i


def _expert_ffn(cfg: VerifierConfig, weights: Params, xs, sizes, expert) -> jax.Array:
    """The experts' SwiGLU on copies xs [R, H] sorted by expert (``sizes`` [E] per
    expert, ``expert`` [R] each row's) -> [R, H] fp32, through ``lax.ragged_dot``."""
    gate_up = weights["gate_up_proj"]  # [E, 2I, H]; gpt-oss [E, H, 2I]
    down = weights["down_proj"]  # [E, H, I]; gpt-oss [E, I, H]
    cd = gate_up.dtype
    xs = xs.astype(cd)
    if cfg.swiglu_limit is None:
        gu = jax.lax.ragged_dot(xs, jnp.swapaxes(gate_up, 1, 2), sizes, preferred_element_type=_F32)
        g, u = jnp.split(gu, 2, axis=-1)
        hidden = _glu(cfg, g, u).astype(cd)
        return jax.lax.ragged_dot(
            hidden, jnp.swapaxes(down, 1, 2), sizes, preferred_element_type=_F32
        )
    # gpt-oss: [in, out] layout, biases, gate and up interleaved, the clamped SwiGLU
    gu = jax.lax.ragged_dot(xs, gate_up, sizes, preferred_element_type=_F32)
    gu = gu + weights["gate_up_proj_bias"].astype(_F32)[expert]
    lim = cfg.swiglu_limit
    g, u = jnp.minimum(gu[:, 0::2], lim), jnp.clip(gu[:, 1::2], -lim, lim)
    hidden = ((u + 1) * g * jax.nn.sigmoid(cfg.swiglu_alpha * g)).astype(cd)
    y = jax.lax.ragged_dot(hidden, down, sizes, preferred_element_type=_F32)
    return y + weights["down_proj_bias"].astype(_F32)[expert]


def _moe(cfg: VerifierConfig, params: Params, p: str, x: jax.Array) -> jax.Array:
    """Sparse block: the router's top-k (:func:`_route`), each token's copies run by its k
    experts (experts.dispatch: sorted by expert through ``lax.ragged_dot``, expert
    parallel when the mesh splits the experts); DeepSeek's shared experts added (a dense
    MLP every token runs)."""
    top_w, top_i = _route(cfg, params, p, x)
    ex = p + "experts."
    weights = {n[len(ex) :]: w for n, w in params.items() if n.startswith(ex)}
    # Kimi-K3: the routed experts run in a latent (down, experts, norm, up); the router
    # and the shared experts read the full hidden state
    routed_in = x if cfg.latent_moe is None else _linear(params, p + "routed_expert_down_proj", x)
    out = experts.dispatch(
        routed_in, top_w, top_i, weights,
        compute=functools.partial(_expert_ffn, cfg), num_experts=cfg.num_experts,
    )  # fmt: skip
    if cfg.latent_moe is not None:
        if cfg.latent_moe_norm:
            out = _norm(cfg, out, params[p + "routed_expert_norm.weight"])
        out = _linear(params, p + "routed_expert_up_proj", out)
    if cfg.shared_expert_gate:  # Qwen3-Next: one shared expert, gated per token
        gate = jax.nn.sigmoid(_linear(params, p + "shared_expert_gate", x))
        out = out + gate * _mlp(cfg, params, p + "shared_expert.", x)
    elif cfg.n_shared_experts:
        out = out + _mlp(cfg, params, p + "shared_experts.", x)
    return out


def rope_for_row(cfg: VerifierConfig, position_ids: jax.Array, document_ids: jax.Array):
    """cos/sin [S, D] fp32 per rope kind; each token's frequencies use its document's length
    (transformers' dynamic/longrope update sees one document: max position + 1)."""
    # length of a token's document = its last token's position id + 1
    return rope_at(cfg, position_ids, document_lengths(position_ids, document_ids))


def document_lengths(position_ids: jax.Array, document_ids: jax.Array) -> jax.Array:
    """[S] int: the length of each token's document (its last position id + 1)."""
    return position_ids[_document_last_index(document_ids)] + 1


def rope_at(cfg: VerifierConfig, positions: jax.Array, doc_len: jax.Array):
    """cos/sin [T, D] fp32 per rope kind for positions [T] of documents of lengths [T]."""
    out = {}
    for kind, view in cfg.ropes:
        tables = rope_tables(view)
        inv = jax.vmap(lambda n, t=tables: rope_frequencies(t, n))(doc_len)  # [T, D/2]
        freqs = positions.astype(_F32)[:, None] * inv
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        scale = jnp.asarray(tables.attention_scaling)
        out[kind] = (jnp.cos(emb) * scale, jnp.sin(emb) * scale)
    return out


def _document_last_index(document_ids: jax.Array) -> jax.Array:
    """Index of the last token of each token's document, [S] (contiguous documents)."""
    S = document_ids.shape[0]
    is_end = jnp.concatenate([document_ids[1:] != document_ids[:-1], jnp.ones(1, bool)])
    idx = jnp.where(is_end, jnp.arange(S), S)
    return jnp.flip(jax.lax.cummin(jnp.flip(idx)))


def _deinterleave(x: jax.Array) -> jax.Array:
    """DeepSeek's interleaved rotary pairs (x0, x1), (x2, x3) ... as rotate-half halves
    (evens, odds): transformers' ``apply_rotary_pos_emb_interleave`` is rotate-half RoPE
    on this layout."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


# transformers 5.19 builds the q and kv latents' norms without the config's rms_norm_eps
# (DeepseekV3RMSNorm's default); vLLM passes it. The released DeepSeek-V3 and Kimi-K2
# configs say 1e-6, where the two agree.
MLA_LATENT_NORM_EPS = 1e-6


def _latent_norm(x: jax.Array, w: jax.Array) -> jax.Array:
    return rms_norm(x, w.astype(_F32), MLA_LATENT_NORM_EPS)


def _mla_qkv(cfg, params, p, x, rope):
    """Multi-head latent attention (transformers' DeepseekV3Attention): q [T, Nh, nope +
    rope], k [T, Nh, nope + rope] (its rotary part one per token, shared by the heads),
    v [T, Nh, v_head_dim], in the projection weights' dtype."""
    T, nh = x.shape[0], cfg.num_attention_heads
    nope, r, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is None:
        q = _linear(params, p + "q_proj", x)
    else:
        q = _latent_norm(_linear(params, p + "q_a_proj", x), params[p + "q_a_layernorm.weight"])
        q = _linear(params, p + "q_b_proj", q)
    q = q.reshape(T, nh, nope + r)
    kv = _linear(params, p + "kv_a_proj_with_mqa", x)  # [T, kv_lora + r]
    latent = _latent_norm(kv[:, : cfg.kv_lora_rank], params[p + "kv_a_layernorm.weight"])
    k_rot = kv[:, None, cfg.kv_lora_rank :]  # [T, 1, r]
    kvb = _linear(params, p + "kv_b_proj", latent).reshape(T, nh, nope + dv)
    k_nope, v = kvb[..., :nope], kvb[..., nope:]
    q_rot = q[..., nope:]
    if cfg.rope_interleave:
        q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
    if cfg.mla_rope:  # Kimi-Linear's MLA leaves the "rotary" part unrotated
        cos, sin = rope
        q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
    q = jnp.concatenate([q[..., :nope], q_rot], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, (T, nh, r))], axis=-1)
    cd = params[p + "kv_b_proj.weight"].dtype
    return q.astype(cd), k.astype(cd), v.astype(cd)


def _qkv(cfg, params, p, x, rope):
    """Projected, normed (qk_norm) and rotated q [T, Nh, D], k/v [T, Nkv, D], in the
    projection weights' dtype (the attention's matmul operands), and the output gate
    [T, Nh * D] fp32 (Qwen3-Next; else None)."""
    if cfg.mla:  # Kimi-K3's MLA: a sigmoid gate on its output, before o_proj
        gate = _linear(params, p + "g_proj", x) if cfg.mla_output_gate else None
        return (*_mla_qkv(cfg, params, p, x, rope), gate)
    T, d = x.shape[0], cfg.head_dim
    q = _linear(params, p + "q_proj", x)
    gate = None
    if cfg.attn_output_gate:  # per head: d query dims, then d gate dims
        q = q.reshape(T, cfg.num_attention_heads, 2 * d)
        q, gate = q[..., :d], q[..., d:].reshape(T, -1)
    q = q.reshape(T, cfg.num_attention_heads, d)
    k = _linear(params, p + "k_proj", x).reshape(T, cfg.num_key_value_heads, d)
    v = _linear(params, p + "v_proj", x).reshape(T, cfg.num_key_value_heads, d)
    if cfg.qk_norm:
        q = _norm(cfg, q, params[p + "q_norm.weight"])
        k = _norm(cfg, k, params[p + "k_norm.weight"])
    cos, sin = rope
    rd = cfg.rotary_dim or d  # GLM rotates the first rotary_dim dims of each head
    q, k = (
        apply_rope(x, cos, sin)
        if rd == d
        else jnp.concatenate([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], axis=-1)
        for x in (q, k)
    )
    cd = params[p + "q_proj.weight"].dtype
    return q.astype(cd), k.astype(cd), v.astype(cd), gate


def _causal_conv(x: jax.Array, w: jax.Array, document_ids: jax.Array) -> jax.Array:
    """Depthwise causal convolution, x [T, D] fp32, w [D, 1, K] (torch's Conv1d with
    groups=D and K-1 zeros in front): out[t] = sum_j w[:, j] x[t - K + 1 + j], the taps
    before a document's first token zero (its own forward's padding). Under a context
    split each shard reads the K - 1 tokens before its first from the previous shard."""
    K = w.shape[-1]
    doc = document_ids.astype(jnp.int32)
    if parallel.context_size() == 1 or K == 1:
        return _conv_rows(x, w, doc)

    def shard(x, w, doc):
        x_all = jnp.concatenate([parallel.previous_shard_rows(x, K - 1, 0.0), x])
        before = parallel.previous_shard_rows(doc, K - 1, jnp.iinfo(jnp.int32).min)
        return _conv_rows(x_all, w, jnp.concatenate([before, doc]))[K - 1 :]

    seq = P(parallel.CONTEXT_AXIS)
    return parallel.context_shard_map(shard, (seq, P(), seq), seq)(x, w, doc)


def _conv_rows(x, w, doc):
    K = w.shape[-1]
    w = w[:, 0, :].astype(_F32)
    out = x * w[:, K - 1]
    for s in range(1, K):
        earlier = jnp.pad(x, ((s, 0), (0, 0)))[: len(x)]
        docs = jnp.pad(doc, (s, 0), constant_values=jnp.iinfo(jnp.int32).min)
        out = out + jnp.where((docs[: len(x)] == doc)[:, None], earlier, 0.0) * w[:, K - 1 - s]
    return out


def _l2_normalize(x: jax.Array) -> jax.Array:
    """FLA's l2norm (transformers' Kimi ``l2norm``): x / sqrt(sum x^2 + 1e-6)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _kda(cfg, params, p, x, document_ids, dense: bool, chunk: int) -> jax.Array:
    """Kimi Delta Attention (transformers' KimiLinearDeltaAttention) over a packed row,
    x [T, H] fp32 -> [T, H] fp32: q, k, v through a causal convolution and SiLU, q and k
    l2-normalised per head; per-channel forget gates g = -exp(A_log) softplus(f(x) +
    dt_bias); write strengths beta = sigmoid(b(x)); the gated delta rule
    (verifier/delta_rule.py; ``dense``: its token-by-token form); a gated RMS norm
    (o_norm(o) * sigmoid(g(x))) and o_proj."""
    T, nh, d = x.shape[0], cfg.linear_heads, cfg.linear_v_dim
    q, k, v = (
        jax.nn.silu(_causal_conv(_linear(params, p + f"{n}_proj", x),
                                 params[p + f"{n}_conv1d.weight"], document_ids)).reshape(T, nh, d)
        for n in "qkv"
    )  # fmt: skip
    q, k = _l2_normalize(q), _l2_normalize(k)
    f = _linear(params, p + "f_b_proj", _linear(params, p + "f_a_proj", x))
    f = (f + params[p + "dt_bias"].astype(_F32)).reshape(T, nh, d)
    rate = jnp.exp(params[p + "A_log"].astype(_F32).reshape(nh, 1))
    g = -rate * jnp.where(f > 20.0, f, jnp.log1p(jnp.exp(jnp.minimum(f, 20.0))))  # softplus
    beta = jax.nn.sigmoid(_linear(params, p + "b_proj", x))
    rule = delta_rule.recurrent if dense else functools.partial(delta_rule.chunked, chunk=chunk)
    o = rule(q, k, v, g, beta, document_ids)
    if cfg.kda_full_rank_gate:  # Kimi-K3: one full-rank projection
        gate = _linear(params, p + "g_proj", x).reshape(T, nh, d)
    else:
        gate = _linear(params, p + "g_b_proj", _linear(params, p + "g_a_proj", x))
        gate = gate.reshape(T, nh, d)
    o = rms_norm(o, params[p + "o_norm.weight"].astype(_F32), cfg.rms_norm_eps)
    return _linear(params, p + "o_proj", (o * jax.nn.sigmoid(gate)).reshape(T, nh * d))


def _gdn(cfg, params, p, x, document_ids, dense: bool, chunk: int) -> jax.Array:
    """Qwen3-Next's Gated DeltaNet (transformers' Qwen3NextGatedDeltaNet), x [T, H] fp32 ->
    [T, H] fp32: q, k, v, z and b, a from two projections grouped per key head; [q; k; v]
    through the causal convolution and SiLU; q and k l2-normalised, each key head serving
    its group of value heads; one forget gate per value head, g = -exp(A_log) softplus(a +
    dt_bias), beta = sigmoid(b); the gated delta rule; RMS norm(o) * w * silu(z); out_proj."""
    T, nv, dv = x.shape[0], cfg.linear_heads, cfg.linear_v_dim
    nk, dk = cfg.linear_k_heads, cfg.linear_k_dim
    r = nv // nk
    qkvz = _linear(params, p + "in_proj_qkvz", x).reshape(T, nk, 2 * dk + 2 * r * dv)
    q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
    v, z = qkvz[..., 2 * dk : 2 * dk + r * dv], qkvz[..., 2 * dk + r * dv :]
    ba = _linear(params, p + "in_proj_ba", x).reshape(T, nk, 2 * r)
    b, a = ba[..., :r].reshape(T, nv), ba[..., r:].reshape(T, nv)
    mixed = jnp.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=-1)
    mixed = jax.nn.silu(_causal_conv(mixed, params[p + "conv1d.weight"], document_ids))
    q = jnp.repeat(mixed[:, : nk * dk].reshape(T, nk, dk), r, axis=1)
    k = jnp.repeat(mixed[:, nk * dk : 2 * nk * dk].reshape(T, nk, dk), r, axis=1)
    v = mixed[:, 2 * nk * dk :].reshape(T, nv, dv)
    q, k = _l2_normalize(q), _l2_normalize(k)
    a = a + params[p + "dt_bias"].astype(_F32)
    g = -jnp.exp(params[p + "A_log"].astype(_F32)) * jax.nn.softplus(a)  # [T, nv]
    g = jnp.broadcast_to(g[..., None], (T, nv, dk))
    rule = delta_rule.recurrent if dense else functools.partial(delta_rule.chunked, chunk=chunk)
    o = rule(q, k, v, g, jax.nn.sigmoid(b), document_ids)
    o = rms_norm(o, params[p + "norm.weight"].astype(_F32), cfg.rms_norm_eps)
    o = o * jax.nn.silu(z.reshape(T, nv, dv))
    return _linear(params, p + "out_proj", o.reshape(T, nv * dv))


def _attention_options(cfg: VerifierConfig, kind: LayerKind, params=None, p="") -> dict:
    sinks = params[p + "sinks"] if cfg.attn_sinks else None
    return dict(
        scale=cfg.query_scale, sliding_window=kind.window, softcap=cfg.attn_softcap, sinks=sinks
    )


def _attention(cfg, params, p, kind, x, rope, document_ids, dense, q_block, kv_chunk):
    S = x.shape[0]
    q, k, v, gate = _qkv(cfg, params, p, x, rope)
    kwargs = _attention_options(cfg, kind, params, p)
    if dense:
        out = dense_document_causal_attention(q, k, v, document_ids, **kwargs)
    else:
        out = document_causal_attention(
            q, k, v, document_ids, q_block=q_block, kv_chunk=kv_chunk, **kwargs
        )
    out = out.reshape(S, -1)
    if gate is not None:
        out = out.astype(_F32) * jax.nn.sigmoid(gate)
    return _linear(params, p + "o_proj", out)


def _layer(cfg: VerifierConfig, kind: LayerKind, lp: Params, x, ropes, doc, opts):
    """One decoder layer; ``lp`` holds its parameters by their name within the layer
    (``self_attn.q_proj.weight``); x [S, H] fp32 -> [S, H] fp32 (with attention
    residuals, the pair (partial sum [S, H], completed blocks [S, n, H]): _attn_res_layer)."""
    if cfg.attn_res_block is not None:
        return _attn_res_layer(cfg, kind, lp, x, ropes, doc, opts)
    h = _mixer(cfg, kind, lp, _norm(cfg, x, lp["input_layernorm.weight"]), ropes, doc, opts)
    return _after_attention(cfg, kind, lp, x, h)


def _mixer(cfg: VerifierConfig, kind: LayerKind, lp: Params, h, ropes, doc, opts):
    """The layer's token mixer (attention, KDA, Gated DeltaNet) on its normed input h."""
    dense, q_block, kv_chunk, kda_chunk = opts
    if kind.mixer == "kda":
        h = _kda(cfg, lp, "self_attn.", h, doc, dense, kda_chunk)
    elif kind.mixer == "gdn":
        h = _gdn(cfg, lp, "linear_attn.", h, doc, dense, kda_chunk)
    else:
        h = _attention(cfg, lp, "self_attn.", kind, h, ropes[kind.rope], doc, dense, q_block,
                       kv_chunk)  # fmt: skip
    return h


def attn_res(cfg: VerifierConfig, params: Params, name: str, partial, blocks) -> jax.Array:
    """Kimi-K3's attention residual (sglang-jax's ``attention_residual_apply``): the
    completed blocks [S, n, H] and the partial sum [S, H] as n + 1 candidates, each scored
    by ``{name}_proj(RMSNorm(v))`` (hidden -> 1), softmaxed over the candidates; their
    weighted sum [S, H] (fp32 throughout)."""
    values = jnp.concatenate([blocks, partial[:, None]], axis=1)
    normed = _norm(cfg, values, params[name + "_norm.weight"])
    w = params[name + "_proj.weight"][0].astype(_F32)
    scores = jnp.einsum("snh,h->sn", normed, w, precision=jax.lax.Precision.HIGHEST)
    return jnp.sum(jax.nn.softmax(scores, axis=-1)[..., None] * values, axis=1)


def _attn_res_layer(cfg: VerifierConfig, kind: LayerKind, lp: Params, carry, ropes, doc, opts):
    """A Kimi-K3 layer (sglang-jax's ``KimiK3DecoderLayer`` AttnRes path). carry = (the
    partial sum of the current block, the completed blocks [S, n, H]; the embedding is the
    first). The attention reads the attention residual over them; at a block's first layer
    the partial sum becomes a completed block and the new block's sum starts from this
    layer's attention output; the MLP reads a second attention residual; the layer returns
    the partial sum plus the MLP's output."""
    partial, blocks = carry
    h = (
        partial
        if blocks.shape[1] == 0
        else attn_res(cfg, lp, "self_attention_res", partial, blocks)
    )
    if kind.block_start:
        blocks = jnp.concatenate([blocks, partial[:, None]], axis=1)
    a = _mixer(cfg, kind, lp, _norm(cfg, h, lp["input_layernorm.weight"]), ropes, doc, opts)
    partial = a if kind.block_start else partial + a
    h = _norm(
        cfg, attn_res(cfg, lp, "mlp_res", partial, blocks), lp["post_attention_layernorm.weight"]
    )
    h = _moe(cfg, lp, "mlp.", h) if kind.moe else _mlp(cfg, lp, "mlp.", h)
    return partial + h, blocks


def _after_attention(cfg: VerifierConfig, kind: LayerKind, lp: Params, x, h) -> jax.Array:
    """The layer's residual adds and MLP, given its attention output h [T, H]."""
    if cfg.gemma_norms:
        x = x + _norm(cfg, h, lp["post_attention_layernorm.weight"])
        h = _norm(cfg, x, lp["pre_feedforward_layernorm.weight"])
    else:
        x = x + h
        h = _norm(cfg, x, lp["post_attention_layernorm.weight"])
    h = _moe(cfg, lp, "mlp.", h) if kind.moe else _mlp(cfg, lp, "mlp.", h)
    if cfg.gemma_norms:
        h = _norm(cfg, h, lp["post_feedforward_layernorm.weight"])
    return x + h


class Block(NamedTuple):
    """Layers ``start .. start + period * repeats - 1`` run as ``repeats`` iterations of
    a ``lax.scan`` whose body is ``period`` consecutive layers."""

    start: int
    period: int
    repeats: int


def layer_blocks(kinds: Sequence[LayerKind], lo: int, hi: int) -> list[Block]:
    """Layers [lo, hi) as scanned blocks: greedily, the period (1 for a uniform model, 2
    for Gemma 2's sliding/global alternation, 6 for Gemma 3's 5:1) whose repetitions
    cover the most layers from the current one (the shortest on a tie); a layer that
    starts no repetition is a block of its own. Uniform and periodic layer patterns thus
    compile a constant number of layer bodies, whatever the depth."""
    blocks, s = [], lo
    while s < hi:
        best = Block(s, 1, 1)
        for p in range(1, (hi - s) // 2 + 1):
            r = 1
            while s + (r + 1) * p <= hi and kinds[s + r * p : s + (r + 1) * p] == kinds[s : s + p]:
                r += 1
            if r > 1 and p * r > best.period * best.repeats:
                best = Block(s, p, r)
        blocks.append(best)
        s += best.period * best.repeats
    return blocks


def _run_block(cfg: VerifierConfig, params: Params, block: Block, carry, layer_fn):
    """Scan the block's layers: iteration t runs layers start + t*period + o, o < period,
    each reading its slice of its kind's stack (dynamic index, no copy of the stack).
    ``layer_fn(kind, layer_params, carry) -> carry`` runs one layer."""
    stacks = cfg.layer_stacks
    where = {i: (j, layers.index(i)) for j, (_, layers) in enumerate(stacks) for i in layers}
    names = {j: [n for n in params if n.startswith(f"stacks.{j}.")] for j in range(len(stacks))}
    body_layers = []
    for o in range(block.period):
        i = block.start + o
        j, rank = where[i]
        # the next repetition's layer of this kind sits `stride` slices further in the stack
        stride = sum(where[block.start + u][0] == j for u in range(block.period))
        body_layers.append((cfg.kind(i), j, rank, stride))

    def body(carry, t):
        for kind, j, rank, stride in body_layers:
            at = rank + t * stride
            lp = {
                n.split(".", 2)[2]: jax.lax.dynamic_index_in_dim(params[n], at, 0, keepdims=False)
                for n in names[j]
            }
            carry = layer_fn(kind, lp, carry)
        return carry, None

    if block.repeats == 1:  # no loop: the carry may change shape (Kimi-K3's block starts)
        return body(carry, jnp.int32(0))[0]
    carry, _ = jax.lax.scan(body, carry, jnp.arange(block.repeats, dtype=jnp.int32))
    return carry


def _embed(cfg: VerifierConfig, params: Params, ids: jax.Array) -> jax.Array:
    embed = params["embed_tokens.weight"]
    x = embed[ids].astype(_F32)
    if cfg.embed_scale is not None:  # transformers scales in the weights' dtype
        x = x * jnp.asarray(cfg.embed_scale, embed.dtype).astype(_F32)
    return x


def hidden_states(
    params: Params,
    cfg: VerifierConfig,
    input_ids: jax.Array,
    position_ids: jax.Array,
    document_ids: jax.Array,
    layer_ids: tuple[int, ...],
    *,
    out_dtype=None,
    dense_attention: bool = False,
    q_block: int = 128,
    kv_chunk: int = 512,
    kda_chunk: int = 64,
) -> jax.Array:
    """One packed row -> [S, len(layer_ids), Ht] in ``out_dtype`` (default: the params').

    input_ids, position_ids (restarting at 0 per document), document_ids (-1 = padding)
    are [S] ints; layer_ids ascending in [0, N] (see :meth:`VerifierConfig.check_layer_ids`).
    Layers above the largest id are not run. ``dense_attention``: the [S, S] oracle (tests),
    and KDA's token-by-token recurrence; ``kda_chunk``: KDA's chunk length.

    The layers between two captured ids run as :func:`layer_blocks`: one ``lax.scan``
    per block over the stacked weights (weights.py), so the compiled program holds a
    few layer bodies, not one per layer; each layer's arithmetic is unchanged.
    """
    layer_ids = tuple(layer_ids)
    if list(layer_ids) != sorted(set(layer_ids)):
        raise ValueError(f"layer_ids {layer_ids} must be ascending and unique")
    cfg.check_layer_ids(layer_ids, "layer_ids")
    input_ids, position_ids, document_ids = map(
        jnp.asarray, (input_ids, position_ids, document_ids)
    )
    out_dtype = params["embed_tokens.weight"].dtype if out_dtype is None else out_dtype
    x = parallel.constrain_tokens(_embed(cfg, params, input_ids))
    ropes = rope_for_row(cfg, position_ids, document_ids)
    opts = (dense_attention, q_block, kv_chunk, kda_chunk)
    kinds = [cfg.kind(i) for i in range(cfg.num_hidden_layers)]
    captured = [x] if 0 in layer_ids else []

    def layer_fn(kind, lp, carry):
        # Under a context split every per-token array stays split (the attention gathers
        # only keys and values): docs/design.md, "In-step verifier under a context split".
        out = _layer(cfg, kind, lp, carry, ropes, document_ids, opts)
        return jax.tree.map(parallel.constrain_tokens, out)

    # Kimi-K3: the carry is (partial sum, completed blocks); the blocks grow at each
    # block's first layer, so scans stop there (a scan's carry keeps its shape). Layer id
    # k is the partial sum after k layers; id N what the final norm reads, the last
    # attention residual over the blocks.
    res = cfg.attn_res_block is not None
    carry = (x, jnp.zeros((x.shape[0], 0, x.shape[1]), _F32)) if res else x
    ends = set(layer_ids) - {0}
    if res:
        ends |= {i for i in range(1, max(ends, default=0)) if kinds[i].block_start}
    lo = 0
    for hi in sorted(ends):
        for block in layer_blocks(kinds, lo, hi):
            carry = _run_block(cfg, params, block, carry, layer_fn)
        if hi in layer_ids:
            if not res:
                captured.append(carry)
            elif hi < cfg.num_hidden_layers:
                captured.append(carry[0])
            else:
                captured.append(attn_res(cfg, params, "output_attn_res", *carry))
        lo = hi
    return jnp.stack(captured, axis=1).astype(out_dtype)


def batch_hidden_states(params: Params, cfg: VerifierConfig, batch: dict, layer_ids, **kw):
    """Rows of a batch ([B, S] ``input_ids``, ``position_ids``, ``document_ids``) ->
    [B, S, n, Ht], with no gradient to the (frozen) parameters.

    Rows are vmapped (they stay sharded over the mesh's batch axes), except with experts:
    MoE verifiers run their rows one after the other (``lax.map``), each row's tokens
    split over the mesh by the expert exchange (experts.dispatch). Vmapped rows (which
    experts.dispatch supports) hang Kimi-Linear's training step on 8 simulated CPU
    devices at fsdp=4 x tensor=2, with or without the exchange: not yet diagnosed."""
    params = jax.lax.stop_gradient(params)
    rows = (batch["input_ids"], batch["position_ids"], batch["document_ids"])
    if cfg.num_experts:
        return jax.lax.map(lambda r: hidden_states(params, cfg, *r, layer_ids, **kw), rows)
    return jax.vmap(
        lambda *r: hidden_states(params, cfg, *r, layer_ids, **kw),
        # the attention's shard_map takes its rows
        spmd_axis_name=parallel.row_vmap_axes(rows[0].shape[0]),
    )(*rows)


def drafted_blocks_supported(cfg: VerifierConfig) -> str | None:
    """Why :func:`drafted_hidden` cannot run this verifier, or None. Its block pass uses the
    drafter's anchored-block attention, which has neither sliding windows, soft caps nor a
    query scale other than head_dim**-0.5."""
    if set(cfg.layer_mixers) - {"attention"}:
        return "linear-attention (KDA, Gated DeltaNet) layers"
    if cfg.attn_res_block is not None:
        return "attention residuals (Kimi-K3)"
    if cfg.attn_output_gate:
        return "gated attention outputs"
    if cfg.attn_sinks:
        return "attention sinks"
    if cfg.mla:
        return "multi-head latent attention"
    if any(w is not None for w in cfg.layer_windows):
        return "sliding-window attention layers"
    if cfg.attn_softcap is not None:
        return "soft-capped attention scores"
    if cfg.query_scale != cfg.head_dim**-0.5:
        return f"query scale {cfg.query_scale} (not head_dim**-0.5)"
    return None


def drafted_hidden(
    params: Params,
    cfg: VerifierConfig,
    input_ids: jax.Array,
    position_ids: jax.Array,
    document_ids: jax.Array,
    anchors: jax.Array,
    block_tokens: jax.Array,
    *,
    q_block: int = 128,
    kv_chunk: int = 512,
) -> jax.Array:
    """The verifier's layer-N residual (before its final norm), fp32 [A, Bk, Ht], at drafted
    blocks: ``block_tokens[a, j]`` (verifier ids, [A, Bk]) sits at row index
    ``anchors[a] + j``, position ``position_ids[anchors[a]] + j`` of the anchor's document, and
    its prefix is that document's tokens before ``anchors[a]`` followed by
    ``block_tokens[a, :j + 1]`` (Draft-OPD's targets on the drafter's own tokens).

    The row runs through every layer beside the blocks, for its keys and values: block slot
    j of a layer attends to the row's keys before the anchor in its document and to its
    block's keys up to j (``anchored_block_attention``, causal in the block), so nothing of
    [A * Bk, S] is built. Same numerics as :func:`hidden_states`. No gradient.
    """
    why = drafted_blocks_supported(cfg)
    if why is not None:
        raise ValueError(f"drafted_hidden: the verifier has {why}")
    params = jax.lax.stop_gradient(params)
    num, bk = block_tokens.shape
    x = _embed(cfg, params, input_ids)
    xb = _embed(cfg, params, block_tokens.reshape(-1))
    doc_len = document_lengths(position_ids, document_ids)
    ropes = rope_at(cfg, position_ids, doc_len)
    block_pos = (position_ids[anchors][:, None] + jnp.arange(bk, dtype=position_ids.dtype)).reshape(
        -1
    )
    ropes_b = rope_at(cfg, block_pos, jnp.repeat(doc_len[anchors], bk))

    def layer_fn(kind, lp, carry):
        x, xb = carry
        p = "self_attn."
        h = _norm(cfg, x, lp["input_layernorm.weight"])
        hb = _norm(cfg, xb, lp["input_layernorm.weight"])
        q, k, v, _ = _qkv(cfg, lp, p, h, ropes[kind.rope])  # no output gate (supported())
        o = document_causal_attention(
            q, k, v, document_ids, q_block=q_block, kv_chunk=kv_chunk,
            **_attention_options(cfg, kind),
        )  # fmt: skip
        x = _after_attention(cfg, kind, lp, x, _linear(lp, p + "o_proj", o.reshape(len(x), -1)))
        qb, kb, vb, _ = _qkv(cfg, lp, p, hb, ropes_b[kind.rope])
        ob = anchored_block_attention(
            qb, k, v, kb, vb, anchors, document_ids,
            block_size=bk, sliding_window=None, causal_in_block=True, kv_chunk=kv_chunk,
        )  # fmt: skip
        ob = _linear(lp, p + "o_proj", ob.reshape(num * bk, -1))
        return x, _after_attention(cfg, kind, lp, xb, ob)

    kinds = [cfg.kind(i) for i in range(cfg.num_hidden_layers)]
    carry = (x, xb)
    for block in layer_blocks(kinds, 0, cfg.num_hidden_layers):
        carry = _run_block(cfg, params, block, carry, layer_fn)
    return carry[1].reshape(num, bk, -1)
