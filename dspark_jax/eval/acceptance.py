"""Acceptance curves from per-slot values (numpy; the pure math of ``dspark_jax.eval``).

Input: for n blocks of B slots, a per-slot value ``x[i, k]`` and the training slot
mask ``m[i, k]`` (:mod:`dspark_jax.eval.slot_statistics`). ``x`` is either an acceptance
probability given the block's earlier slots were accepted (the analytic rule,
``sum_v min(q, p)``) or a 0/1 greedy match. Draft position j = 0..N-1 is slot
``start + j`` (start = 0 with sample_from_anchor, else 1: slot 0 is the anchor).

Definitions (block i counts iff it has a masked-in draft slot, the training rule;
a masked-out slot ends the block's accepted run, as in the training metric):

* ``prefix[i, j] = prod_{l <= j} x[i, l] m[i, l]``: probability (analytic) or
  indicator (greedy) that draft positions 0..j are all accepted.
* ``cumulative[j]`` = mean of ``prefix[:, j]`` over counted blocks: the share of
  drafts whose position j is accepted, i.e. vLLM's per-position acceptance rate
  (``num_accepted_tokens_per_pos[j] / num_drafts``) and the model card's
  ``pos j`` columns.
* ``acceptance_length = 1 + sum_j cumulative[j]`` (the bonus token counted): the
  training metric ``accept_len`` (analytic) / ``eal`` (greedy).
* ``conditional[j] = cumulative[j] / cumulative[j-1]`` (``cumulative[-1] = 1``):
  the population rate of accepting position j given positions < j were accepted.
* ``slot_mean[j]`` = masked mean of ``x[:, j]`` over all blocks: the training
  metric ``accept_rate`` restricted to one position (analytic) /
  ``position_{k}_acc`` (greedy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# Powers of two from 256 to 1M (the longest rows the context mesh axis trains on); the
# last bucket is open. Only the buckets a dataset reaches are reported (context_buckets).
DEFAULT_CONTEXT_EDGES = (0, *(1 << k for k in range(8, 21)))


@dataclasses.dataclass(frozen=True)
class Curve:
    """Acceptance by draft position (length N arrays) of one set of blocks."""

    cumulative: np.ndarray
    conditional: np.ndarray
    slot_mean: np.ndarray
    acceptance_length: float
    blocks: int  # counted blocks
    slots: np.ndarray  # masked-in slots per position

    def as_dict(self) -> dict:
        return {
            "acceptance_length": _num(self.acceptance_length),
            "cumulative": [_num(v) for v in self.cumulative],
            "conditional": [_num(v) for v in self.conditional],
            "slot_mean": [_num(v) for v in self.slot_mean],
            "blocks": int(self.blocks),
            "slots": [int(v) for v in self.slots],
        }


def _num(v) -> float | None:
    v = float(v)
    return None if np.isnan(v) else v


def draft_slots(values: np.ndarray, start: int, num_draft: int | None) -> np.ndarray:
    """The columns of the draft positions: slots start .. start+N-1."""
    block = values.shape[1]
    n = block - start if num_draft is None else num_draft
    if not 1 <= n <= block - start:
        raise ValueError(f"num_draft must be in [1, {block - start}], got {num_draft}")
    return values[:, start : start + n]


def curve(
    values: np.ndarray, mask: np.ndarray, *, start: int = 0, num_draft: int | None = None
) -> Curve:
    """Acceptance curve of blocks ``values``/``mask`` [n, B] (see the module docstring)."""
    values = np.asarray(values, np.float64)
    mask = np.asarray(mask, np.float64)
    if values.shape != mask.shape or values.ndim != 2:
        raise ValueError(f"values and mask must be [n, B] alike, got {values.shape}, {mask.shape}")
    x = draft_slots(values, start, num_draft)
    m = draft_slots(mask, start, num_draft)
    n = x.shape[1]
    counted = m.sum(axis=1) > 0
    prefix = np.cumprod(x * m, axis=1)[counted]
    blocks = int(counted.sum())
    if blocks:
        cumulative = prefix.mean(axis=0)
    else:
        cumulative = np.full(n, np.nan)
    before = np.concatenate([[1.0], cumulative[:-1]])
    with np.errstate(invalid="ignore", divide="ignore"):
        conditional = np.where(before > 0, cumulative / np.where(before > 0, before, 1.0), np.nan)
        slots = m.sum(axis=0)
        slot_mean = np.where(slots > 0, (x * m).sum(axis=0) / np.maximum(slots, 1.0), np.nan)
    length = 1.0 + float(cumulative.sum()) if blocks else float("nan")
    return Curve(cumulative, conditional, slot_mean, length, blocks, slots)


def context_buckets(
    context_pos: np.ndarray,
    edges: Sequence[int] = DEFAULT_CONTEXT_EDGES,
    longest: int | None = None,
) -> list[tuple[int, int | None, np.ndarray]]:
    """Split blocks by context length (the anchor's position in its document).

    Returns ``(lo, hi, selector)`` for buckets ``lo <= pos < hi`` (the last one open:
    hi None) that hold at least one block or that the data reaches (``lo < longest``,
    the longest document's length in tokens: an empty bucket there says the data had
    that much context but no evaluated anchor in it); ``selector`` is a bool [n] array.
    Buckets beyond the data are left out, so 1M-token edges do not fill short tables.
    """
    edges = sorted({int(e) for e in edges})
    if not edges or edges[0] != 0:
        edges = [0, *edges]
    pos = np.asarray(context_pos)
    out = []
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else None
        sel = (pos >= lo) & (pos < hi) if hi is not None else pos >= lo
        if sel.any() or (longest is not None and lo < longest):
            out.append((lo, hi, sel))
    return out


def bucket_label(lo: int, hi: int | None) -> str:
    def k(v: int) -> str:
        if v >= 1 << 20 and v % (1 << 20) == 0:
            return f"{v >> 20}M"
        return f"{v // 1024}K" if v >= 1024 and v % 1024 == 0 else str(v)

    return f"{k(lo)}+" if hi is None else f"{k(lo)}-{k(hi)}"
