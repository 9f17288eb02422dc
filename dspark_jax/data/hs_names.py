"""The names in a hidden-states folder (docs/formats.md, "Hidden-state files"), shared by
the writer (``launch/``, PyTorch) and the reader (:mod:`dspark_jax.data.files`).

Standard library only, so that the extraction side imports it without JAX.
"""

from __future__ import annotations

import os
from pathlib import Path

HIDDEN_STATES_KEY = "hidden_states"  # [T, n_aux + 1, H]
TOKEN_IDS_KEY = "token_ids"  # [T]
SCALES_KEY = "hidden_states_scales"  # fp8 files only: per-token scales
EXTRACTION_CONFIG = "extraction_config.json"  # layer ids, hidden size, dtype of the files


def hs_name(index: int) -> str:
    """The file of prepared row ``index``."""
    return f"hs_{index}.safetensors"


def hs_path(hidden_states_dir: str | os.PathLike, index: int) -> Path:
    return Path(hidden_states_dir) / hs_name(index)
