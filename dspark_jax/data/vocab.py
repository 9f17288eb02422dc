"""Draft vocabulary maps (speculators 0.9.0 ``train/vocab_mapping.py``, ``train/cli.py``).

``d2t`` int64 [Vd]: offsets, ``verifier_id = draft_id + d2t[draft_id]``.
``t2d`` bool [Vt]: True for the verifier ids in the draft vocabulary.
The draft vocabulary is the Vd most frequent supervised tokens (ties: smaller id
first), padded with the smallest unused ids, sorted by id.

Resolution order (:func:`resolve_vocab_maps`, as the reference's
``parse_vocab_mappings``): explicit ``d2t``/``t2d`` paths; ``d2t-<Vd>.npy`` /
``t2d-<Vd>.npy`` (or unsuffixed ``d2t.npy``/``t2d.npy``) in the data folder; built
from ``token_freq.pt`` and cached there as ``d2t-<Vd>.npy``/``t2d-<Vd>.npy``.
One deliberate difference: asking for a reduced draft vocabulary that can be found
nowhere raises (the reference warns and silently trains the full vocabulary).

``token_freq.pt`` is read without torch: ``torch.save`` writes a zip archive whose
``*/data.pkl`` is a plain pickle; a dict of ints needs no torch classes, so a
restricted unpickler reads it and refuses anything else (tensors, arbitrary classes).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import zipfile
from pathlib import Path
from typing import ClassVar

import numpy as np

logger = logging.getLogger(__name__)


class VocabError(ValueError):
    """Inconsistent or unreadable vocabulary-map input."""


class _IntDictUnpickler(pickle.Unpickler):
    """Unpickles plain containers of ints only; no class can be instantiated."""

    _ALLOWED: ClassVar[frozenset] = frozenset(
        {("collections", "OrderedDict"), ("collections", "Counter")}
    )

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("the file stores tensors, expected a dict of ints")


def load_token_freq(path: str | os.PathLike) -> dict[int, int]:
    """``token_freq.pt`` (token id -> count) without torch.

    Raises VocabError if the file is not a torch zip archive holding a dict of
    int -> int (then convert it once with torch: ``{int(k): int(v) ...}``).
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            pkls = [n for n in z.namelist() if n.endswith("data.pkl")]
            if len(pkls) != 1:
                raise VocabError(
                    f"{path}: expected one */data.pkl in the torch archive, found {pkls}"
                )
            raw = z.read(pkls[0])
    except zipfile.BadZipFile:
        raise VocabError(
            f"{path}: not a torch zip archive (legacy torch.save format or not torch); "
            "re-save it with a current torch.save"
        ) from None
    except FileNotFoundError:
        raise VocabError(f"{path}: no such file") from None
    try:
        obj = _IntDictUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as e:
        raise VocabError(f"{path}: cannot read without torch: {e}") from None
    if not isinstance(obj, dict) or not all(
        isinstance(k, int) and isinstance(v, int) for k, v in obj.items()
    ):
        raise VocabError(f"{path}: expected a dict of token id -> count (ints)")
    return dict(obj)


