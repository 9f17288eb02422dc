"""The Orbax checkpoint format of dspark-jax, written by the trainer and the importer,
read by the trainer (resume), the evaluator and the exporter. One owner for one format.

A checkpoint directory is an ``ocp.CheckpointManager`` root; step ``N`` lives in
``directory/N/`` with these items:

* ``state`` (``ocp.args.StandardSave``): a **pure nested dict**
  ``{"params": nnx.to_pure_dict(nnx.state(model, nnx.Param))}`` (fp32 leaves, integer
  keys for ``layers``). A training checkpoint stores the optax state beside it
  (``"opt"``), sharded arrays written by every process (OCDBT); :func:`load_params`
  restores ``state["params"]`` only (a partial restore), so a training checkpoint and
  a params-only one (``python -m converters import``) read the same way.
* ``meta`` (``ocp.args.JsonSave``): ``{"format": FORMAT, "step": N, "config":
  DSparkConfig.to_speculators_dict(), ...}`` (the config records the rope parameters
  and the verifier's final-norm convention, ``verifier_norm_style``, of the targets); optional ``"metrics": {name: float}``
  (used by ``step="best"``), ``"source"``, ``"vocab_maps"``; a training checkpoint adds
  the epoch, step within the epoch, best validation loss and seed.
* ``data`` (training checkpoints only): the Grain iterator state of each process
  (``process_{i}-of-{n}.json``).

When the draft vocabulary is reduced, the maps sit in the root beside the step
folders as ``d2t-<Vd>.npy`` / ``t2d-<Vd>.npy`` (:mod:`dspark_jax.data.vocab` format).

Pure dicts, not ``nnx.State``: the restored tree then needs no Variable wrappers
(docs/design.md, "Pinned-library pitfalls") and ``nnx.replace_by_pure_dict`` turns it
back into a state. Restores of params are host numpy arrays.

Retention (:class:`dspark_jax.checkpoint.checkpointer.Checkpointer`): the newest ``max_to_keep`` steps, plus
``best_step`` (the step with the best validation loss) whatever its age. The PRNG
stream needs no state of its own: the anchors of global step s are drawn from
``fold_in(key(seed), s)``, so restoring the step restores the randomness.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from dspark_jax.config import DSparkConfig
from dspark_jax.data.vocab import check_vocab_maps, save_vocab_maps

logger = logging.getLogger(__name__)

FORMAT = "dspark-jax/params-v1"
ITEM_STATE, ITEM_META = "state", "meta"
ITEM_NAMES = (ITEM_STATE, ITEM_META)


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed or does not match its config."""


@dataclasses.dataclass(frozen=True)
class LoadedParams:
    cfg: DSparkConfig
    params: nnx.State  # trainable params, fp32 numpy leaves
    step: int
    meta: dict[str, Any]


def abstract_params(cfg: DSparkConfig) -> nnx.State:
    """``nnx.state(DSparkDraftModel(cfg), nnx.Param)`` as ShapeDtypeStructs (no compute)."""
    from dspark_jax.model.draft import DSparkDraftModel

    model = nnx.eval_shape(lambda: DSparkDraftModel(cfg, rngs=nnx.Rngs(0)))
    return nnx.state(model, nnx.Param)


def _pure(params: nnx.State | dict) -> dict:
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else dict(params)


def _manager(directory: Path, create: bool) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        directory,
        item_names=ITEM_NAMES,
        options=ocp.CheckpointManagerOptions(create=create, enable_async_checkpointing=False),
    )


