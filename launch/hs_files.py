"""Hidden-state files (``hs_{i}.safetensors``), as docs/formats.md defines them.

One file per prepared row ``i``:

* ``hidden_states``: ``[T, n_aux + 1, H]`` in the verifier dtype; slot ``j`` is the
  residual stream after ``layer_ids[j]`` decoder layers, the last slot the last
  decoder layer's output before the final norm;
* ``token_ids``: int64 ``[T]``, equal to the row's ``input_ids``;
* optional (fp8 connector): ``hidden_states`` float8_e4m3fn plus
  ``hidden_states_scales`` fp32 ``[T, 1, 1]``.

Files are only ever created by an atomic rename of a fully written and fsynced
temporary file (``.hs_{i}.safetensors.partial-<pid>``, a name no reader lists), so
an interrupted run never leaves a partial file under a final name.

Beside the files, ``extraction_config.json`` records the layer ids, hidden size,
dtype and model that produced them; a later run into the same folder with other
settings is refused instead of mixing files.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dspark_jax import file_mode

# The folder's names have one owner, shared with the JAX reader (no JAX imported).
from dspark_jax.data.hs_names import (  # noqa: F401 (re-exported to launch/)
    EXTRACTION_CONFIG,
    HIDDEN_STATES_KEY,
    SCALES_KEY,
    TOKEN_IDS_KEY,
    hs_name,
    hs_path,
)

CONFIG_NAME = EXTRACTION_CONFIG
PARTIAL_RE = re.compile(r"^\.hs_\d+\.safetensors\.partial-\d+$")
FINAL_RE = re.compile(r"^hs_(\d+)\.safetensors$")
log = logging.getLogger("launch.hs_files")

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None),
}


class HiddenStatesError(ValueError):
    """A hidden-state file or payload that does not match what is expected."""


def partial_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.partial-{os.getpid()}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dt = _DTYPES.get(name)
    if dt is None:
        raise ValueError(
            f"unsupported hidden-state dtype {name!r}; expected one of {list(_DTYPES)}"
        )
    return dt


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit_file(tmp: Path, final: Path) -> None:
    """fsync ``tmp`` and rename it to ``final`` (same folder, atomic), readable by others
    per the umask (safetensors writes 0600)."""
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    file_mode.share(tmp)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def save_hidden_states(
    path: str | Path,
    hidden_states: torch.Tensor,
    token_ids: torch.Tensor | Sequence[int],
) -> Path:
    """Write one ``hs_{i}.safetensors`` atomically. ``hidden_states``: [T, n, H]."""
    path = Path(path)
    if not isinstance(token_ids, torch.Tensor):
        token_ids = torch.tensor(list(token_ids), dtype=torch.long)
    tensors = {
        HIDDEN_STATES_KEY: hidden_states.detach().to("cpu").contiguous(),
        TOKEN_IDS_KEY: token_ids.detach().to("cpu", torch.long).contiguous(),
    }
    check_payload(tensors, tensors[TOKEN_IDS_KEY].tolist(), where=str(path))
    tmp = partial_path(path)
    try:
        save_file(tensors, str(tmp))
        commit_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def check_payload(
    tensors: dict[str, torch.Tensor],
    expected_tokens: Sequence[int] | None,
    *,
    num_slots: int | None = None,
    hidden_size: int | None = None,
    dtype: str | None = None,
    where: str = "payload",
    check_finite: bool = True,
) -> None:
    """Raise :class:`HiddenStatesError` naming ``where`` and the field at fault."""
    missing = {HIDDEN_STATES_KEY, TOKEN_IDS_KEY} - tensors.keys()
    if missing:
        raise HiddenStatesError(
            f"{where}: missing tensor(s) {sorted(missing)}; found {sorted(tensors)}"
        )
    hs, tok = tensors[HIDDEN_STATES_KEY], tensors[TOKEN_IDS_KEY]
    if tok.dtype != torch.long or tok.ndim != 1:
        raise HiddenStatesError(
            f"{where}: token_ids must be int64 [T], got {tok.dtype} {list(tok.shape)}"
        )
    if hs.ndim != 3:
        raise HiddenStatesError(
            f"{where}: hidden_states must be [T, n_aux+1, H], got {list(hs.shape)}"
        )
    if expected_tokens is not None:
        got = tok.tolist()
        if got != list(expected_tokens):
            first = next(
                (k for k, (a, b) in enumerate(zip(got, expected_tokens)) if a != b),
                min(len(got), len(expected_tokens)),
            )
            raise HiddenStatesError(
                f"{where}: token_ids do not match the row's input_ids (lengths {len(got)} vs "
                f"{len(expected_tokens)}, first difference at position {first})"
            )
    if hs.shape[0] != tok.shape[0]:
        raise HiddenStatesError(
            f"{where}: hidden_states has {hs.shape[0]} positions but token_ids has {tok.shape[0]}"
        )
    if num_slots is not None and hs.shape[1] != num_slots:
        raise HiddenStatesError(
            f"{where}: hidden_states has {hs.shape[1]} layer slots, "
            f"expected {num_slots} (n_aux + 1)"
        )
    if hidden_size is not None and hs.shape[2] != hidden_size:
        raise HiddenStatesError(f"{where}: hidden size {hs.shape[2]}, expected {hidden_size}")
    is_fp8 = SCALES_KEY in tensors
    if dtype is not None and not is_fp8 and dtype_name(hs.dtype) != dtype:
        raise HiddenStatesError(
            f"{where}: hidden_states dtype {dtype_name(hs.dtype)}, expected {dtype}"
        )
    if is_fp8:
        sc = tensors[SCALES_KEY]
        if list(sc.shape) != [hs.shape[0], 1, 1]:
            raise HiddenStatesError(
                f"{where}: {SCALES_KEY} must be [T, 1, 1], got {list(sc.shape)}"
            )
    if check_finite and hs.numel():
        values = hs.float() if not is_fp8 else hs.float() * tensors[SCALES_KEY].float()
        if not bool(torch.isfinite(values).all()):
            raise HiddenStatesError(f"{where}: hidden_states contain non-finite values")


def load_and_check(
    path: str | Path,
    expected_tokens: Sequence[int] | None,
    *,
    num_slots: int | None = None,
    hidden_size: int | None = None,
    dtype: str | None = None,
) -> dict[str, torch.Tensor]:
    """Load a whole file and check it (token ids, shapes, dtype, finiteness)."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises its own error types
        raise HiddenStatesError(f"{path}: unreadable safetensors file ({e})") from e
    check_payload(
        tensors,
        expected_tokens,
        num_slots=num_slots,
        hidden_size=hidden_size,
        dtype=dtype,
        where=str(path),
    )
    return tensors


