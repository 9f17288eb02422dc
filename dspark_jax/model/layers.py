"""Qwen3 building blocks of the draft decoder: RMSNorm, RoPE (every rope type the draft
layers carry), SwiGLU MLP, and the decoder layer whose attention injects the verifier
context as extra keys/values.

Parameters are fp32 ("master") and cast to ``dtype`` (the compute dtype) at use;
the residual stream stays in fp32. Parameter names mirror speculators' keys
(``self_attn.q_proj.kernel`` <-> ``self_attn.q_proj.weight``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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
    torch_init: bool = False,
) -> nnx.Linear:
    """A Linear with fp32 parameters: N(0, 0.02) weight and zero bias (the reference's
    ``post_init``), or, ``torch_init``, torch's ``nn.Linear`` own init for both."""
    if torch_init:
        kernel_init = bias_init = torch_default_init(in_features)
    else:
        kernel_init, bias_init = LINEAR_INIT, nnx.initializers.zeros_init()
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=partitioned(kernel_init, *axes),
        bias_init=partitioned(bias_init, axes[1]),
        rngs=rngs,
    )


def torch_default_init(fan_in: int):
    """torch ``nn.Linear``'s own init (kaiming-uniform, a=sqrt(5)) of its weight and its
    bias alike: U(+-1/sqrt(fan_in)). The reference's heads keep it: they are built after
    ``post_init`` (which gives the trunk N(0, 0.02) and zero biases)."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3RMSNorm numerics: normalise in fp32, round to the input dtype, then scale."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def gemma_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma3RMSNorm numerics: x * (1 + w), all in fp32, rounded to the input dtype once."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, axis_name: str = "norm"):
        self.weight = nnx.Param(jnp.ones((size,), jnp.float32), out_sharding=(axis_name,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class RopeTables(NamedTuple):
    """A drafter's RoPE as arrays, computed on the host by :func:`rope_tables`.

    Passed into a jitted step they let one compilation serve every rope type; by
    default the model embeds them as constants. A row whose largest position is
    ``n - 1`` (context and block positions together, as transformers'
    ``dynamic_rope_update`` sees them) uses ``inv_freq_long`` when ``n > long_from``
    (longrope) and dynamic-NTK frequencies when ``n > dynamic_from`` (dynamic).
    """

    inv_freq: np.ndarray  # [D/2] fp32
    inv_freq_long: np.ndarray  # [D/2] fp32 (== inv_freq except for longrope)
    long_from: np.ndarray  # int32 []: longrope's original_max_position_embeddings, else never
    dynamic_from: np.ndarray  # int32 []: dynamic's max_position_embeddings, else never
    dynamic_factor: np.ndarray  # fp32 []
    dynamic_factor_m1: np.ndarray  # fp32 []: factor - 1, rounded once as torch does
    theta: np.ndarray  # fp32 []
    attention_scaling: np.ndarray  # fp32 []: cos and sin are multiplied by it


NEVER = np.iinfo(np.int32).max
F32 = np.float32


def _default_inv_freq(theta: float, dim: int) -> np.ndarray:
    """``1 / theta ** (arange(0, dim, 2) / dim)`` in fp32, torch's order of operations."""
    return F32(1.0) / (F32(theta) ** (np.arange(0, dim, 2, dtype=F32) / F32(dim)))


def _yarn_inv_freq(cfg: DSparkConfig, dim: int) -> np.ndarray:
    """transformers' ``_compute_yarn_parameters`` frequencies."""
    rope, base = cfg.rope_scaling, cfg.rope_theta
    factor = rope.get("factor")
    original = rope.get("original_max_position_embeddings")
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = F32(base) ** (np.arange(0, dim, 2, dtype=F32) / F32(dim))
    extrapolation = F32(1.0) / pos_freqs
    interpolation = F32(1.0) / (F32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), 0, 1)
    keep = F32(1) - ramp  # the extrapolated share of each frequency
    return interpolation * (F32(1) - keep) + extrapolation * keep