def build_vocab_maps(
    token_freq: dict[int, int], draft_vocab_size: int, verifier_vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(d2t int64 [Vd], t2d bool [Vt])`` from token counts, as the reference does."""
    if not 0 < draft_vocab_size <= verifier_vocab_size:
        raise VocabError(
            f"draft_vocab_size must be in [1, {verifier_vocab_size}], got {draft_vocab_size}"
        )
    out_of_range = [t for t in token_freq if not 0 <= t < verifier_vocab_size]
    if out_of_range:
        raise VocabError(
            f"token_freq has ids outside [0, {verifier_vocab_size}): {sorted(out_of_range)[:5]}"
        )
    ranked = sorted(token_freq, key=lambda t: (-token_freq[t], t))
    selected = ranked[:draft_vocab_size]
    if len(selected) < draft_vocab_size:
        used = set(selected)
        selected += [t for t in range(draft_vocab_size) if t not in used][
            : draft_vocab_size - len(selected)
        ]
    selected.sort()
    ids = np.asarray(selected, np.int64)
    d2t = ids - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(verifier_vocab_size, np.bool_)
    t2d[ids] = True
    return d2t, t2d


def check_vocab_maps(
    d2t: np.ndarray,
    t2d: np.ndarray,
    *,
    draft_vocab_size: int | None = None,
    verifier_vocab_size: int | None = None,
    source: str = "vocab maps",
) -> None:
    """The reference's checks (sizes, ``t2d.sum() == Vd``) plus d2t/t2d agreement."""
    if d2t.ndim != 1 or t2d.ndim != 1:
        raise VocabError(f"{source}: d2t and t2d must be 1-D, got {d2t.shape}, {t2d.shape}")
    vd = len(d2t)
    if draft_vocab_size is not None and vd != draft_vocab_size:
        raise VocabError(f"{source}: d2t has size {vd}, but draft_vocab_size is {draft_vocab_size}")
    if verifier_vocab_size is not None and len(t2d) != verifier_vocab_size:
        raise VocabError(
            f"{source}: t2d.shape[0] ({len(t2d)}) must match the verifier "
            f"vocab size ({verifier_vocab_size})"
        )
    if int(t2d.astype(np.int64).sum()) != vd:
        raise VocabError(
            f"{source}: t2d has {int(t2d.astype(np.int64).sum())} non-zero values, expected {vd}"
        )
    ids = d2t.astype(np.int64) + np.arange(vd, dtype=np.int64)
    if not np.array_equal(ids, np.flatnonzero(t2d)):
        raise VocabError(
            f"{source}: d2t and t2d disagree (draft_id + d2t must list the "
            "True entries of t2d in increasing order)"
        )


def load_vocab_maps(
    d2t_path: str | os.PathLike,
    t2d_path: str | os.PathLike,
    *,
    draft_vocab_size: int | None = None,
    verifier_vocab_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Load and check ``(d2t int64 [Vd], t2d bool [Vt])`` from ``.npy`` files."""
    try:
        d2t, t2d = np.load(d2t_path), np.load(t2d_path)
    except FileNotFoundError as e:
        raise VocabError(f"vocab map not found: {e.filename}") from None
    check_vocab_maps(
        d2t,
        t2d,
        draft_vocab_size=draft_vocab_size,
        verifier_vocab_size=verifier_vocab_size,
        source=f"{d2t_path}, {t2d_path}",
    )
    return d2t.astype(np.int64), t2d.astype(np.bool_)


def save_vocab_maps(
    folder: str | os.PathLike, d2t: np.ndarray, t2d: np.ndarray
) -> tuple[Path, Path]:
    """Write ``d2t-<Vd>.npy`` and ``t2d-<Vd>.npy`` into ``folder``."""
    folder = Path(folder)
    d2t_path, t2d_path = folder / f"d2t-{len(d2t)}.npy", folder / f"t2d-{len(d2t)}.npy"
    np.save(d2t_path, d2t.astype(np.int64))
    np.save(t2d_path, t2d.astype(np.bool_))
    return d2t_path, t2d_path


def resolve_vocab_maps(
    data_path: str | os.PathLike,
    *,
    draft_vocab_size: int | None,
    verifier_vocab_size: int,
    d2t_path: str | os.PathLike | None = None,
    t2d_path: str | os.PathLike | None = None,
    token_freq_path: str | os.PathLike | None = None,
    cache: bool = True,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Find or build the maps; None means the full verifier vocabulary.

    Args:
      data_path: the prepared dataset folder (maps and token_freq.pt live there).
      draft_vocab_size: Vd, or None to take it from given map files / use the full vocab.
      verifier_vocab_size: Vt.
      d2t_path, t2d_path: explicit files (both or neither).
      token_freq_path: default ``data_path/token_freq.pt``.
      cache: write maps built from token counts into ``data_path``.
    """
    if (d2t_path is None) != (t2d_path is None):
        raise VocabError(
            "d2t and t2d must be given together, or both omitted "
            f"(got d2t={d2t_path}, t2d={t2d_path})"
        )
    if d2t_path is not None:
        return load_vocab_maps(
            d2t_path,
            t2d_path,
            draft_vocab_size=draft_vocab_size,
            verifier_vocab_size=verifier_vocab_size,
        )
    if draft_vocab_size is None or draft_vocab_size == verifier_vocab_size:
        return None
    data_path = Path(data_path)
    for suffix in (f"-{draft_vocab_size}", ""):
        d, t = data_path / f"d2t{suffix}.npy", data_path / f"t2d{suffix}.npy"
        if d.exists() and t.exists():
            logger.info("loading vocab maps %s, %s", d, t)
            return load_vocab_maps(
                d, t, draft_vocab_size=draft_vocab_size, verifier_vocab_size=verifier_vocab_size
            )
    freq_path = Path(token_freq_path) if token_freq_path else data_path / "token_freq.pt"
    if not freq_path.exists():
        raise VocabError(
            f"draft_vocab_size={draft_vocab_size} needs vocab maps, but there is no "
            f"d2t-{draft_vocab_size}.npy/t2d-{draft_vocab_size}.npy (or d2t.npy/t2d.npy) in "
            f"{data_path} and no token frequencies at {freq_path}"
        )
    logger.info("building vocab maps from %s", freq_path)
    d2t, t2d = build_vocab_maps(load_token_freq(freq_path), draft_vocab_size, verifier_vocab_size)
    if cache:
        save_vocab_maps(data_path, d2t, t2d)
    return d2t, t2d
