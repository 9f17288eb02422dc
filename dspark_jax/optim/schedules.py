"""Learning-rate schedules of the reference trainer: transformers' linear/cosine warmup
lambdas per optimiser, stepped after each update (the update of step s uses lambda(s))."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import optax

SCHEDULER_TYPES = ("linear", "cosine", "none")


def resolve_scheduler_steps(
    total_steps: int, warmup_steps: int | None = None, warmup_ratio: float | None = None
) -> tuple[int, int]:
    """speculators/train/trainer.py::_resolve_scheduler_steps (given the total).

    The reference's total is ``--scheduler-total-steps``, else ``--max-steps``, else
    ``epochs * len(train_loader)``; the caller resolves that. Returns
    ``(warmup_steps, total_steps)``.
    """
    if warmup_steps is not None:
        if warmup_ratio is not None:
            warnings.warn(
                "Both scheduler_warmup_steps and scheduler_warmup_ratio are set; "
                "using scheduler_warmup_steps.",
                stacklevel=2,
            )
        return int(warmup_steps), int(total_steps)
    if warmup_ratio is not None:
        if not 0 <= warmup_ratio <= 1:
            raise ValueError("scheduler_warmup_ratio must be between 0 and 1.")
        return int(total_steps * warmup_ratio), int(total_steps)
    return int(total_steps) // 100, int(total_steps)


def lr_lambda(
    step: int,
    *,
    scheduler_type: str,
    warmup_steps: int,
    total_steps: int,
    num_cosine_cycles: float = 0.5,
) -> float:
    """The LambdaLR multiplier in plain Python (transformers 5.19 formulas)."""
    if scheduler_type == "none":
        return 1.0
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    if scheduler_type == "linear":
        return max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))
    if scheduler_type == "cosine":
        progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cosine_cycles) * 2.0 * progress)))
    raise ValueError(f"scheduler_type must be one of {SCHEDULER_TYPES}, got {scheduler_type!r}")


def make_schedule(
    base_lr: float,
    *,
    scheduler_type: str,
    warmup_steps: int,
    total_steps: int,
    num_cosine_cycles: float = 0.5,
) -> optax.Schedule:
    """``count -> base_lr * lambda(count)`` (jittable), the lr of update ``count``.

    transformers' lambdas, unclamped like the reference: cosine past ``total``
    rises again (``num_cycles=0.5`` -> lambda(1.5*total) = 0.5); linear stays 0.
    """
    if scheduler_type not in SCHEDULER_TYPES:
        raise ValueError(f"scheduler_type must be one of {SCHEDULER_TYPES}, got {scheduler_type!r}")
    base = float(base_lr)
    if scheduler_type == "none":
        return optax.constant_schedule(base)
    w = int(warmup_steps)
    span = float(max(1, total_steps - w))

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm = s / float(max(1, w))
        if scheduler_type == "linear":
            decay = jnp.maximum(0.0, (float(total_steps) - s) / span)
        else:
            progress = (s - w) / span
            decay = jnp.maximum(
                0.0, 0.5 * (1.0 + jnp.cos(math.pi * float(num_cosine_cycles) * 2.0 * progress))
            )
        return base * jnp.where(s < w, warm, decay)

    return schedule


def current_lrs(schedules: dict[str, optax.Schedule], step) -> dict[str, jax.Array]:
    """The lr each group uses for update ``step`` (the reference's logged ``lr``)."""
    return {name: s(step) for name, s in schedules.items()}
