"""Which parameters Muon optimises and which AdamW: speculators 0.9.0's
``split_named_params_for_muon`` rule, decided on each parameter's speculators key."""

from __future__ import annotations

from typing import Any

import jax

from dspark_jax.model.params import leaf_key

# speculators/train/optimizers.py::_ADAMW_NAME_HINTS
ADAMW_NAME_HINTS = ("embed_tokens", "lm_head", "codebook", "markov_w1", "markov_w2")


def is_muon_param(key: str, shape: tuple[int, ...]) -> bool:
    """speculators' split_named_params_for_muon rule, on a speculators key and torch shape."""
    return len(shape) == 2 and min(shape) > 1 and not any(hint in key for hint in ADAMW_NAME_HINTS)


def param_labels(params) -> Any:
    """Tree of ``"muon"`` / ``"adamw"`` labels (same structure as ``params``)."""

    def label(path, x):
        key, _ = leaf_key(path)
        return "muon" if is_muon_param(key, tuple(x.shape)) else "adamw"

    return jax.tree_util.tree_map_with_path(label, params)


def muon_param_keys(params) -> list[str]:
    """Speculators keys of the parameters Muon optimises (sorted), for logs and tests."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    keys = []
    for path, x in flat:
        key, _ = leaf_key(path)
        if is_muon_param(key, tuple(x.shape)):
            keys.append(key)
    return sorted(keys)
