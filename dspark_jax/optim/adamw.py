"""torch.optim.AdamW at torch's defaults, in optax (decay on every parameter it is given)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

# torch.optim.AdamW defaults (the reference passes only lr and weight_decay).
ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-8


class TorchAdamState(NamedTuple):
    count: jax.Array  # int32, number of updates so far (torch's ``step``)
    exp_avg: optax.Updates
    exp_avg_sq: optax.Updates


def _bias_correction(beta: float, t: jax.Array) -> jax.Array:
    """``1 - beta**t`` without fp32 cancellation (torch evaluates it in float64).

    optax's ``bias_correction`` computes ``1 - beta**t`` in fp32: at ``t = 1`` with
    ``beta = 0.999`` that is 1.3e-5 off, which moves every AdamW update by 6e-6
    relative. ``-expm1(t * log(beta))`` is accurate to ~1e-7.
    """
    return -jnp.expm1(t.astype(jnp.float32) * jnp.float32(math.log(beta)))


def scale_by_torch_adam(
    b1: float = ADAMW_BETAS[0], b2: float = ADAMW_BETAS[1], eps: float = ADAMW_EPS
) -> optax.GradientTransformation:
    """torch.optim.AdamW's step without lr and decay (``_single_tensor_adamw``):

    ``m = lerp(m, g, 1-b1)``; ``v = v*b2 + (1-b2)*g*g``;
    ``u = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)`` (eps outside the sqrt, after
    the bias correction, like torch).
    """
    w1 = jnp.float32(1.0 - b1)

    def init_fn(params):
        def zeros(p):
            return jnp.zeros_like(p, jnp.float32)

        return TorchAdamState(
            count=jnp.zeros([], jnp.int32),
            exp_avg=jax.tree.map(zeros, params),
            exp_avg_sq=jax.tree.map(zeros, params),
        )

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        g32 = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
        m = jax.tree.map(lambda m, g: m + w1 * (g - m), state.exp_avg, g32)
        v = jax.tree.map(lambda v, g: v * b2 + (g * g) * (1.0 - b2), state.exp_avg_sq, g32)
        bc1 = _bias_correction(b1, count)
        bc2_sqrt = jnp.sqrt(_bias_correction(b2, count))
        u = jax.tree.map(lambda m, v: (m / bc1) / (jnp.sqrt(v) / bc2_sqrt + eps), m, v)
        return u, TorchAdamState(count=count, exp_avg=m, exp_avg_sq=v)

    return optax.GradientTransformation(init_fn, update_fn)


def torch_adamw(
    learning_rate: optax.ScalarOrSchedule, weight_decay: float
) -> optax.GradientTransformation:
    """torch.optim.AdamW at torch's defaults (betas 0.9/0.999, eps 1e-8, no amsgrad):
    ``p <- p*(1 - lr*wd) - lr * adam(g)``, decay on every parameter it is given."""
    if weight_decay < 0:
        raise ValueError(f"weight decay must be >= 0, got {weight_decay}")
    return optax.chain(
        scale_by_torch_adam(),
        optax.add_decayed_weights(weight_decay),  # no mask: the reference decays all
        optax.scale_by_learning_rate(learning_rate),
    )