def _llama3_inv_freq(cfg: DSparkConfig, dim: int) -> np.ndarray:
    """transformers' ``_compute_llama3_parameters`` frequencies."""
    rope = cfg.rope_scaling
    inv = _default_inv_freq(cfg.rope_theta, dim)
    factor, low, high = (rope.get(k) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old_context = rope.get("original_max_position_embeddings")
    low_wavelen, high_wavelen = F32(old_context / low), F32(old_context / high)
    # torch evaluates `scalar / tensor` as `tensor.reciprocal() * scalar`.
    wavelen = (F32(1) / inv) * F32(2 * math.pi)
    scaled = np.where(wavelen > low_wavelen, inv / F32(factor), inv)
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = ((F32(1) / wavelen) * F32(old_context) - F32(low)) / F32(high - low)
    smoothed = (F32(1) - smooth) * scaled / F32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(F32)


def rope_tables(cfg: DSparkConfig) -> RopeTables:
    """The inverse frequencies and attention scaling transformers' ``ROPE_INIT_FUNCTIONS``
    give the draft layers' ``Qwen3RotaryEmbedding`` (fp32, its order of operations)."""
    rope, hd = cfg.rope_scaling, cfg.head_dim
    kind = rope.rope_type
    inv = long = None
    long_from = dynamic_from = NEVER
    dynamic_factor, dynamic_factor_m1 = 1.0, 0.0
    if kind in ("default", "dynamic"):
        inv = _default_inv_freq(cfg.rope_theta, hd)  # dynamic below its threshold
        if kind == "dynamic":
            dynamic_from = cfg.max_position_embeddings
            dynamic_factor = rope.get("factor")
            dynamic_factor_m1 = dynamic_factor - 1
    elif kind == "linear":
        inv = _default_inv_freq(cfg.rope_theta, hd) / F32(rope.get("factor"))
    elif kind == "yarn":
        inv = _yarn_inv_freq(cfg, hd)
    elif kind == "llama3":
        inv = _llama3_inv_freq(cfg, hd)
    elif kind == "longrope":
        shape = np.arange(0, hd, 2, dtype=F32) / F32(hd)
        powers = F32(cfg.rope_theta) ** shape
        inv = F32(1.0) / (np.asarray(rope.get("short_factor"), F32) * powers)
        long = F32(1.0) / (np.asarray(rope.get("long_factor"), F32) * powers)
        long_from = rope.get("original_max_position_embeddings")
    elif kind == "proportional":
        angles = int(rope.get("partial_rotary_factor", 1.0) * hd // 2)
        rotated = F32(1.0) / (
            F32(cfg.rope_theta) ** (np.arange(0, 2 * angles, 2, dtype=F32) / F32(hd))
        )
        inv = np.concatenate([rotated, np.zeros(hd // 2 - angles, F32)])
        inv = inv / F32(rope.get("factor", 1.0))
    else:  # DSparkConfig validates rope_type; a new type must be added here
        raise ValueError(f"rope_tables: no frequencies for rope_type {kind!r}")
    inv = np.asarray(inv, F32)
    return RopeTables(
        inv_freq=inv,
        inv_freq_long=inv if long is None else np.asarray(long, F32),
        long_from=np.asarray(long_from, np.int32),
        dynamic_from=np.asarray(dynamic_from, np.int32),
        dynamic_factor=np.asarray(dynamic_factor, F32),
        dynamic_factor_m1=np.asarray(dynamic_factor_m1, F32),
        theta=np.asarray(cfg.rope_theta, F32),
        attention_scaling=np.asarray(rope.attention_scaling(cfg.max_position_embeddings), F32),
    )


def rope_frequencies(rope: RopeTables, seq_len: jax.Array) -> jax.Array:
    """The inverse frequencies [D/2] (fp32) of a row whose largest position is seq_len - 1.

    Stateless: transformers' dynamic-NTK module keeps the largest length it has seen
    until a row is shorter than max_position_embeddings; this is its value for a fresh
    module (docs/math.md, "RoPE").
    """
    inv = jnp.where(seq_len > rope.long_from, rope.inv_freq_long, rope.inv_freq)
    dim = 2 * inv.shape[0]
    s = jnp.maximum(seq_len, rope.dynamic_from).astype(jnp.float32)
    scale = rope.dynamic_factor * s / rope.dynamic_from.astype(jnp.float32) - rope.dynamic_factor_m1
    base = rope.theta * scale ** jnp.float32(dim / (dim - 2) if dim > 2 else 1.0)
    dynamic = 1.0 / base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / jnp.float32(dim))
    return jnp.where(seq_len > rope.dynamic_from, dynamic, inv)


def rope_cos_sin(
    positions: jax.Array, inv_freq: jax.Array, attention_scaling: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """RoPE tables for integer positions [...] -> cos, sin [..., D] (fp32), scaled."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * attention_scaling, jnp.sin(emb) * attention_scaling


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
