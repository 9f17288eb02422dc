"""Orbax params -> a speculators 0.9.0 / vLLM drafter folder (``python -m converters export``).

The folder: ``config.json`` (``DSparkConfig.to_speculators_dict()``: the 0.9.0
schema, no top-level ``model_type``) and one ``model.safetensors`` (metadata
``{"format": "pt"}``, torch layout, floats in ``dtype``, bf16 by default). For a
reduced draft vocabulary it also holds ``lm_head.weight`` (the verifier head's rows
``t2d``, read from the verifier folder), ``d2t`` (int64) and ``t2d`` (bool), as
speculators' ``save_pretrained`` writes them.

The confidence head is always written in fp32 (vLLM holds it in fp32), and with a
calibration (``calibration.json`` of ``python -m dspark_jax.eval``) its weight and bias
are divided by the global temperature, so the served confidences are calibrated; the
record is copied into the folder. Every export also writes a model card ``README.md``
(:mod:`dspark_jax.convert.card`).

The folder is written under a temporary name, checked (:mod:`dspark_jax.convert.check`,
against the local verifier when one is given) and only then renamed into place: a
failed check leaves nothing at ``out_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from dspark_jax import file_mode, run_file
from dspark_jax.checkpoint.load import load_checkpoint
from dspark_jax.config import DSparkConfig
from dspark_jax.convert.card import CARD_FILE, CardInputs, model_card
from dspark_jax.convert.check import (
    CONFIG_FILE,
    SINGLE_FILE,
    TARGETS,
    CheckError,
    CheckReport,
    check_folder,
)
from dspark_jax.convert.vllm_rules import CALIBRATION_FILE
from dspark_jax.data.vocab import check_vocab_maps
from dspark_jax.eval import calibration as calib
from dspark_jax.model.params import to_speculators

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}


class ExportError(ValueError):
    """The export cannot be written (missing input, existing output)."""


def _verifier_lm_head(
    cfg: DSparkConfig, verifier_path: str | os.PathLike | None, t2d
) -> np.ndarray:
    from dspark_jax.verifier.frozen import load_verifier_tensors

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
        k: np.ascontiguousarray(np.asarray(v, np.float32).astype(_tensor_dtype(k, np_dtype)))
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


def _tensor_dtype(key: str, dtype):
    # vLLM holds the confidence head in fp32 (DSparkConfidenceHead): a bf16 copy only rounds it.
    return np.float32 if key.startswith("confidence_head.") else dtype


def fold_temperature(tensors: dict[str, np.ndarray], temperature: float) -> None:
    """Divide the confidence head by ``temperature`` in place (fp32): vLLM computes
    ``sigmoid(x @ w.T + b)`` and reads no temperature, and ``sigmoid((x @ w.T + b) / T)``
    equals ``sigmoid(x @ (w / T).T + b / T)``."""
    for key in ("confidence_head.proj.weight", "confidence_head.proj.bias"):
        value = np.asarray(tensors[key], np.float64) / float(temperature)
        tensors[key] = np.ascontiguousarray(value.astype(np.float32))


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
    confidence_temperature: float | None = None,
    calibration_record: dict | None = None,
    card: CardInputs | None = None,
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
      confidence_temperature: folded into the confidence head (:func:`fold_temperature`);
        ``calibration_record`` (its source) is then written as calibration.json.
      card: the model card's inputs beyond the config (default: the folder name only).
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
    extra_files = _calibrate(cfg, tensors, confidence_temperature, calibration_record)
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
        for name, text in extra_files.items():
            (tmp / name).write_text(text)
        file_mode.share(tmp / SINGLE_FILE)  # save_file creates it 0600
        report = check_folder(tmp, target=target, verifier=_local_verifier(target, verifier_path))
        report.folder = out_dir
        if not report.ok:
            raise CheckError(report)
        card = card or CardInputs(name=out_dir.name)
        card = dataclasses.replace(
            card,
            dtype=dtype,
            temperature=confidence_temperature,
            serve_commands=card_serve_commands(report, out_dir),
        )
        (tmp / CARD_FILE).write_text(model_card(_card_config(cfg), card))
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


def _local_verifier(target: str, verifier_path) -> Path | None:
    """The verifier the vLLM or llama.cpp check compares with: a local folder with
    config.json."""
    if target not in ("vllm", "llama.cpp") or verifier_path is None:
        return None
    path = Path(verifier_path)
    return path if (path / CONFIG_FILE).is_file() else None


def _calibrate(cfg: DSparkConfig, tensors, temperature, record) -> dict[str, str]:
    """Fold ``temperature`` into the head; the files that record it."""
    if temperature is None:
        return {}
    if not cfg.enable_confidence_head:
        raise ExportError(
            "a calibration temperature needs a confidence head (the drafter has none)"
        )
    if not (isinstance(temperature, (int, float)) and np.isfinite(temperature) and temperature > 0):
        raise ExportError(f"confidence temperature must be a positive number, got {temperature!r}")
    fold_temperature(tensors, temperature)
    record = {**(record or {}), "temperature": float(temperature), "folded_into_head": True}
    return {CALIBRATION_FILE: json.dumps(record, indent=2) + "\n"}


def read_calibration(path, cfg: DSparkConfig, step: int | None) -> dict:
    """A calibration.json of ``python -m dspark_jax.eval`` that fits this drafter."""
    try:
        record = calib.load_calibration(path)
    except ValueError as e:
        raise ExportError(f"--calibration {e}") from None
    for name in ("block_size", "sample_from_anchor"):
        if name in record and record[name] != getattr(cfg, name):
            raise ExportError(
                f"--calibration {path}: fitted for {name}={record[name]!r}, the drafter has "
                f"{getattr(cfg, name)!r}"
            )
    if step is not None and record.get("step") not in (None, step):
        raise ExportError(
            f"--calibration {path}: fitted on step {record['step']}, exporting step {step}"
        )
    return record


def read_eval_summary(eval_dir, cfg: DSparkConfig, step: int | None) -> dict:
    """``<eval_dir>/summary.json`` of ``python -m dspark_jax.eval`` for this drafter."""
    path = Path(eval_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"--eval-dir {path}: cannot read the eval summary ({e})") from None
    if not isinstance(summary, dict) or summary.get("format") != "dspark-jax/eval-v1":
        raise ExportError(f"--eval-dir {path}: not a dspark_jax.eval summary.json")
    if summary.get("block_size") != cfg.block_size or (
        step is not None and summary.get("step") not in (None, step)
    ):
        raise ExportError(
            f"--eval-dir {path}: evaluated block_size {summary.get('block_size')} at step "
            f"{summary.get('step')}, exporting block_size {cfg.block_size} at step {step}"
        )
    return summary


def export_checkpoint(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    step: int | str | None = "latest",
    best_metric: str = "loss",
    best_mode: str = "min",
    d2t_path: str | os.PathLike | None = None,
    t2d_path: str | os.PathLike | None = None,
    calibration: str | os.PathLike | None = None,
    eval_dir: str | os.PathLike | None = None,
    **kwargs,
) -> tuple[CheckReport, int]:
    """Export one step (an int, ``"latest"`` or ``"best"``) of an Orbax checkpoint.

    The vocab maps come from ``d2t_path``/``t2d_path`` or the checkpoint root
    (``d2t-<Vd>.npy``/``t2d-<Vd>.npy``). ``calibration``: an eval ``calibration.json``
    whose global temperature is folded into the confidence head. ``eval_dir``: the eval
    output folder whose acceptance table goes into the model card. Other keyword
    arguments: :func:`export_params`. Returns the check report and the step exported.
    """
    check_destination(Path(out_dir), kwargs.get("overwrite", False), protect=(Path(ckpt_dir),))
    loaded = load_checkpoint(
        ckpt_dir, step, best_metric=best_metric, best_mode=best_mode,
        d2t_path=d2t_path, t2d_path=t2d_path,
    )  # fmt: skip
    maps = loaded.vocab_maps
    card = _card_inputs(
        ckpt_dir, out_dir, loaded.step, loaded.meta, kwargs.get("verifier_name_or_path")
    )
    if eval_dir is not None:
        card = dataclasses.replace(
            card, eval_summary=read_eval_summary(eval_dir, loaded.cfg, loaded.step)
        )
    if calibration is not None:
        record = read_calibration(calibration, loaded.cfg, loaded.step)
        kwargs.update(confidence_temperature=record["temperature"], calibration_record=record)
        card = dataclasses.replace(card, calibration=record)
    report = export_params(loaded.cfg, loaded.params, out_dir, vocab_maps=maps, card=card, **kwargs)
    return report, loaded.step


# The card is published with the folder (a Hub model repository): it names the verifier
# by its Hub id and the folder by a relative path, never a path of the training machine.
def _portable(value: Any, run_dir: Path) -> Any:
    """An absolute path as a path relative to ``run_dir`` (lists element-wise)."""
    if isinstance(value, list):
        return [_portable(v, run_dir) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        return os.path.relpath(value, run_dir)
    return value


def _card_config(cfg):
    """The config the card shows: a verifier recorded as a local path is named by its
    folder's name (``--verifier-name`` records the Hub id instead)."""
    name = cfg.verifier_name_or_path
    if name and os.path.isabs(name):
        return cfg.replace(verifier_name_or_path=Path(name).name)
    return cfg


