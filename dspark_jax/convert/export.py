"""Orbax params -> a speculators 0.9.0 / vLLM drafter folder (``python -m converters export``).

The folder: ``config.json`` (``DSparkConfig.to_speculators_dict()``: the 0.9.0
schema, no top-level ``model_type``) and one ``model.safetensors`` (metadata
``{"format": "pt"}``, torch layout, floats in ``dtype``, bf16 by default). For a
reduced draft vocabulary it also holds ``lm_head.weight`` (the verifier head's rows
``t2d``, read from the verifier folder), ``d2t`` (int64) and ``t2d`` (bool), as
speculators' ``save_pretrained`` writes them.

The folder is written under a temporary name, checked (:mod:`dspark_jax.convert.check`)
and only then renamed into place: a failed check leaves nothing at ``out_dir``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from dspark_jax import file_mode
from dspark_jax.config import DSparkConfig
from dspark_jax.convert.check import (
    CONFIG_FILE,
    SINGLE_FILE,
    TARGETS,
    CheckError,
    CheckReport,
    check_folder,
)
from dspark_jax.data.vocab import check_vocab_maps
from dspark_jax.model.params import to_speculators
from dspark_jax.train import checkpoint

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}


class ExportError(ValueError):
    """The export cannot be written (missing input, existing output)."""


def _verifier_lm_head(
    cfg: DSparkConfig, verifier_path: str | os.PathLike | None, t2d
) -> np.ndarray:
    from dspark_jax.data.verifier import load_verifier_tensors

    path = verifier_path or cfg.verifier_name_or_path
    if path is None or not Path(path).is_dir():
        raise ExportError(
            f"draft_vocab_size={cfg.draft_vocab_size} < vocab_size={cfg.vocab_size}: the folder "
            "needs lm_head.weight, the verifier head's rows t2d; pass the local verifier folder "
            f"(--verifier-path), got {path!r}"
        )
    head = load_verifier_tensors(path, t2d).lm_head
    if head.shape != (cfg.draft_vocab_size, cfg.hidden_size):
        raise ExportError(
            f"{path}: verifier head rows have shape {head.shape}, expected "
            f"{(cfg.draft_vocab_size, cfg.hidden_size)}"
        )
    return head


def folder_tensors(
    cfg: DSparkConfig,
    params: nnx.State,
    *,
    dtype: str = "bfloat16",
    vocab_maps: tuple[np.ndarray, np.ndarray] | None = None,
    lm_head: np.ndarray | None = None,
    verifier_path: str | os.PathLike | None = None,
) -> dict[str, np.ndarray]:
    """``{key: array}`` of the exported ``model.safetensors`` (torch layout)."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    np_dtype = DTYPES[dtype]
    tensors = {
        k: np.ascontiguousarray(np.asarray(v, np.float32).astype(np_dtype))
        for k, v in to_speculators(params).items()
    }
    if cfg.uses_draft_vocab:
        if vocab_maps is None:
            raise ExportError(
                f"draft_vocab_size={cfg.draft_vocab_size} < vocab_size={cfg.vocab_size} needs "
                "the d2t/t2d vocab maps"
            )
        d2t, t2d = vocab_maps
        check_vocab_maps(
            d2t, t2d, draft_vocab_size=cfg.draft_vocab_size, verifier_vocab_size=cfg.vocab_size
        )
        if lm_head is None:
            lm_head = _verifier_lm_head(cfg, verifier_path, t2d)
        tensors["lm_head.weight"] = np.ascontiguousarray(np.asarray(lm_head).astype(np_dtype))
        tensors["d2t"] = np.ascontiguousarray(d2t, dtype=np.int64)
        tensors["t2d"] = np.ascontiguousarray(t2d, dtype=np.bool_)
    return tensors


