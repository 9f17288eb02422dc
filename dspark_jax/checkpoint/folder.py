"""A speculators drafter folder on disk: reading it (its layout: :mod:`dspark_jax.hf_folder`).

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

from dspark_jax.hf_folder import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, weight_files


class ImportFolderError(ValueError):
    """The source folder cannot be imported (named file/tensor/field in the message)."""


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
    files, _ = weight_files(folder, ImportFolderError)
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
