"""Qwen3 building blocks of the draft decoder: RMSNorm, RoPE, SwiGLU MLP, and the
decoder layer whose attention injects the verifier context as extra keys/values.

Parameters are fp32 ("master") and cast to ``dtype`` (the compute dtype) at use;
the residual stream stays in fp32. Parameter names mirror speculators' keys
(``self_attn.q_proj.kernel`` <-> ``self_attn.q_proj.weight``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DSparkConfig
from dspark_jax.model.attention import anchored_block_attention

LINEAR_INIT = nnx.initializers.normal(0.02)  # HF initializer_range, as the reference


def partitioned(init, *axes: str | None):
    """An initializer annotated with logical axis names (mapped to mesh axes in parallel.py)."""
    return nnx.with_partitioning(init, axes)


def linear(
    in_features: int,
    out_features: int,
    axes: tuple[str | None, str | None],
    *,
    use_bias: bool,
    dtype,
    rngs: nnx.Rngs,
) -> nnx.Linear:
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=partitioned(LINEAR_INIT, *axes),
        bias_init=partitioned(nnx.initializers.zeros_init(), axes[1]),
        rngs=rngs,
    )


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3RMSNorm numerics: normalise in fp32, round to the input dtype, then scale."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, axis_name: str = "norm"):
        self.weight = nnx.Param(jnp.ones((size,), jnp.float32), out_sharding=(axis_name,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Default RoPE tables for integer positions [...] -> cos, sin [..., head_dim] (fp32)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x [N, heads, D], cos/sin [N, D]; tables cast to x's dtype like HF."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos.astype(x.dtype)[:, None, :]
    sin = sin.astype(x.dtype)[:, None, :]
    return x * cos + rotated * sin


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DSparkConfig, dtype, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = linear(h, i, ("embed", "mlp"), use_bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = linear(h, i, ("embed", "mlp"), use_bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = linear(i, h, ("mlp", "embed"), use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nnx.Module):
    """Block queries attend to [k(ctx) ; k(block)] under the anchored-block mask.

    The context is the projected verifier features; it skips input_layernorm, but
    k_norm applies to both halves of the keys (values have no norm), as in the
    reference's Qwen3DFlashAttention.
    """

    def __init__(self, cfg: DSparkConfig, layer: int, dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        bias = cfg.attention_bias
        self.q_proj = linear(h, nh * d, ("embed", "heads"), use_bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = linear(
            h, nkv * d, ("embed", "kv_heads"), use_bias=bias, dtype=dtype, rngs=rngs
        )
        self.v_proj = linear(
            h, nkv * d, ("embed", "kv_heads"), use_bias=bias, dtype=dtype, rngs=rngs
        )
        self.o_proj = linear(nh * d, h, ("heads", "embed"), use_bias=bias, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, d
        self.block_size = cfg.block_size
        self.sliding_window = cfg.layer_sliding_window(layer)
        self.causal_in_block = cfg.layer_causal_in_block(layer)

    def __call__(
        self,
        x: jax.Array,  # [Q, H] normed block hidden states
        ctx: jax.Array,  # [S, H] context features
        rope_blk: tuple[jax.Array, jax.Array],  # cos/sin [Q, D]
        rope_ctx: tuple[jax.Array, jax.Array],  # cos/sin [S, D]
        anchors: jax.Array,  # [A]
        document_ids: jax.Array,  # [S]
    ) -> jax.Array:
        d = self.head_dim
        q = self.q_norm(self.q_proj(x).reshape(x.shape[0], self.num_heads, d))
        k_blk = self.k_norm(self.k_proj(x).reshape(x.shape[0], self.num_kv_heads, d))
        v_blk = self.v_proj(x).reshape(x.shape[0], self.num_kv_heads, d)
        k_ctx = self.k_norm(self.k_proj(ctx).reshape(ctx.shape[0], self.num_kv_heads, d))
        v_ctx = self.v_proj(ctx).reshape(ctx.shape[0], self.num_kv_heads, d)
        q = apply_rope(q, *rope_blk)
        k_blk = apply_rope(k_blk, *rope_blk)
        k_ctx = apply_rope(k_ctx, *rope_ctx)
        out = anchored_block_attention(
            q,
            k_ctx,
            v_ctx,
            k_blk,
            v_blk,
            anchors,
            document_ids,
            block_size=self.block_size,
            sliding_window=self.sliding_window,
            causal_in_block=self.causal_in_block,
        )
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * d))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DSparkConfig, layer: int, dtype, rngs: nnx.Rngs):
        self.self_attn = Attention(cfg, layer, dtype, rngs)
        self.mlp = MLP(cfg, dtype, rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x, ctx, rope_blk, rope_ctx, anchors, document_ids) -> jax.Array:
        """x [Q, H] residual stream (fp32), ctx [S, H] -> [Q, H]."""
        h = self.input_layernorm(x)
        x = x + self.self_attn(h, ctx, rope_blk, rope_ctx, anchors, document_ids).astype(x.dtype)
        h = self.post_attention_layernorm(x)
        return x + self.mlp(h).astype(x.dtype)
