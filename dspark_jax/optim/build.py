"""The reference's clipping + optimiser(s) + per-group schedules as one optax transform,
built from the reference trainer's flags."""

from __future__ import annotations

from typing import Any

import jax
import optax

from dspark_jax.optim.adamw import torch_adamw
from dspark_jax.optim.clipping import MAX_GRAD_NORM, clip_by_global_norm_torch
from dspark_jax.optim.muon import MUON_ADJUST_LR_FNS, torch_muon
from dspark_jax.optim.partition import param_labels
from dspark_jax.optim.schedules import SCHEDULER_TYPES, make_schedule, resolve_scheduler_steps

OPTIMIZERS = ("adamw", "muon")

# The reference CLI's defaults (speculators/train/config/schema.py OptimizerArgs,
# SchedulerArgs); muon_lr None -> lr (TrainConfig._resolve_derived_defaults).
CLI_DEFAULTS: dict[str, Any] = {
    "optimizer": "muon",
    "lr": 1e-3,
    "weight_decay": 0.01,
    "muon_lr": None,
    "muon_momentum": 0.95,
    "muon_weight_decay": 0.1,
    "muon_ns_steps": 5,
    "muon_adjust_lr_fn": "match_rms_adamw",
    "scheduler_type": "linear",
    "scheduler_warmup_steps": None,
    "scheduler_warmup_ratio": None,
    "scheduler_total_steps": None,
    "scheduler_num_cosine_cycles": 0.5,
}


def build_optimizer(
    params=None,
    *,
    optimizer: str = CLI_DEFAULTS["optimizer"],
    lr: float = CLI_DEFAULTS["lr"],
    weight_decay: float = CLI_DEFAULTS["weight_decay"],
    muon_lr: float | None = None,
    muon_momentum: float = CLI_DEFAULTS["muon_momentum"],
    muon_weight_decay: float = CLI_DEFAULTS["muon_weight_decay"],
    muon_ns_steps: int = CLI_DEFAULTS["muon_ns_steps"],
    muon_adjust_lr_fn: str = CLI_DEFAULTS["muon_adjust_lr_fn"],
    scheduler_type: str = CLI_DEFAULTS["scheduler_type"],
    total_steps: int | None = None,
    warmup_steps: int | None = None,
    warmup_ratio: float | None = None,
    num_cosine_cycles: float = CLI_DEFAULTS["scheduler_num_cosine_cycles"],
    max_grad_norm: float = MAX_GRAD_NORM,
) -> tuple[optax.GradientTransformation, dict[str, optax.Schedule]]:
    """The reference's clipping + optimiser(s) + per-group schedules as one optax transform.

    params: the trainable parameter tree (``nnx.state(model, nnx.Param)`` or its
    pure-array form), used only to check the flags against it (a Muon run with no
    Muon parameter is allowed, like the reference); may be None.
    total_steps: the resolved scheduler horizon (required unless
    ``scheduler_type == "none"``). ``muon_lr`` None -> ``lr`` (the CLI's rule).

    Returns ``(tx, schedules)``: ``tx = chain(torch clip_grad_norm_, partition(muon |
    adamw))``; ``schedules`` = ``{"muon": ..., "adamw": ...}`` (``{"adamw": ...}`` for
    ``optimizer="adamw"``).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"Unsupported optimizer: {optimizer!r} (expected one of {OPTIMIZERS})")
    if scheduler_type not in SCHEDULER_TYPES:
        raise ValueError(
            f"Unsupported scheduler_type: {scheduler_type!r} (expected one of {SCHEDULER_TYPES})"
        )
    if muon_adjust_lr_fn not in MUON_ADJUST_LR_FNS:
        raise ValueError(
            f"Unsupported muon_adjust_lr_fn: {muon_adjust_lr_fn!r} "
            f"(expected one of {MUON_ADJUST_LR_FNS})"
        )
    for name, value in (("lr", lr), ("muon_lr", muon_lr)):
        if value is not None and not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if (
        isinstance(muon_ns_steps, bool)
        or not isinstance(muon_ns_steps, int)
        or not 0 <= muon_ns_steps < 100
    ):
        raise ValueError(f"muon_ns_steps must be an int in [0, 100), got {muon_ns_steps!r}")
    if scheduler_type == "none":
        warm, total = 0, 0
    else:
        if total_steps is None or total_steps < 0:
            raise ValueError(
                f"total_steps (the scheduler horizon) must be a non-negative int for "
                f"scheduler_type={scheduler_type!r}, got {total_steps!r}"
            )
        warm, total = resolve_scheduler_steps(total_steps, warmup_steps, warmup_ratio)
    if muon_lr is None:
        muon_lr = lr
    if params is not None and not jax.tree.leaves(params):
        raise ValueError("No trainable parameters found to optimize.")

    def sched(base):
        return make_schedule(
            base,
            scheduler_type=scheduler_type,
            warmup_steps=warm,
            total_steps=total,
            num_cosine_cycles=num_cosine_cycles,
        )

    clip = clip_by_global_norm_torch(max_grad_norm)
    if optimizer == "adamw":
        adam_sched = sched(lr)
        return optax.chain(clip, torch_adamw(adam_sched, weight_decay)), {"adamw": adam_sched}

    schedules = {"muon": sched(muon_lr), "adamw": sched(lr)}
    tx = optax.partition(
        {
            "muon": torch_muon(
                schedules["muon"],
                momentum=muon_momentum,
                weight_decay=muon_weight_decay,
                ns_steps=muon_ns_steps,
                adjust_lr_fn=muon_adjust_lr_fn,
            ),
            "adamw": torch_adamw(schedules["adamw"], weight_decay),
        },
        param_labels,
    )
    return optax.chain(clip, tx), schedules


def build_optimizer_from_flags(params, flags: dict[str, Any], total_steps: int | None):
    """``build_optimizer`` from the reference's flag names (``CLI_DEFAULTS`` keys)."""
    f = {**CLI_DEFAULTS, **{k: v for k, v in flags.items() if k in CLI_DEFAULTS}}
    total = f["scheduler_total_steps"] if f["scheduler_total_steps"] is not None else total_steps
    return build_optimizer(
        params,
        optimizer=f["optimizer"],
        lr=f["lr"],
        weight_decay=f["weight_decay"],
        muon_lr=f["muon_lr"],
        muon_momentum=f["muon_momentum"],
        muon_weight_decay=f["muon_weight_decay"],
        muon_ns_steps=f["muon_ns_steps"],
        muon_adjust_lr_fn=f["muon_adjust_lr_fn"],
        scheduler_type=f["scheduler_type"],
        total_steps=total,
        warmup_steps=f["scheduler_warmup_steps"],
        warmup_ratio=f["scheduler_warmup_ratio"],
        num_cosine_cycles=f["scheduler_num_cosine_cycles"],
    )
