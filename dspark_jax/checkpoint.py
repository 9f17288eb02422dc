"""Orbax checkpoints of a training run: train state + data iterator + run metadata.

One step directory holds three items, saved together (async) by one
``ocp.CheckpointManager``:

* ``state``: ``{"params": <pure dict of the trainable parameters>, "opt": <optax
  state>}``, sharded arrays written by every process (OCDBT). ``params`` as a pure
  dict is the contract of ``converters/orbax_io.py``, so ``python -m converters
  export`` reads a training checkpoint directly.
* ``data``: the Grain iterator state of each process (``process_{i}-of-{n}.json``).
* ``meta``: JSON: ``format``/``config`` (the converters' contract: the drafter's
  speculators config), global step, epoch, step within the epoch, best validation
  loss, ``metrics`` (``{"loss": val loss}`` when saved after a validation), seed.

Retention: the newest ``max_to_keep`` steps, plus ``best_step`` (the step with the
best validation loss, set by the trainer) whatever its age.

The PRNG stream needs no state of its own: the anchors of global step s are drawn
from ``fold_in(key(seed), s)``, so restoring the step restores the randomness.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


@dataclasses.dataclass
class KeepLatestAndBest:
    """Orbax preservation policy: the newest ``n`` checkpoints and ``best_step``."""

    n: int | None
    best_step: int | None = None

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        del context
        steps = [c.step for c in checkpoints]
        if self.n is None:
            newest = set(steps)
        else:
            newest = set(sorted(steps)[-self.n :]) if self.n > 0 else set()
        return [s in newest or s == self.best_step for s in steps]


class Checkpointer:
    def __init__(
        self,
        directory: str | Path,
        *,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        with_data: bool = True,
    ):
        self.directory = Path(directory).absolute()
        self.with_data = with_data
        self.policy = KeepLatestAndBest(max_to_keep)
        items = ("state", "data", "meta") if with_data else ("state", "meta")
        self.manager = ocp.CheckpointManager(
            self.directory,
            item_names=items,
            options=ocp.CheckpointManagerOptions(
                preservation_policy=self.policy,
                enable_async_checkpointing=async_save,
                create=True,
            ),
        )

    @property
    def best_step(self) -> int | None:
        return self.policy.best_step

    @best_step.setter
    def best_step(self, step: int | None) -> None:
        self.policy.best_step = step

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(
        self,
        step: int,
        state: Any,
        meta: dict[str, Any],
        data_iterator: grain.DatasetIterator | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """Start an (async) save of step ``step``; returns whether one was started."""
        items: dict[str, Any] = {
            "state": ocp.args.StandardSave(state),
            "meta": ocp.args.JsonSave(meta),
        }
        if self.with_data:
            if data_iterator is None:
                raise ValueError("this checkpointer saves the data iterator: pass data_iterator")
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

    def restore(
        self,
        step: int | None,
        abstract_state: Any,
        data_iterator: grain.DatasetIterator | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Restore ``step`` (latest when None) onto ``abstract_state``'s shapes and
        shardings (jax.ShapeDtypeStruct leaves); the data iterator is restored in place."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.directory}: no checkpoint to restore")
        items: dict[str, Any] = {
            "state": ocp.args.StandardRestore(abstract_state),
            "meta": ocp.args.JsonRestore(),
        }
        if self.with_data and data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return restored["state"], restored["meta"]

    def meta(self, step: int) -> dict[str, Any]:
        """The ``meta`` item of ``step`` alone (check it before restoring the arrays)."""
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]

    def delete_all(self) -> None:
        """Remove every step (a run that starts over in the same directory)."""
        self.manager.wait_until_finished()
        for step in self.all_steps():
            self.manager.delete(step)

    def reached_preemption(self, step: int) -> bool:
        """True on every process once any was told to stop (SIGTERM on TPU/Slurm)."""
        return self.manager.reached_preemption(step)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(state: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a concrete state, the restore target."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        state,
    )
