"""The one table between our Flax parameter paths and speculators' tensor keys.

Paths mirror the keys, so the mapping is three rules on the last path element:

| Flax path (``/``-joined)            | speculators key (``.``-joined) | transform        |
| ----------------------------------- | ------------------------------ | ---------------- |
| ``.../kernel`` (nnx.Linear)          | ``.../weight``                  | transpose [out,in] |
| ``.../embedding`` (nnx.Embed)        | ``.../weight``                  | none             |
| ``.../weight``, ``.../bias``         | same                           | none             |

No torch: used by the optimiser partition, the checkpoint and converters, and the tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import numpy as np
from flax import nnx


def speculators_key(path: Iterable) -> tuple[str, bool]:
    """(key, transpose) for a Flax parameter path such as ('layers', 0, 'mlp', 'up_proj', 'kernel')."""
    parts = [str(p) for p in path]
    leaf = parts[-1]
    if leaf == "kernel":
        return ".".join(parts[:-1] + ["weight"]), True
    if leaf == "embedding":
        return ".".join(parts[:-1] + ["weight"]), False
    if leaf in ("weight", "bias"):
        return ".".join(parts), False
    raise KeyError(f"no speculators key for parameter path {'/'.join(parts)!r}")


def path_parts(path: Iterable) -> list[str]:
    """A JAX key path of a parameter leaf -> its name parts (drops nnx.Variable's ``value``)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    if len(parts) > 1 and parts[-1] in ("value", "raw_value"):
        parts = parts[:-1]
    return parts


def leaf_key(path: Iterable) -> tuple[str, bool]:
    """(speculators key, stored transposed w.r.t. torch) of a parameter leaf's JAX key path."""
    return speculators_key(path_parts(path))


def to_speculators(params: nnx.State) -> dict[str, np.ndarray]:
    """Trainable parameter state -> {speculators key: array in torch layout}."""
    out: dict[str, np.ndarray] = {}
    for path, var in nnx.to_flat_state(params):
        key, transpose = speculators_key(path)
        value = np.asarray(var[...] if hasattr(var, "get_value") else var)
        out[key] = value.T if transpose else value
    return out


def from_speculators(
    tensors: Mapping[str, np.ndarray],
    params: nnx.State,
    *,
    keep_missing: tuple[str, ...] = (),
) -> nnx.State:
    """Fill ``params`` (a state of the right structure) from speculators tensors.

    Raises naming the key on a missing tensor or a shape mismatch; extra tensors
    are left to the caller to judge (the converter's check does). Parameters whose
    key starts with one of ``keep_missing`` may be absent from ``tensors``: they keep
    their value in ``params`` (a warm start's freshly initialised heads).
    """
    flat = nnx.to_flat_state(params)
    updates = []
    for path, var in flat:
        key, transpose = speculators_key(path)
        if keep_missing and key not in tensors and key.startswith(keep_missing):
            updates.append((path, var))
            continue
        if key not in tensors:
            raise KeyError(f"missing tensor {key!r} (for parameter {'/'.join(map(str, path))})")
        value = np.asarray(tensors[key])
        value = value.T if transpose else value
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(
                f"tensor {key!r}: expected shape {tuple(var.shape)[::-1] if transpose else tuple(var.shape)} "
                f"(torch layout), got {tuple(np.asarray(tensors[key]).shape)}"
            )
        updates.append((path, var.replace(value.astype(var.dtype))))
    return nnx.from_flat_state(updates)


def to_host(params: nnx.State) -> nnx.State:
    """The same state with every leaf copied to a host numpy array."""
    return nnx.from_flat_state(
        [(p, v.replace(np.asarray(v[...]))) for p, v in nnx.to_flat_state(params)]
    )
