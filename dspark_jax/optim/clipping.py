"""Gradient clipping as the reference does it: ``torch.nn.utils.clip_grad_norm_(params, 1.0)``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

# trainer.py: clip_grad_norm_(model.parameters(), 1.0) (hard-coded); torch adds 1e-6.
MAX_GRAD_NORM = 1.0
CLIP_EPS = 1e-6


def global_grad_norm(grads) -> jax.Array:
    """torch's total norm: the 2-norm of the per-tensor 2-norms (fp32)."""
    leaves = jax.tree.leaves(grads)
    if not leaves:
        return jnp.zeros([], jnp.float32)
    norms = jnp.stack([jnp.linalg.norm(g.astype(jnp.float32).ravel()) for g in leaves])
    return jnp.linalg.norm(norms)


def clip_by_global_norm_torch(max_norm: float = MAX_GRAD_NORM) -> optax.GradientTransformation:
    """``torch.nn.utils.clip_grad_norm_``: ``g *= min(1, max_norm / (norm + 1e-6))``.

    optax.clip_by_global_norm divides by the norm without the 1e-6 and skips the
    multiply below the threshold; the difference is tiny but feeds the bf16
    Newton-Schulz, so we use torch's formula. Non-finite norms propagate (torch's
    ``error_if_nonfinite=False``).
    """
    if not max_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, got {max_norm}")

    def update_fn(updates, state, params=None):
        del params
        norm = global_grad_norm(updates)
        coef = jnp.minimum(jnp.float32(max_norm) / (norm + jnp.float32(CLIP_EPS)), 1.0)
        return jax.tree.map(lambda g: (g * coef).astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
