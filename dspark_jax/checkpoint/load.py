"""The one drafter loader: an Orbax checkpoint directory or a speculators folder ->
config, trainable params and vocab maps (used by ``--from-pretrained`` and eval)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import numpy as np
from flax import nnx

from dspark_jax.checkpoint import orbax_io as checkpoint
from dspark_jax.config import DSparkConfig
from dspark_jax.convert.check import INDEX_FILE, SINGLE_FILE
from dspark_jax.convert.importer import ImportFolderError, import_folder
from dspark_jax.model.params import to_host


class DrafterLoadError(ValueError):
    """The path holds no loadable drafter (the message names the path and the problem)."""


@dataclasses.dataclass(frozen=True)
class LoadedDrafter:
    cfg: DSparkConfig
    params: nnx.State  # trainable parameters, host numpy arrays
    step: int | None  # the checkpoint step; None for a speculators folder
    vocab_maps: tuple[np.ndarray, np.ndarray] | None  # (d2t, t2d) for a reduced vocab
    source: str  # what was loaded, for logs and reports


def has_checkpoint_steps(path: Path) -> bool:
    """A training ``--save-path`` holds config.json beside numbered step folders: that is
    a checkpoint, not a speculators folder."""
    return any(p.is_dir() and p.name.isdigit() for p in path.iterdir())


def has_weights(path: Path) -> bool:
    return (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()


def load_drafter(
    path: str | os.PathLike,
    step: int | str | None = "latest",
    *,
    verifier_path: str | os.PathLike | None = None,
    d2t_path: str | os.PathLike | None = None,
    t2d_path: str | os.PathLike | None = None,
) -> LoadedDrafter:
    """Load step ``step`` (N, ``latest`` or ``best``) of an Orbax checkpoint, or a
    speculators folder (config.json + model.safetensors; ``step`` is ignored).

    A folder is imported as ``python -m converters import`` would, with the same checks
    (``verifier_path``: compare its lm_head with the verifier's rows). Explicit
    ``d2t_path``/``t2d_path`` win over the maps stored with the drafter.
    """
    path = Path(path)
    if not path.is_dir():
        raise DrafterLoadError(f"{path}: no such directory")
    try:
        if not has_checkpoint_steps(path) and has_weights(path):
            with tempfile.TemporaryDirectory(prefix="dspark-load-") as tmp:
                ckpt = Path(tmp) / "ckpt"
                import_folder(path, ckpt, verifier_path=verifier_path)
                loaded = checkpoint.load_params(ckpt, 0)
                maps = checkpoint.load_checkpoint_vocab_maps(ckpt, loaded.cfg, d2t_path, t2d_path)
            return LoadedDrafter(
                loaded.cfg, to_host(loaded.params), None, maps, f"speculators folder {path}"
            )
        loaded = checkpoint.load_params(path, step)
        maps = checkpoint.load_checkpoint_vocab_maps(path, loaded.cfg, d2t_path, t2d_path)
    except (ImportFolderError, checkpoint.CheckpointError) as e:
        raise DrafterLoadError(str(e)) from None
    return LoadedDrafter(
        loaded.cfg, loaded.params, loaded.step, maps, f"Orbax checkpoint {path} step {loaded.step}"
    )
