"""An HF model folder on disk (a verifier, or a speculators drafter): its file names, its
``config.json`` and where each safetensors tensor lies. The one reader of the layout;
what is read from the tensors is each caller's (the frozen verifier tensors, the in-step
verifier's parameters, a drafter folder).

The weights are one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (docs/formats.md). numpy, json and safetensors only:
the converter's check imports this module too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import safe_open

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def text_config(config: dict) -> dict:
    """The language model's part of an HF config: its ``text_config`` when it nests one
    (multimodal models: Gemma 3, Qwen2.5-VL, ...), else the config itself."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def read_config(folder: str | os.PathLike) -> dict | None:
    """``config.json`` of ``folder`` as a dict, or None when missing or unreadable."""
    try:
        config = json.loads((Path(folder) / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return config if isinstance(config, dict) else None


def _index(folder: Path, error: type[Exception]) -> dict[str, str] | None:
    index = folder / INDEX_FILE
    if not index.exists():
        return None
    try:
        return dict(json.loads(index.read_text())["weight_map"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise error(f"{index}: no valid weight_map ({e})") from None


def weight_map(folder: str | os.PathLike, error: type[Exception] = ValueError) -> dict[str, str]:
    """``{tensor key: file name}``: the index's, else the single file's keys (its header
    only). Raises ``error`` naming the file when neither is readable."""
    folder = Path(folder)
    wmap = _index(folder, error)
    if wmap is not None:
        return wmap
    single = folder / SINGLE_FILE
    if not single.exists():
        raise error(f"{folder}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
    try:
        with safe_open(single, "np") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    except Exception as e:  # safetensors' own error type (truncated, bad header)
        raise error(f"{single}: not a readable safetensors file ({e})") from None


def weight_files(
    folder: str | os.PathLike, error: type[Exception] = ValueError
) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files a loader reads (all of ``*.safetensors`` unless an index
    lists them, as vLLM does), and the index weight map if any."""
    folder = Path(folder)
    wmap = _index(folder, error)
    if wmap is not None:
        return sorted({folder / f for f in wmap.values()}), wmap
    return sorted(folder.glob("*.safetensors")), None


def has_weights(folder: str | os.PathLike) -> bool:
    return (Path(folder) / SINGLE_FILE).is_file() or (Path(folder) / INDEX_FILE).is_file()