def card_serve_commands(report: CheckReport, out_dir: Path) -> tuple[str, ...]:
    """The report's serve commands as the card shows them: the folder as a relative path
    (its name when given absolute), the verifier as config.json names it (a local
    verifier path by its folder's name)."""
    if not report.ok or report.serving is None:
        return ()
    folder = Path(out_dir.name) if Path(out_dir).is_absolute() else Path(out_dir)
    name = report.config.verifier_name_or_path if report.config is not None else None
    if name and os.path.isabs(name):
        name = Path(name).name
    portable = dataclasses.replace(
        report, folder=folder, serving={**report.serving, "verifier": name}
    )
    return tuple(portable.commands)


def _card_inputs(ckpt_dir, out_dir, step: int, meta: dict, verifier_name: str | None) -> CardInputs:
    """The training command and sequence length of the run, from its run.yaml (which
    holds the flags given) and the step's meta (the resolved sequence length)."""
    run_yaml = Path(ckpt_dir) / run_file.RUN_FILE
    if not run_yaml.is_file():
        return CardInputs(
            name=Path(out_dir).name, step=step, total_seq_len=meta.get("total_seq_len")
        )
    try:
        values = run_file.load(run_yaml)
    except ValueError as e:
        raise ExportError(str(e)) from None
    # Paths relative to the run (the checkpoint directory, where run.yaml lies).
    run_dir = Path(ckpt_dir).absolute()
    values = {k: _portable(v, run_dir) for k, v in values.items()}
    if verifier_name is not None and "verifier_name_or_path" in values:
        values["verifier_name_or_path"] = verifier_name
    return CardInputs(
        name=Path(out_dir).name,
        step=step,
        train_command=run_file.command(values),
        total_seq_len=values.get("total_seq_len", meta.get("total_seq_len")),
    )
