"""The trainer's checkpointing: asynchronous saves of the training state in the Orbax
format of :mod:`dspark_jax.checkpoint.orbax_io`, retention (the newest ``max_to_keep``
steps plus the best one), resume, and one-line reports of a failed save or restore.
Only the trainer uses it; readers of the format (eval, export) import ``orbax_io`` alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from dspark_jax.checkpoint.orbax_io import (
    CheckpointError,
    reads_finished_on_failure,
)

logger = logging.getLogger(__name__)


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


class _OrbaxErrorFilter(logging.Filter):
    """Drops Orbax's own error records (a failed save logs its traceback from every
    thread it passed through): :class:`Checkpointer` reports the failure once, naming
    the step. ``DSPARK_DEBUG=1`` keeps them."""

    def filter(self, record: logging.LogRecord) -> bool:
        from dspark_jax.cli import debug_enabled

        orbax = f"{os.sep}orbax{os.sep}" in (record.pathname or "")
        return not (orbax and record.levelno >= logging.ERROR and not debug_enabled())


_ORBAX_ERRORS = _OrbaxErrorFilter()


def _reason(error: BaseException) -> str:
    from dspark_jax.cli import one_line

    return one_line(error)


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
        self.pending: tuple[int, str] | None = None  # (step, reason) of the save in flight
        logging.getLogger("absl").addFilter(_ORBAX_ERRORS)
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
        reason: str = "save",
    ) -> bool:
        """Start an (async) save of step ``step``; returns whether one was started.

        The save is reported ("checkpoint (reason) at step N") only once it is written,
        by :meth:`wait` or the next save; a failed one raises :class:`CheckpointError`.
        """
        self.wait()
        items: dict[str, Any] = {
            "state": ocp.args.StandardSave(state),
            "meta": ocp.args.JsonSave(meta),
        }
        if self.with_data:
            if data_iterator is None:
                raise ValueError("this checkpointer saves the data iterator: pass data_iterator")
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        try:
            started = self.manager.save(step, args=ocp.args.Composite(**items), force=force)
        except Exception as e:
            raise CheckpointError(
                f"{self.directory}/{step}: the checkpoint was not written: {_reason(e)}"
            ) from e
        if started:
            self.pending = (step, reason)
        return started

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
        with reads_finished_on_failure():
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return restored["state"], restored["meta"]

    def meta(self, step: int) -> dict[str, Any]:
        """The ``meta`` item of ``step`` alone (check it before restoring the arrays)."""
        with reads_finished_on_failure():
            items = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return items["meta"]

    def move_aside(self, step: int) -> Path:
        """Rename an unreadable step folder out of Orbax's sight (kept for inspection)."""
        src = self.directory / str(step)
        dst = src.with_name(f"{step}.unreadable")
        n = 1
        while dst.exists():
            n += 1
            dst = src.with_name(f"{step}.unreadable-{n}")
        src.rename(dst)
        return dst

    def reload(self) -> None:
        """Re-read the step folders (after :meth:`move_aside`, on every process)."""
        self.manager.reload()

    def delete_all(self) -> None:
        """Remove every step (a run that starts over in the same directory)."""
        self.manager.wait_until_finished()
        for step in self.all_steps():
            self.manager.delete(step)

    def reached_preemption(self, step: int) -> bool:
        """True on every process once any was told to stop (SIGTERM on TPU/Slurm)."""
        return self.manager.reached_preemption(step)

    def wait(self) -> None:
        """Finish the save in flight and report it, written or failed (once)."""
        pending, self.pending = self.pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            step = "?" if pending is None else pending[0]
            raise CheckpointError(
                f"{self.directory}/{step}: the checkpoint was not written: {_reason(e)}"
            ) from e
        if pending is not None:
            logger.info(
                "checkpoint (%s) at step %d -> %s/%d",
                pending[1],
                pending[0],
                self.directory,
                pending[0],
            )

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()


def abstract_like(state: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a concrete state, the restore target."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        state,
    )
