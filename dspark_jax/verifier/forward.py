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

import jax
import jax.numpy as jnp

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
from dspark_jax.verifier.config import VerifierConfig

_F32 = jnp.float32
Params = dict[str, jax.Array]


def _norm(cfg: VerifierConfig, x: jax.Array, w: jax.Array) -> jax.Array:
    """fp32 in, fp32 out: Llama-style ``w * normed`` or Gemma's ``normed * (1 + w)``."""
    if cfg.gemma_norms:
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


def _mlp(cfg: VerifierConfig, params: Params, p: str, x: jax.Array) -> jax.Array:
    gate = _act(cfg, _linear(params, p + "gate_proj", x))
    return _linear(params, p + "down_proj", gate * _linear(params, p + "up_proj", x))


def _moe(cfg: VerifierConfig, params: Params, p: str, x: jax.Array) -> jax.Array:
    """Qwen3-MoE sparse block: softmax router (fp32), top-k, optional renormalisation;
    tokens sorted by expert and run through ``lax.ragged_dot`` (each token visits only
    its k experts)."""
    T, k, E = x.shape[0], cfg.num_experts_per_tok, cfg.num_experts
    logits = _linear(params, p + "gate", x)  # [T, E]
    probs = jax.nn.softmax(logits, axis=-1)
    top_w, top_i = jax.lax.top_k(probs, k)
    if cfg.norm_topk_prob:
        top_w = top_w / top_w.sum(-1, keepdims=True)
    flat_e = top_i.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    tok = order // k
    sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    gate_up = params[p + "experts.gate_up_proj"]  # [E, 2I, H]
    down = params[p + "experts.down_proj"]  # [E, H, I]
    cd = gate_up.dtype
    xs = x[tok].astype(cd)
    gu = jax.lax.ragged_dot(xs, jnp.swapaxes(gate_up, 1, 2), sizes, preferred_element_type=_F32)
    g, u = jnp.split(gu, 2, axis=-1)
    hidden = (_act(cfg, g) * u).astype(cd)
    y = jax.lax.ragged_dot(hidden, jnp.swapaxes(down, 1, 2), sizes, preferred_element_type=_F32)
    y = y * top_w.reshape(-1)[order][:, None]
    return jnp.zeros((T, x.shape[1]), _F32).at[tok].add(y)


def rope_for_row(cfg: VerifierConfig, position_ids: jax.Array, document_ids: jax.Array):
    """cos/sin [S, D] fp32 per rope kind; each token's frequencies use its document's length
    (transformers' dynamic/longrope update sees one document: max position + 1)."""
    # length of a token's document = its last token's position id + 1
    doc_len = position_ids[_document_last_index(document_ids)] + 1
    out = {}
    for kind, view in cfg.ropes:
        tables = rope_tables(view)
        inv = jax.vmap(lambda n, t=tables: rope_frequencies(t, n))(doc_len)  # [S, D/2]
        freqs = position_ids.astype(_F32)[:, None] * inv
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


def _attention(cfg, params, p, layer, x, rope, document_ids, dense, q_block, kv_chunk):
    S, d = x.shape[0], cfg.head_dim
    q = _linear(params, p + "q_proj", x).reshape(S, cfg.num_attention_heads, d)
    k = _linear(params, p + "k_proj", x).reshape(S, cfg.num_key_value_heads, d)
    v = _linear(params, p + "v_proj", x).reshape(S, cfg.num_key_value_heads, d)
    if cfg.qk_norm:
        q = _norm(cfg, q, params[p + "q_norm.weight"])
        k = _norm(cfg, k, params[p + "k_norm.weight"])
    cos, sin = rope
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cd = params[p + "q_proj.weight"].dtype
    kwargs = dict(
        scale=cfg.query_scale,
        sliding_window=cfg.layer_windows[layer],
        softcap=cfg.attn_softcap,
    )
    q, k, v = q.astype(cd), k.astype(cd), v.astype(cd)
    if dense:
        out = dense_document_causal_attention(q, k, v, document_ids, **kwargs)
    else:
        out = document_causal_attention(
            q, k, v, document_ids, q_block=q_block, kv_chunk=kv_chunk, **kwargs
        )
    return _linear(params, p + "o_proj", out.reshape(S, -1))


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
) -> jax.Array:
    """One packed row -> [S, len(layer_ids), Ht] in ``out_dtype`` (default: the params').

    input_ids, position_ids (restarting at 0 per document), document_ids (-1 = padding)
    are [S] ints; layer_ids ascending in [0, N] (see :meth:`VerifierConfig.check_layer_ids`).
    Layers above the largest id are not run. ``dense_attention``: the [S, S] oracle (tests).
    """
    layer_ids = tuple(layer_ids)
    if list(layer_ids) != sorted(set(layer_ids)):
        raise ValueError(f"layer_ids {layer_ids} must be ascending and unique")
    cfg.check_layer_ids(layer_ids, "layer_ids")
    input_ids, position_ids, document_ids = map(
        jnp.asarray, (input_ids, position_ids, document_ids)
    )
    embed = params["embed_tokens.weight"]
    out_dtype = embed.dtype if out_dtype is None else out_dtype
    x = embed[input_ids].astype(_F32)
    if cfg.embed_scale is not None:  # transformers scales in the weights' dtype
        x = x * jnp.asarray(cfg.embed_scale, embed.dtype).astype(_F32)
    ropes = rope_for_row(cfg, position_ids, document_ids)
    captured = [x] if 0 in layer_ids else []
    for i in range(max(layer_ids)):
        p = f"layers.{i}."
        h = _norm(cfg, x, params[p + "input_layernorm.weight"])
        h = _attention(
            cfg,
            params,
            p + "self_attn.",
            i,
            h,
            ropes[cfg.layer_rope[i]],
            document_ids,
            dense_attention,
            q_block,
            kv_chunk,
        )
        if cfg.gemma_norms:
            x = x + _norm(cfg, h, params[p + "post_attention_layernorm.weight"])
            h = _norm(cfg, x, params[p + "pre_feedforward_layernorm.weight"])
        else:
            x = x + h
            h = _norm(cfg, x, params[p + "post_attention_layernorm.weight"])
        h = _moe(cfg, params, p + "mlp.", h) if cfg.is_moe(i) else _mlp(cfg, params, p + "mlp.", h)
        if cfg.gemma_norms:
            h = _norm(cfg, h, params[p + "post_feedforward_layernorm.weight"])
        x = x + h
        if i + 1 in layer_ids:
            captured.append(x)
    return jnp.stack(captured, axis=1).astype(out_dtype)


def batch_hidden_states(params: Params, cfg: VerifierConfig, batch: dict, layer_ids, **kw):
    """Rows of a batch ([B, S] ``input_ids``, ``position_ids``, ``document_ids``) ->
    [B, S, n, Ht], with no gradient to the (frozen) parameters.

    Rows are vmapped (they stay sharded over the mesh's batch axes), except with experts:
    ``lax.ragged_dot`` has no batching rule for per-row group sizes, so MoE verifiers run
    their rows one after the other (``lax.map``)."""
    params = jax.lax.stop_gradient(params)
    rows = (batch["input_ids"], batch["position_ids"], batch["document_ids"])
    if cfg.num_experts:
        return jax.lax.map(lambda r: hidden_states(params, cfg, *r, layer_ids, **kw), rows)
    return jax.vmap(lambda *r: hidden_states(params, cfg, *r, layer_ids, **kw))(*rows)