def save_params_checkpoint(
    directory: str | os.PathLike,
    step: int,
    cfg: DSparkConfig,
    params: nnx.State | dict,
    *,
    meta: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write step ``step`` of a params-only checkpoint; returns the step folder.

    ``params``: ``nnx.state(model, nnx.Param)`` or its pure dict; shapes are checked
    against ``cfg`` first (a mismatch raises naming the parameter).
    """
    directory = Path(directory).absolute()
    pure = _pure(params)
    _check_against_config(pure, cfg, source="params")
    mngr = _manager(directory, create=True)
    try:
        if step in mngr.all_steps():
            if not overwrite:
                raise CheckpointError(
                    f"{directory}: step {step} already exists (pass overwrite=True / --overwrite)"
                )
            mngr.delete(step)
        record = {"format": FORMAT, "step": int(step), "config": cfg.to_speculators_dict()}
        record.update(meta or {})
        mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": pure}),
                meta=ocp.args.JsonSave(record),
            ),
        )
        mngr.wait_until_finished()
    finally:
        mngr.close()
    return directory / str(step)


def _flat(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    if isinstance(tree, dict):
        out: dict[tuple[str, ...], Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, (*prefix, str(k))))
        return out
    return {prefix: tree}


def _check_against_config(pure: dict, cfg: DSparkConfig, source: str) -> None:
    want = {tuple(map(str, p)): tuple(v.shape) for p, v in nnx.to_flat_state(abstract_params(cfg))}
    got = {p: tuple(np.shape(v)) for p, v in _flat(pure).items()}
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        raise CheckpointError(
            f"{source}: parameter tree does not match the config: missing "
            f"{['/'.join(p) for p in missing]}, unexpected {['/'.join(p) for p in extra]}"
        )
    for path, shape in want.items():
        if got[path] != shape:
            raise CheckpointError(
                f"{source}: parameter {'/'.join(path)} has shape {got[path]}, "
                f"the config needs {shape}"
            )


def list_steps(directory: str | os.PathLike) -> list[int]:
    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    mngr = _manager(directory, create=False)
    try:
        return sorted(mngr.all_steps())
    finally:
        mngr.close()


def read_meta(directory: str | os.PathLike, step: int) -> dict[str, Any]:
    path = Path(directory).absolute() / str(step) / ITEM_META
    if not path.is_dir():
        raise CheckpointError(
            f"{path.parent}: no '{ITEM_META}' item (not a dspark-jax checkpoint step?)"
        )
    meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(path)
    if not isinstance(meta, dict) or "config" not in meta:
        raise CheckpointError(f"{path}: meta has no 'config' (got keys {sorted(meta or {})})")
    return meta


def resolve_step(
    directory: str | os.PathLike,
    step: int | str | None = None,
    *,
    best_metric: str = "loss",
    best_mode: str = "min",
) -> int:
    """``step``: an int, ``"latest"``/None, or ``"best"`` (by ``meta["metrics"][best_metric]``)."""
    steps = list_steps(directory)
    if not steps:
        raise CheckpointError(f"{directory}: no checkpoint steps found")
    if step is None or step == "latest":
        return steps[-1]
    if step == "best":
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        scored = []
        for s in steps:
            value = (read_meta(directory, s).get("metrics") or {}).get(best_metric)
            if value is not None:
                scored.append((float(value), s))
        if not scored:
            raise CheckpointError(
                f"{directory}: step='best' needs meta['metrics'][{best_metric!r}], "
                f"which none of the steps {steps} records"
            )
        return (min if best_mode == "min" else max)(scored)[1]
    try:
        step = int(step)
    except (TypeError, ValueError):
        raise ValueError(f"step must be an int, 'latest' or 'best', got {step!r}") from None
    if step not in steps:
        raise CheckpointError(f"{directory}: no step {step} (steps: {steps})")
    return step


def load_params(
    directory: str | os.PathLike,
    step: int | str | None = None,
    *,
    best_metric: str = "loss",
    best_mode: str = "min",
) -> LoadedParams:
    """Read ``(cfg, params)`` of a step (see :func:`resolve_step`) as host fp32 arrays."""
    directory = Path(directory).absolute()
    step = resolve_step(directory, step, best_metric=best_metric, best_mode=best_mode)
    meta = read_meta(directory, step)
    source = f"{directory}/{step}/{ITEM_META}"
    if meta.get("format") != FORMAT:
        logger.warning("%s: format %r, expected %r", source, meta.get("format"), FORMAT)
    cfg = DSparkConfig.from_speculators_dict(meta["config"], source=source)
    state = abstract_params(cfg)
    target = {"params": jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), nnx.to_pure_dict(state))}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    state_dir = directory / str(step) / ITEM_STATE
    if not state_dir.is_dir():
        raise CheckpointError(f"{state_dir.parent}: no '{ITEM_STATE}' item")
    try:
        with reads_finished_on_failure():
            restored = ocp.PyTreeCheckpointer().restore(
                state_dir,
                args=ocp.args.PyTreeRestore(
                    item=target, restore_args=restore_args, partial_restore=True
                ),
            )
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(
            f"{state_dir}: cannot restore state['params'] for the config in {source}: "
            f"{unreadable_reason(e, directory)}"
        ) from e
    _check_against_config(restored["params"], cfg, source=str(state_dir))
    nnx.replace_by_pure_dict(state, restored["params"])
    return LoadedParams(cfg=cfg, params=state, step=step, meta=meta)


# ------------------------------------------------------------------ vocab maps
def vocab_map_paths(directory: str | os.PathLike, cfg: DSparkConfig) -> tuple[Path, Path]:
    directory = Path(directory)
    vd = cfg.draft_vocab_size
    return directory / f"d2t-{vd}.npy", directory / f"t2d-{vd}.npy"


def save_checkpoint_vocab_maps(
    directory: str | os.PathLike, cfg: DSparkConfig, d2t: np.ndarray, t2d: np.ndarray
) -> tuple[Path, Path]:
    check_vocab_maps(
        d2t,
        t2d,
        draft_vocab_size=cfg.draft_vocab_size,
        verifier_vocab_size=cfg.vocab_size,
        source=f"{directory} vocab maps",
    )
    Path(directory).mkdir(parents=True, exist_ok=True)
    return save_vocab_maps(directory, d2t, t2d)


def load_checkpoint_vocab_maps(
    directory: str | os.PathLike,
    cfg: DSparkConfig,
    d2t_path: str | os.PathLike | None = None,
    t2d_path: str | os.PathLike | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The maps of a reduced-vocab checkpoint (explicit paths win); None for full vocab."""
    if not cfg.uses_draft_vocab:
        return None
    if (d2t_path is None) != (t2d_path is None):
        raise CheckpointError("give both d2t and t2d paths, or neither")
    if d2t_path is None:
        d2t_path, t2d_path = vocab_map_paths(directory, cfg)
    missing = [str(p) for p in (d2t_path, t2d_path) if not Path(p).exists()]
    if missing:
        raise CheckpointError(
            f"draft_vocab_size={cfg.draft_vocab_size} < vocab_size={cfg.vocab_size} needs the "
            f"vocab maps; not found: {missing} (pass --d2t/--t2d, e.g. from the data folder)"
        )
    d2t, t2d = np.load(d2t_path), np.load(t2d_path)
    check_vocab_maps(
        d2t,
        t2d,
        draft_vocab_size=cfg.draft_vocab_size,
        verifier_vocab_size=cfg.vocab_size,
        source=f"{d2t_path}, {t2d_path}",
    )
    return d2t.astype(np.int64), t2d.astype(np.bool_)


# ------------------------------------------------------------------ restores that fail cleanly
class _DrainingEventLoop(asyncio.SelectorEventLoop):
    """An event loop that finishes its tasks before it closes.

    Orbax runs a restore with ``loop.run_until_complete(coro)`` then ``loop.close()``
    (``orbax/checkpoint/_src/asyncio_utils.py::_run_sync_via_new_loop``). When one read
    fails (a truncated file), ``asyncio.gather`` raises at once and the other reads are
    left running on TensorStore's threads; they finish after the close, each printing
    "Event loop is closed" or "Task exception was never retrieved" with kilobytes of
    TensorStore spec, later, from anywhere. Here ``close`` first awaits them (their
    errors retrieved and dropped: the first one is already being raised)."""

    def close(self) -> None:
        if not self.is_running() and not self.is_closed():
            pending = [t for t in asyncio.all_tasks(self) if not t.done()]
            if pending:
                self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


class _DrainingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _DrainingEventLoop()


@contextlib.contextmanager
def reads_finished_on_failure():
    """Every event loop Orbax creates inside the block awaits its reads before closing,
    so a failed restore leaves nothing running behind it."""
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_DrainingPolicy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(previous)


_BYTE_RANGE = re.compile(
    r"Requested byte range \[(\d+), (\d+)\) is not valid for value of size (\d+)"
)
_LOCAL_FILE = re.compile(r'local file "([^"]*[^/"])"')


def unreadable_reason(error: BaseException, directory: str | os.PathLike) -> str:
    """Why a step does not restore, in words: the file (relative to ``directory``) and
    the cause ("truncated: 4210 of 8420 bytes"), never TensorStore's spec.
    ``--debug`` (``DSPARK_DEBUG``) gives the whole text instead."""
    from dspark_jax.cli import debug_enabled, one_line

    text = str(error)
    if debug_enabled():
        return " ".join(text.split())
    files = _LOCAL_FILE.findall(text)
    where = ""
    if files:
        path = Path(files[-1])
        try:
            where = f"{path.relative_to(Path(directory).absolute())}: "
        except ValueError:
            where = f"{path}: "
    truncated = _BYTE_RANGE.search(text)
    if truncated:
        return f"{where}truncated: {truncated[3]} of {truncated[2]} bytes"
    cause = re.split(r" \[tensorstore_spec", one_line(error))[0]
    if files:  # TensorStore's chain of "Error opening ..." ends with the cause itself
        cause = cause.rsplit(f'"{files[-1]}": ', 1)[-1]
    return f"{where}{cause}"[:200]
