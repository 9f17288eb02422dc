"""torch 2.13's bf16 Newton-Schulz orthogonalisation (``torch/optim/_muon.py``), bit for
bit where the BLAS accumulation order allows (docs/math.md, "Optimizer")."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# torch/optim/_muon.py defaults (not exposed as flags by the reference).
MUON_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MUON_EPS = 1e-7


def _split_constant(v: float, bits: int) -> tuple[float, float]:
    """fp32(v) = hi + lo exactly, ``hi`` with at most ``bits`` significant bits."""
    v32 = float(np.float32(v))
    if v32 == 0.0:
        return 0.0, 0.0
    q = 2.0 ** (math.floor(math.log2(abs(v32))) - bits + 1)
    hi = math.trunc(v32 / q) * q
    return hi, v32 - hi


def _split12(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp32 x = hi + lo exactly, each with <= 12 significant bits (bit masking, no FP ops)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFFF000)
    hi = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return hi, x - hi


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Knuth's TwoSum: a + b = s + e exactly."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _addmm_bf16(beta: float, c: jax.Array, alpha: float, acc: jax.Array) -> jax.Array:
    """``bf16(beta*C + alpha*acc)`` for bf16 ``C`` and the fp32 matmul result ``acc``.

    torch's bf16 ``addmm`` (oneDNN on CPU, the cuBLAS epilogue on GPU) forms
    ``beta*C + alpha*acc`` with a fused multiply-add, i.e. essentially exactly,
    then rounds once. In Newton-Schulz the two terms nearly cancel, so the naive
    fp32 ``b*C + c*acc`` (two extra roundings) flips about one bf16 rounding in
    10^4, and the iteration amplifies a flip to several ulps. We form the sum
    exactly instead: ``beta`` splits into 16+8 bits (times the 8-bit bf16 ``C``:
    exact products), ``alpha`` and ``acc`` into 12+12 bits (exact partial products),
    the two large terms are added with TwoSum and the small remainders after.
    Every product here is exact in fp32, so a backend contracting ``x*y + z`` into
    an FMA cannot change the result.
    """
    c32 = c.astype(jnp.float32)
    bh, bl = _split_constant(beta, 16)
    big1, small1 = bh * c32, bl * c32
    if float(np.float32(alpha)) == 1.0:
        big2, small2 = acc, None
    else:
        ah_, al_ = _split_constant(alpha, 12)
        xh, xl = _split12(acc)
        big2 = ah_ * xh
        small2 = (ah_ * xl + al_ * xh) + al_ * xl
    s, e = _two_sum(big1, big2)
    rest = e + small1 if small2 is None else e + (small1 + small2)
    return (s + rest).astype(jnp.bfloat16)


def newton_schulz_torch(
    w: jax.Array,
    ns_coefficients: tuple[float, float, float] = MUON_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = MUON_EPS,
) -> jax.Array:
    """torch/optim/_muon.py::_zeropower_via_newtonschulz on a matrix in torch layout.

    bf16 operands, matmuls accumulated in fp32 and rounded to bf16; each
    ``addmm(C, A, B, beta, alpha)`` = ``bf16(beta*C + alpha*(A@B))`` rounded once
    (``_addmm_bf16``); the Frobenius norm is taken in fp32 and rounded to bf16,
    clamped at ``eps``, and the division rounded to bf16, as torch's bf16
    ``norm``/``clamp``/``div_`` do. Returns bf16, like torch.
    """
    if w.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {w.shape}")
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    a, b, c = ns_coefficients
    bf16, f32 = jnp.bfloat16, jnp.float32

    def mm(p, q):
        return jnp.matmul(p, q, preferred_element_type=f32)

    x = w.astype(bf16)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(f32)))).astype(bf16)  # bf16 .norm()
    norm = jnp.maximum(norm, jnp.asarray(eps, bf16))  # .clamp(min=eps)
    x = (x.astype(f32) / norm.astype(f32)).astype(bf16)  # .div_ in bf16

    def body(_, x):
        gram = mm(x, x.T).astype(bf16)
        gram_update = _addmm_bf16(b, gram, c, mm(gram, gram))
        return _addmm_bf16(a, x, 1.0, mm(gram_update, x))

    x = jax.lax.fori_loop(0, ns_steps, body, x)  # rolled: 5x smaller graph per matrix
    if tall:
        x = x.T
    return x
