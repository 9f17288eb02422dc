"""A speculators drafter folder on disk: its file names and reading it.

The folder vLLM serves and speculators' ``save_pretrained`` writes: ``config.json``
and the weights, one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (docs/formats.md). Written by
:mod:`dspark_jax.convert.export`, checked by :mod:`dspark_jax.convert.check`, turned
into a drafter by :mod:`dspark_jax.checkpoint.load`.

numpy + safetensors only (no JAX): the converter's check imports this module too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors reads BF16)
import numpy as np
from safetensors import safe_open

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class ImportFolderError(ValueError):
    """The source folder cannot be imported (named file/tensor/field in the message)."""


def weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files a loader reads (all of ``*.safetensors`` unless an index
    lists them, as vLLM does), and the index weight map if any."""
    index = folder / INDEX_FILE
    if index.exists():
        try:
            wmap = dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{index}: no valid weight_map ({e})") from None
        return sorted({folder / f for f in wmap.values()}), wmap
    return sorted(folder.glob("*.safetensors")), None


def has_weights(path: Path) -> bool:
    return (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()


def read_folder(folder: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """``(config.json dict, {key: array})`` of a speculators folder (single file or sharded)."""
    folder = Path(folder)
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.exists():
        raise ImportFolderError(f"{folder}: no {CONFIG_FILE}")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ImportFolderError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ImportFolderError(f"{cfg_path}: expected a JSON object, got {type(config).__name__}")
    try:
        files, _ = weight_files(folder)
    except ValueError as e:
        raise ImportFolderError(str(e)) from None
    if not files:
        raise ImportFolderError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        if not path.exists():
            raise ImportFolderError(
                f"{folder}/{INDEX_FILE} lists {path.name}, which does not exist"
            )
        try:
            with safe_open(path, "np") as f:
                for key in f.keys():
                    if key in tensors:
                        raise ImportFolderError(
                            f"{folder}: tensor {key!r} is in more than one file"
                        )
                    tensors[key] = f.get_tensor(key)
        except ImportFolderError:
            raise
        except Exception as e:  # safetensors' own error type (truncated, bad header)
            raise ImportFolderError(f"{path}: not a readable safetensors file ({e})") from None
    return config, tensors
