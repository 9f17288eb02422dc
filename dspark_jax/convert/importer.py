"""A speculators drafter folder -> an Orbax params checkpoint (``python -m converters import``).

The folder is read by the one drafter loader (:func:`dspark_jax.checkpoint.load.read_drafter`:
a DSpark folder as is, a DFlash folder as a warm start with fresh DSpark heads). The
result is what ``dspark_jax.train --from-pretrained`` starts from: step ``step`` of a
params-only checkpoint (:mod:`dspark_jax.checkpoint.orbax_io`), plus
``d2t-<Vd>.npy``/``t2d-<Vd>.npy`` in the checkpoint root for a reduced vocabulary.
The draft ``lm_head`` is not stored (training re-reads the verifier head).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from flax import nnx

from dspark_jax.checkpoint import orbax_io
from dspark_jax.checkpoint.folder import ImportFolderError
from dspark_jax.checkpoint.load import WarmStart, read_drafter
from dspark_jax.config import DSparkConfig


@dataclasses.dataclass(frozen=True)
class ImportResult:
    cfg: DSparkConfig
    params: nnx.State
    kind: str  # "dspark" or "dflash"
    step_dir: Path
    vocab_maps: tuple[Path, Path] | None


def _is_import_step(path: Path) -> bool:
    try:
        return "source_type" in orbax_io.read_meta(path.parent, int(path.name))
    except (orbax_io.CheckpointError, ValueError, OSError):
        return False


def check_destination(ckpt_dir: Path, overwrite: bool) -> None:
    """Import only into a new or empty directory or, with ``overwrite``, over an earlier
    import: Orbax would skip the step beside a run's later steps while the run's vocab
    maps were overwritten, so a training run's directory is never written into."""
    if not ckpt_dir.exists():
        return
    if not ckpt_dir.is_dir():
        raise ImportFolderError(f"{ckpt_dir} is a file; expected a new or empty directory")
    entries = sorted(ckpt_dir.iterdir())
    if not entries:
        return
    if not overwrite:
        names = ", ".join(p.name for p in entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise ImportFolderError(
            f"{ckpt_dir} is not empty ({names}); import into a new or empty directory "
            "(--overwrite replaces a step of an earlier import only)"
        )
    foreign = [p.name for p in entries if p.name.isdigit() and not _is_import_step(p)]
    if foreign or (ckpt_dir / "run.yaml").exists():
        raise ImportFolderError(
            f"{ckpt_dir} holds a training run (steps {foreign or 'and run.yaml'}), not an "
            "earlier import; --overwrite replaces imported steps only"
        )


def import_folder(
    src: str | os.PathLike,
    ckpt_dir: str | os.PathLike,
    *,
    step: int = 0,
    warm_start: WarmStart | None = None,
    verifier_path: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> ImportResult:
    """Import ``src`` into step ``step`` of the Orbax checkpoint ``ckpt_dir``.

    ``warm_start``: head options for a DFlash source (default :class:`WarmStart`);
    non-default options for a DSpark source raise (its heads come from the folder).
    """
    src = Path(src)
    check_destination(Path(ckpt_dir), overwrite)
    drafter = read_drafter(src, warm_start=warm_start, verifier_path=verifier_path)
    cfg, kind, maps = drafter.cfg, drafter.kind, drafter.vocab_maps

    meta = {"source": str(src.absolute()), "source_type": kind}
    if kind == "dflash":
        meta["warm_start"] = dataclasses.asdict(warm_start or WarmStart())
    vocab_paths = None
    if maps is not None:
        vocab_paths = orbax_io.vocab_map_paths(ckpt_dir, cfg)
        meta["vocab_maps"] = {"d2t": vocab_paths[0].name, "t2d": vocab_paths[1].name}
    step_dir = orbax_io.save_params_checkpoint(
        ckpt_dir, step, cfg, drafter.params, meta=meta, overwrite=overwrite
    )
    if maps is not None:
        vocab_paths = orbax_io.save_checkpoint_vocab_maps(ckpt_dir, cfg, *maps)
    return ImportResult(
        cfg=cfg, params=drafter.params, kind=kind, step_dir=step_dir, vocab_maps=vocab_paths
    )