def existing_indices(directory: str | Path) -> list[int]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    out = []
    for entry in os.scandir(directory):
        m = FINAL_RE.match(entry.name)
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


def remove_partials(directory: str | Path) -> int:
    """Delete temporary files left by an interrupted run; return how many."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    n = 0
    for entry in os.scandir(directory):
        if PARTIAL_RE.match(entry.name):
            Path(entry.path).unlink(missing_ok=True)
            n += 1
    return n


def write_or_check_config(directory: str | Path, config: dict) -> None:
    """Record the extraction settings, or refuse settings that differ from the
    ones already recorded in ``directory`` (which would mix incompatible files)."""
    directory = Path(directory)
    path = directory / CONFIG_NAME
    keys = ("layer_ids", "hidden_size", "num_hidden_layers")
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), config.get(k)) for k in keys if old.get(k) != config.get(k)}
        if diff and existing_indices(directory):
            details = ", ".join(f"{k}: recorded {a} vs requested {b}" for k, (a, b) in diff.items())
            raise HiddenStatesError(
                f"{path}: the folder already holds hidden states extracted with other settings "
                f"({details}). Use another --output folder or remove the old files."
            )
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{CONFIG_NAME}.partial-{os.getpid()}"
    tmp.write_text(json.dumps(config, indent=1) + "\n")
    commit_file(tmp, path)


def resolve_layer_ids(
    target_layer_ids: Sequence[int] | None,
    num_hidden_layers: int,
    include_last_layer: bool = True,
) -> list[int]:
    """The layer ids a file's slots hold, in slot order: every backend's one source.

    As speculators 0.9.0's ``scripts/launch_vllm.py``: ``None`` means
    ``[2, N // 2, N - 3, N]`` whatever ``include_last_layer`` says; explicit ids get
    ``N`` appended (``include_last_layer``) unless present. Then sorted ascending,
    because vLLM 0.33.0 captures aux layers in that order whatever order they were
    typed in (``interfaces.py``: ``tuple(sorted(set(layers)))``); ``N``, the largest
    id, is therefore always the last slot. Layer id ``k`` is the residual stream
    after ``k`` decoder layers (0 = embeddings).
    """
    n = num_hidden_layers
    explicit = target_layer_ids is not None
    ids = list(target_layer_ids) if explicit else [2, n // 2, n - 3, n]
    if not ids or min(ids) < 0 or max(ids) > n or len(set(ids)) != len(ids):
        what = "--target-layer-ids" if explicit else "the default target layer ids"
        raise ValueError(
            f"{what} {ids} must be distinct and within [0, {n}] for a verifier "
            f"with {n} decoder layers"
            + ("" if explicit else "; pass --target-layer-ids explicitly")
        )
    if include_last_layer and n not in ids:
        ids.append(n)
    if ids != sorted(ids):
        log.warning(
            "--target-layer-ids %s: vLLM captures layers in ascending order, so the "
            "hidden states hold layers %s; pass the trainer --target-layer-ids %s",
            list(target_layer_ids),
            sorted(ids),
            " ".join(str(k) for k in sorted(ids) if k != n),
        )
    return sorted(ids)
