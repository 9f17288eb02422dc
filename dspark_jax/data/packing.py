"""Packing documents into rows of S tokens and balancing them over data-parallel ranks.

The plan is the reference's ``MultipackDistributedBatchSamplerV2`` (speculators
0.9.0, ``train/distributed_batch_sampler.py``): per epoch a permutation from
``seed + epoch``; documents longer than S count as S (they are truncated); then,
repeatedly, the longest prefix of the remaining permuted documents that LPT
(longest processing time first) can spread over ``num_replicas`` rows of S tokens
is found by binary search, and becomes one step; fewer than ``num_replicas``
leftover documents are dropped. Every rank therefore has the same number of steps.

Two deliberate differences, both about determinism, neither changes the algorithm:

* the plan of all ranks is computed at once (the reference computes one rank's;
  the LPT feasibility that drives the search does not depend on the rank);
* documents of equal length are placed in a fixed order (the reference's
  ``argsort(lengths)[::-1]`` with ``kind="stable"``: ties by descending index)
  where the reference uses numpy's default unstable argsort, whose tie order can
  differ between CPUs (AVX-512 vs AVX2 sort kernels): two hosts must agree on the
  plan, or documents are silently duplicated or lost. Without ties the plans are
  identical (tests/reference/test_data_reference.py).

A row then concatenates its documents in plan order (``pack_row``): position ids
restart at 0 per document, ``document_ids`` number the documents 0.. and are -1 on
padding, the document that crosses S is cut (the reference's ``CollateFn``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from heapq import heapreplace

import numpy as np


@dataclass(frozen=True)
class EpochPlan:
    """Which documents go into which row, for every step and rank of one epoch.

    ``docs``: int64, document indices (relative to the split) in row order.
    ``offsets``: int64 [num_steps * num_replicas + 1]; row (step t, rank r) holds
    ``docs[offsets[t * num_replicas + r] : offsets[t * num_replicas + r + 1]]``.
    """

    docs: np.ndarray
    offsets: np.ndarray
    num_replicas: int

    @property
    def num_steps(self) -> int:
        return (len(self.offsets) - 1) // self.num_replicas

    def row(self, step: int, rank: int) -> np.ndarray:
        k = step * self.num_replicas + rank
        return self.docs[self.offsets[k] : self.offsets[k + 1]]

    def rank_docs(self, rank: int) -> np.ndarray:
        """All documents of ``rank`` over the epoch, in order."""
        return np.concatenate(
            [self.row(t, rank) for t in range(self.num_steps)] or [np.zeros(0, np.int64)]
        )

    def digest(self) -> str:
        """A short hash; processes of one run must agree on it (check at startup)."""
        h = hashlib.sha256(self.docs.tobytes())
        h.update(self.offsets.tobytes())
        return h.hexdigest()[:16]


def _lpt_rows(
    lengths: list[int], max_len: int, replicas: int, rotation: int
) -> list[list[int]] | None:
    """LPT-pack all of ``lengths`` into ``replicas`` rows of ``max_len``, or None.

    Returns, per rank, window-relative indices in the order LPT placed them. Slot s
    (the reference's heap slot) belongs to rank ``(s + rotation) % replicas``.
    """
    heap = [(0, s) for s in range(replicas)]
    slots: list[list[int]] = [[] for _ in range(replicas)]
    order = np.argsort(np.asarray(lengths, np.int64), kind="stable")[::-1]
    for idx in order.tolist():
        fill, slot = heap[0]
        new_fill = fill + lengths[idx]
        if new_fill > max_len:
            return None
        slots[slot].append(idx)
        heapreplace(heap, (new_fill, slot))
    return [slots[(rank - rotation) % replicas] for rank in range(replicas)]


def plan_epoch(
    lengths: np.ndarray | Sequence[int],
    total_seq_len: int,
    num_replicas: int,
    seed: int,
    epoch: int,
) -> EpochPlan:
    """The packing plan of one epoch for all ``num_replicas`` ranks.

    Args:
      lengths: [N] document lengths (``seq_len`` of the split's rows).
      total_seq_len: S, tokens per row.
      num_replicas: data-parallel rows per step (all processes together).
      seed, epoch: the permutation uses ``numpy.random.default_rng(seed + epoch)``.
    """
    if total_seq_len <= 0 or num_replicas <= 0:
        raise ValueError(
            f"total_seq_len and num_replicas must be positive, got {total_seq_len}, {num_replicas}"
        )
    lengths = np.minimum(np.asarray(lengths, np.int64), total_seq_len)
    rng = np.random.default_rng(seed=seed + epoch)
    indices = rng.permutation(np.arange(len(lengths)))
    perm_lengths = lengths[indices]
    cumsum = np.cumsum(perm_lengths)
    perm_list = perm_lengths.tolist()

    rows: list[np.ndarray] = []
    ind = 0
    so_far = 0
    n = len(perm_list)
    while n - ind >= num_replicas:
        left = 1
        right = 1 + int(
            np.searchsorted(cumsum[ind:], so_far + total_seq_len * num_replicas, "right")
        )
        rotation = len(rows) // num_replicas
        batch = None
        while right - left > 1 and right > num_replicas:
            mid = (left + right) // 2
            batch = _lpt_rows(perm_list[ind : ind + mid], total_seq_len, num_replicas, rotation)
            if batch is None:
                right = mid
            else:
                left = mid
        if batch is None:
            batch = _lpt_rows(perm_list[ind : ind + left], total_seq_len, num_replicas, rotation)
        assert batch is not None  # one document per slot always fits
        rows.extend(indices[ind + np.asarray(r, np.int64)] for r in batch)
        ind += left
        so_far = int(cumsum[ind - 1])

    sizes = np.array([len(r) for r in rows], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    docs = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
    return EpochPlan(docs=docs, offsets=offsets, num_replicas=num_replicas)


@dataclass
class RowBuffers:
    """Host buffers of ``rows`` packed rows of ``S`` tokens (the batch layout).

    hidden_states [R, hi - lo, n_aux*H] (``dtype``), verifier_last_hidden_states
    [R, hi - lo, H]: the hidden states of the row's tokens ``[lo, hi)`` (``tokens``;
    the whole row unless a process holds part of it, docs/design.md "Context
    parallelism"); input_ids / loss_mask / position_ids [R, S] int32 (0 on padding),
    document_ids [R, S] int32 (-1 on padding): the whole row (small ints; the anchors
    are drawn from them); error_records [R] int32 (documents dropped by the skip/warn
    policy). ``fill[r]``: tokens used in row r; ``num_docs[r]``: documents.
    """

    hidden_states: np.ndarray
    verifier_last_hidden_states: np.ndarray
    input_ids: np.ndarray
    loss_mask: np.ndarray
    position_ids: np.ndarray
    document_ids: np.ndarray
    error_records: np.ndarray
    fill: np.ndarray
    num_docs: np.ndarray
    tokens: tuple[int, int] = (0, 0)  # [lo, hi): the row's tokens whose hidden states are held

    @classmethod
    def allocate(
        cls,
        rows: int,
        total_seq_len: int,
        n_aux: int,
        hidden_size: int,
        dtype: np.dtype,
        zeros: Callable[[tuple[int, ...], np.dtype], np.ndarray] = np.zeros,
        tokens: tuple[int, int] | None = None,
    ) -> RowBuffers:
        """``zeros(shape, dtype)`` allocates the two hidden-state buffers (the big ones),
        of the tokens ``[lo, hi)`` = ``tokens`` (default: the whole row)."""
        r, s = rows, total_seq_len
        lo, hi = (0, s) if tokens is None else tokens
        if not 0 <= lo < hi <= s:
            raise ValueError(f"tokens [{lo}, {hi}) must be a non-empty part of [0, {s})")
        return cls(
            hidden_states=zeros((r, hi - lo, n_aux * hidden_size), dtype),
            verifier_last_hidden_states=zeros((r, hi - lo, hidden_size), dtype),
            input_ids=np.zeros((r, s), np.int32),
            loss_mask=np.zeros((r, s), np.int32),
            position_ids=np.zeros((r, s), np.int32),
            document_ids=np.full((r, s), -1, np.int32),
            error_records=np.zeros((r,), np.int32),
            fill=np.zeros((r,), np.int64),
            num_docs=np.zeros((r,), np.int64),
            tokens=(lo, hi),
        )

    @property
    def total_seq_len(self) -> int:
        return self.input_ids.shape[1]

    def room(self, r: int) -> int:
        """Tokens still free in row ``r``."""
        return self.total_seq_len - int(self.fill[r])

    def held(self, r: int, length: int) -> tuple[int, int]:
        """The next document's tokens ``[a, b)`` (of its ``length``, cut to the room)
        whose hidden states these buffers hold: the ones to read (a == b: none)."""
        off = int(self.fill[r])
        n = min(length, self.total_seq_len - off)
        lo, hi = self.tokens
        a = min(max(lo - off, 0), max(n, 0))
        return a, max(a, min(hi - off, n))

    def append(
        self,
        r: int,
        input_ids: np.ndarray,
        loss_mask: np.ndarray,
        hidden: np.ndarray,
        hidden_start: int = 0,
    ) -> int:
        """Append one document to row ``r``, cut to the room left; returns tokens taken.

        input_ids, loss_mask: [T]; hidden: [m, n_aux+1, H] (aux slots then the last
        layer), already in the buffer dtype, the document's tokens ``hidden_start ..
        hidden_start + m``; it must cover :meth:`held` (more is ignored).
        """
        off = int(self.fill[r])
        n = min(len(input_ids), self.total_seq_len - off)
        if n <= 0:
            return 0
        a, b = self.held(r, len(input_ids))
        if a < b:
            if hidden_start > a or hidden_start + hidden.shape[0] < b:
                raise ValueError(
                    f"hidden states of tokens [{hidden_start}, {hidden_start + hidden.shape[0]})"
                    f" do not cover the held tokens [{a}, {b})"
                )
            k = hidden.shape[1] - 1
            h = hidden.shape[2]
            part = hidden[a - hidden_start : b - hidden_start]
            dst = slice(off + a - self.tokens[0], off + b - self.tokens[0])
            self.hidden_states[r, dst].reshape(b - a, k, h)[...] = part[:, :k]
            self.verifier_last_hidden_states[r, dst] = part[:, k]
        sl = slice(off, off + n)
        self.input_ids[r, sl] = input_ids[:n]
        self.loss_mask[r, sl] = loss_mask[:n]
        self.position_ids[r, sl] = np.arange(n, dtype=np.int32)
        self.document_ids[r, sl] = self.num_docs[r]
        self.fill[r] += n
        self.num_docs[r] += 1
        return n

    def _local(self, start: int, stop: int) -> slice:
        """Row tokens [start, stop) -> the held part, as a slice of the hidden buffers."""
        lo, hi = self.tokens
        a, b = max(start, lo), min(stop, hi)
        return slice(a - lo, max(a, b) - lo)

    def first_non_finite(self, r: int, start: int, n: int) -> tuple[int, int] | None:
        """(token, slot) of the first NaN/inf in the held tokens of ``[start, start+n)``
        of row r (token counted from ``start``)."""
        from dspark_jax.data.files import first_non_finite

        sl = self._local(start, start + n)
        m = sl.stop - sl.start
        if m == 0:
            return None
        skip = sl.start + self.tokens[0] - start  # tokens of the range before the held part
        h = self.verifier_last_hidden_states.shape[2]
        k = self.hidden_states.shape[2] // h
        found = []
        aux = first_non_finite(self.hidden_states[r, sl].reshape(m, k, h))
        if aux is not None:
            found.append((skip + aux[0], aux[1]))
        last = first_non_finite(self.verifier_last_hidden_states[r, sl])
        if last is not None:
            found.append((skip + last[0], k))
        return min(found) if found else None

    def drop_last(self, r: int, start: int) -> None:
        """Undo the last :meth:`append` to row r, which began at token ``start``."""
        sl = slice(start, int(self.fill[r]))
        held = self._local(start, int(self.fill[r]))
        self.hidden_states[r, held] = 0
        self.verifier_last_hidden_states[r, held] = 0
        for a in (self.input_ids, self.loss_mask, self.position_ids):
            a[r, sl] = 0
        self.document_ids[r, sl] = -1
        self.fill[r] = start
        self.num_docs[r] -= 1

    def batch(self) -> dict[str, np.ndarray]:
        """The batch dict (see the class docstring for keys and shapes)."""
        return {
            "hidden_states": self.hidden_states,
            "verifier_last_hidden_states": self.verifier_last_hidden_states,
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "position_ids": self.position_ids,
            "document_ids": self.document_ids,
            "error_records": self.error_records,
        }