def _new_partial_dir(out_dir: Path) -> Path:
    """A fresh sibling folder made by ``mkdir`` (umask mode; ``mkdtemp`` would give 0700)."""
    while True:
        tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def not_an_export(out_dir: Path, protect: tuple[Path, ...] = ()) -> str | None:
    """Why ``--overwrite`` may not remove ``out_dir`` (None: it is an earlier export).

    An export folder holds files only, among them a speculators ``config.json``; it is
    never a checkpoint directory, nor one of ``protect`` or a folder above them.
    """
    if out_dir.is_symlink() or not out_dir.is_dir():
        return "is not a folder (a file or a link)"
    here = out_dir.resolve()
    for path in protect:
        path = Path(path).resolve()
        if here == path or here in path.parents:
            return f"is {path} or a folder above it (the checkpoint being exported)"
    subdirs = sorted(p.name for p in out_dir.iterdir() if p.is_dir())
    if subdirs:
        return f"holds folders ({', '.join(subdirs[:4])}); an export holds files only"
    try:
        config = json.loads((out_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict) or "speculators_model_type" not in config:
        return f"has no {CONFIG_FILE} with speculators_model_type"
    return None


def check_destination(out_dir: Path, overwrite: bool, protect: tuple[Path, ...] = ()) -> None:
    """Refuse an existing ``out_dir`` unless ``overwrite`` and it is an earlier export."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not overwrite:
        raise ExportError(f"{out_dir} exists (pass --overwrite to replace an earlier export)")
    why = not_an_export(out_dir, protect)
    if why:
        raise ExportError(
            f"--overwrite refused: {out_dir} {why}; only an earlier export folder is replaced"
        )


def export_params(
    cfg: DSparkConfig,
    params: nnx.State,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    vocab_maps: tuple[np.ndarray, np.ndarray] | None = None,
    lm_head: np.ndarray | None = None,
    verifier_path: str | os.PathLike | None = None,
    verifier_name_or_path: str | None = None,
    verifier_architectures: list[str] | tuple[str, ...] | None = None,
    target: str = "vllm",
    overwrite: bool = False,
) -> CheckReport:
    """Write ``out_dir`` from trainable ``params`` (``nnx.state(model, nnx.Param)``).

    Args:
      vocab_maps: ``(d2t, t2d)``, needed when the draft vocab is reduced.
      lm_head: [Vd, H] draft head rows; default: read from ``verifier_path`` (or the
        config's verifier path when it is a local folder).
      verifier_name_or_path / verifier_architectures: recorded in config.json
        (default: the config's).
      target: ``"vllm"`` (default) or ``"speculators"``: what the folder is checked
        against. A failed check raises :class:`CheckError` and writes nothing.
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    out_dir = Path(out_dir)
    check_destination(out_dir, overwrite)
    changes = {}
    if verifier_name_or_path is not None:
        changes["verifier_name_or_path"] = str(verifier_name_or_path)
    if verifier_architectures is not None:
        changes["verifier_architectures"] = tuple(verifier_architectures)
    cfg = cfg.replace(**changes)
    tensors = folder_tensors(
        cfg,
        params,
        dtype=dtype,
        vocab_maps=vocab_maps,
        lm_head=lm_head,
        verifier_path=verifier_path,
    )
    config = cfg.to_speculators_dict()
    config["dtype"] = dtype

    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = _new_partial_dir(out_dir)
    except OSError as e:  # read-only, or a file on the way: name the destination
        raise ExportError(f"cannot write {out_dir}: {e.strerror} ({e.filename})") from e
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        file_mode.share(tmp / SINGLE_FILE)  # save_file creates it 0600
        report = check_folder(tmp, target=target)
        report.folder = out_dir
        if not report.ok:
            raise CheckError(report)
        if out_dir.exists():
            check_destination(out_dir, overwrite)  # still an export, just before removing it
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    for w in report.warnings:
        logger.warning("%s: %s", out_dir, w)
    return report


def export_checkpoint(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    step: int | str | None = "latest",
    best_metric: str = "loss",
    best_mode: str = "min",
    d2t_path: str | os.PathLike | None = None,
    t2d_path: str | os.PathLike | None = None,
    **kwargs,
) -> tuple[CheckReport, int]:
    """Export one step (an int, ``"latest"`` or ``"best"``) of an Orbax checkpoint.

    The vocab maps come from ``d2t_path``/``t2d_path`` or the checkpoint root
    (``d2t-<Vd>.npy``/``t2d-<Vd>.npy``). Other keyword arguments: :func:`export_params`.
    Returns the check report and the step exported.
    """
    check_destination(Path(out_dir), kwargs.get("overwrite", False), protect=(Path(ckpt_dir),))
    loaded = checkpoint.load_params(ckpt_dir, step, best_metric=best_metric, best_mode=best_mode)
    maps = checkpoint.load_checkpoint_vocab_maps(ckpt_dir, loaded.cfg, d2t_path, t2d_path)
    report = export_params(loaded.cfg, loaded.params, out_dir, vocab_maps=maps, **kwargs)
    return report, loaded.step
