"""The Grain pipeline: prepared rows + hidden-state files -> packed host batches.

One step is one packed row of ``total_seq_len`` S tokens per data-parallel rank, as
in speculators 0.9.0. A process owns ``rows_per_process`` R consecutive ranks
(``process_index * R ... + R - 1`` of ``process_count * R``), or the ranks its devices
hold (:class:`ProcessRows`, from the mesh), and gets, per step, a dict of host numpy
arrays with leading axis R (see :class:`RowBuffers`):

======================================  ================  ================================
key                                     shape             dtype
======================================  ================  ================================
``hidden_states``                       [R, T, n_aux*H]   bf16 as stored (fp8 files: f32)
``verifier_last_hidden_states``         [R, T, H]         same
``input_ids``                           [R, S]            int32 (0 on padding)
``loss_mask``                           [R, S]            int32 (0 on padding)
``position_ids``                        [R, S]            int32, restart at 0 per document
``document_ids``                        [R, S]            int32, 0.. per row, -1 on padding
``error_records``                       [R]               int32, documents skipped (policy)
======================================  ================  ================================

T = S, unless the process holds only the tokens ``[lo, hi)`` of its rows (a ``context``
mesh axis over processes, :class:`ProcessRows`; docs/design.md "Context parallelism"):
then T = hi - lo and only those tokens' hidden states are read (memory-mapped rows of
the files); the token ids and masks are always whole rows.

Feed it to ``jax.make_array_from_process_local_data`` (:func:`to_global_arrays`,
``parallel.global_batch``).

Epochs follow the reference: the train split is re-planned every epoch from
``seed + epoch`` (packing.py); the validation split (the tail rows, as in the
reference) from ``0 + epoch`` so runs with different seeds validate on the same rows.
Each epoch is a finite Grain pipeline ``MapDataset.range(steps).map(StepLoader)
.to_iter_dataset(ReadOptions).mp_prefetch(...)``; :class:`EpochIterator` chains the
epochs and its ``get_state()/set_state()`` (``{"epoch", "step"}``) resume exactly,
with any number of worker processes, also through
``grain.checkpoint.CheckpointSave/Restore`` in Orbax.

Worker processes (``num_workers``) are started per epoch; the next epoch's start
while the caller uses the last batch of the previous one (spawned workers import
Grain and JAX: seconds). In worker processes the hidden states are packed straight
into shared memory, so Grain hands them over without a copy.

Every process plans all ranks itself (cheap, deterministic): at startup a multi-host
trainer should check that ``plan("train", 0).digest()`` agrees across processes.

Grain 0.2.18 workarounds (docs/design.md, "Grain 0.2.18"): absl flags are marked
parsed before ``mp_prefetch`` (google/grain#1355); everything a worker unpickles
lives in this importable module (workers are spawned).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import grain
import grain.multiprocessing
import ml_dtypes
import numpy as np

from dspark_jax.data.files import (
    BadSampleError,
    DataError,
    PreparedDataset,
    check_extraction_config,
    hidden_states_file_dtype,
    read_hidden_states,
)
from dspark_jax.data.hs_names import hs_path
from dspark_jax.data.online.source import OnlineSource
from dspark_jax.data.packing import EpochPlan, RowBuffers, plan_epoch

logger = logging.getLogger(__name__)

OnMissing = Literal["raise", "skip", "warn", "generate"]
ON_MISSING = ("raise", "skip", "warn")
Split = Literal["train", "val"]
VAL_SEED = 0  # the reference validates with a fixed seed, whatever the run seed
_MIN_SHM_BYTES = 64 * 1024

_DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
}
# Stored dtype -> batch dtype when not given: as stored; fp8 is dequantised to f32.
_AUTO_DTYPE = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float32",
    "F8_E4M3": "float32",
    "F8_E5M2": "float32",
}


@dataclasses.dataclass(frozen=True)
class ProcessRows:
    """Which part of each step's batch one process builds.

    ``ranks``: the global rows (data-parallel ranks, ascending) it feeds, of
    ``num_ranks`` per step; ``tokens``: ``(lo, hi)``, the tokens of those rows whose
    hidden states it holds (None: all). Processes that share a row (its tokens split over them) have
    the same ranks and disjoint ``tokens``; ``parallel.process_rows`` derives it from
    the mesh.
    """

    ranks: Sequence[int]
    num_ranks: int
    tokens: tuple[int, int] | None = None


def _mark_absl_flags_parsed() -> None:
    # grain 0.2.18 reads an absl flag in mp_prefetch (google/grain#1355).
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _shm_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    # In a worker process: build the hidden states straight into shared memory, which
    # Grain then hands to the main process without its own copy. New shared memory
    # is zero-filled by the kernel. An empty array (tokens-only rows: the in-step verifier
    # computes the hidden states) needs none, and shared memory refuses size 0.
    if not np.prod(shape):
        return np.zeros(shape, dtype)
    return grain.multiprocessing.SharedMemoryArray(shape, dtype)


class StepLoader:
    """Grain map function: step index -> the process's batch for that step.

    Reads each document's prepared row and hidden-state file, validates it, and
    packs it into the rank's row. ``on_missing`` decides what a bad sample does:
    ``raise`` (stop: :class:`BadSampleError` names the file and reason), ``skip``
    (drop it, count it in ``error_records``) or ``warn`` (the same plus a log line).
    Picklable: worker processes receive it by reference to this module. With
    ``shared_memory`` (set for worker processes only) the hidden-state buffers are
    allocated in shared memory.
    """

    def __init__(
        self,
        dataset: PreparedDataset,
        hidden_states_dir: Path,
        plan: EpochPlan,
        ranks: Sequence[int],
        split_start: int,
        *,
        total_seq_len: int,
        n_aux: int,
        hidden_size: int,
        dtype: str,
        on_missing: OnMissing,
        check_finite: bool = True,
        shared_memory: bool = False,
        online: OnlineSource | None = None,
        read_files: bool = True,
        tokens_only: bool = False,
        tokens: tuple[int, int] | None = None,
    ):
        self.dataset = dataset
        self.tokens_only = tokens_only
        self.tokens = tokens
        self.hidden_states_dir = Path(hidden_states_dir)
        self.plan = plan
        self.ranks = ranks
        self.split_start = split_start
        self.total_seq_len = total_seq_len
        self.n_aux = n_aux
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.on_missing = on_missing
        self.check_finite = check_finite
        self.shared_memory = shared_memory
        self.online = online
        self.read_files = read_files

    def _has_file(self, file_idx: int) -> bool:
        return self.read_files and hs_path(self.hidden_states_dir, file_idx).exists()

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        rows = RowBuffers.allocate(
            len(self.ranks),
            self.total_seq_len,
            self.n_aux,
            self.hidden_size,
            _DTYPES[self.dtype],
            zeros=_shm_zeros if self.shared_memory else np.zeros,
            tokens=self.tokens,
        )
        pending = self._start_generation(step) if self.online else {}
        for i, rank in enumerate(self.ranks):
            for doc in self.plan.row(step, rank).tolist():
                room = rows.room(i)
                if room == 0:
                    break
                file_idx = self.split_start + doc
                try:
                    if self.tokens_only:
                        self._append_tokens(rows, i, file_idx)
                    elif file_idx in pending or (self.online and not self._has_file(file_idx)):
                        self._append_generated(rows, i, file_idx, room, pending)
                    elif not self.read_files:
                        raise BadSampleError(
                            f"row {file_idx}",
                            file_idx,
                            "no hidden states (the mooncake "
                            "backend reads no files; generate them with --on-missing generate)",
                        )
                    else:
                        self._append(rows, i, file_idx, room)
                except BadSampleError as e:
                    if self.on_missing == "raise":
                        raise
                    rows.error_records[i] += 1
                    if self.on_missing == "warn":
                        logger.warning("skipping sample: %s", e)
        return rows.batch()

    def _start_generation(self, step: int) -> dict[int, concurrent.futures.Future]:
        """Request every document of this step that has no file, all at once (the
        rows' fill is known from the lengths), so the extractor works on them while
        the loader packs."""
        pending = {}
        lengths = self.dataset.seq_len
        for rank in self.ranks:
            fill = 0
            for doc in self.plan.row(step, rank).tolist():
                if fill >= self.total_seq_len:
                    break
                file_idx = self.split_start + doc
                if not self._has_file(file_idx):
                    pending[file_idx] = self._submit(file_idx)
                fill += min(int(lengths[file_idx]), self.total_seq_len - fill)
        return pending

    def _submit(self, file_idx: int) -> concurrent.futures.Future:
        return self.online.submit(
            file_idx,
            self.dataset.input_ids(file_idx),
            n_aux=self.n_aux,
            hidden_size=self.hidden_size,
        )

    def _append_generated(
        self, rows: RowBuffers, i: int, file_idx: int, room: int, pending: dict
    ) -> None:
        # A document not requested up front (an earlier one was dropped and left
        # room) is requested now.
        future = pending.pop(file_idx, None) or self._submit(file_idx)
        values = self.online.result(future)  # GenerationError (circuit breaker) propagates
        if values is None:
            raise BadSampleError(
                self.online.settings.endpoint, file_idx, "hidden-state generation failed"
            )
        a, b = rows.held(i, len(values))
        values = values[a:b]  # the tokens this process holds
        dtype = _DTYPES[self.dtype]
        rows.append(
            i,
            self.dataset.input_ids(file_idx),
            self.dataset.loss_mask(file_idx),
            values if values.dtype == dtype else values.astype(dtype),
            hidden_start=a,
        )

    def _append_tokens(self, rows: RowBuffers, i: int, file_idx: int) -> None:
        """In-step backend: tokens and masks only (the buffers' hidden width is 0)."""
        ids = self.dataset.input_ids(file_idx)
        empty = np.zeros((len(ids), self.n_aux + 1, 0), _DTYPES[self.dtype])
        rows.append(i, ids, self.dataset.loss_mask(file_idx), empty)

    def _append(self, rows: RowBuffers, i: int, file_idx: int, room: int) -> None:
        path = hs_path(self.hidden_states_dir, file_idx)
        input_ids = self.dataset.input_ids(file_idx)
        # Only the tokens [a, b) whose hidden states this process holds are read (the
        # whole file is validated: its header and token ids, same on every process).
        a, b = rows.held(i, len(input_ids))
        # Memory-mapped read, copied once into the row; the finite check runs on the
        # copy (one pass over the file pages instead of two).
        hs = read_hidden_states(
            path,
            row=file_idx,
            input_ids=input_ids,
            n_aux=self.n_aux,
            hidden_size=self.hidden_size,
            dtype=_DTYPES[self.dtype],
            max_tokens=min(room, b),
            first_token=a,
            check_finite=False,
            mmap=True,
        )
        start = int(rows.fill[i])
        n = rows.append(i, input_ids, self.dataset.loss_mask(file_idx), hs.values, a)
        del hs
        if self.check_finite:
            bad_at = rows.first_non_finite(i, start, n)
            if bad_at is not None:
                reason = (
                    f"hidden_states has non-finite values (first at token {bad_at[0]}, "
                    f"slot {bad_at[1]})"
                )
                if self.tokens is not None:
                    # The processes holding the row's other tokens cannot see this: a
                    # skip here would make them pack different rows.
                    raise DataError(
                        f"{path}: {reason}; the row's tokens are split over processes, "
                        "so the sample cannot be skipped: repair or remove the file"
                    )
                rows.drop_last(i, start)
                raise BadSampleError(path, file_idx, reason)


class PackedData:
    """Prepared dataset + hidden states of one run, split, planned and packed.

    Args:
      data_path: the prepared dataset folder (``save_to_disk`` layout).
      hidden_states_path: folder of ``hs_{i}.safetensors``; default
        ``data_path/hidden_states`` (the reference's default).
      total_seq_len: S, tokens per packed row.
      n_aux: number of aux layers (``len(aux_hidden_state_layer_ids)``); files hold
        n_aux + 1 slots.
      hidden_size: verifier hidden size H.
      train_data_ratio: rows ``[0, int(N * ratio))`` train, the rest validate.
      rows_per_process: R, data-parallel rows (ranks) this process feeds per step.
      process_index, process_count: default ``jax.process_index()/process_count()``.
      seed: run seed; epoch e of the train split is planned from ``seed + e``.
      on_missing: ``raise`` | ``skip`` | ``warn`` for bad or missing samples;
        ``generate``: samples without a file come from ``online`` (bad files and
        samples whose generation failed are skipped and counted).
      online: the :class:`~dspark_jax.data.online.OnlineSource` for ``generate``.
      tokens_only: the in-step backend (``--hidden-states-backend jax``): rows carry
        tokens, masks, positions and documents; the hidden-state buffers have width 0
        and the step computes them.
      read_files: False for the Mooncake backend: no sample is read from disk (as the
        reference, every sample is missing: generated, or handled by ``on_missing``).
      hidden_states_dtype: ``bfloat16`` | ``float16`` | ``float32``; default: the
        stored dtype of the first file found (fp8 files: ``float32``).
      check_finite: reject samples with NaN/inf hidden states.
      aux_hidden_state_layer_ids: the draft config's aux layers; when given (and the
        folder has launch/'s ``extraction_config.json``) they must be the layers the
        files hold. The record's slot count, last layer and H are checked regardless.
      process_rows: the rows and tokens this process builds (:class:`ProcessRows`,
        from the mesh: ``parallel.process_rows``); when given it replaces
        rows_per_process/process_index/process_count.
    """

    def __init__(
        self,
        data_path: str | os.PathLike,
        hidden_states_path: str | os.PathLike | None = None,
        *,
        total_seq_len: int,
        n_aux: int,
        hidden_size: int,
        train_data_ratio: float = 0.9,
        rows_per_process: int = 1,
        process_index: int | None = None,
        process_count: int | None = None,
        seed: int = 0,
        on_missing: str = "raise",
        hidden_states_dtype: str | None = None,
        check_finite: bool = True,
        aux_hidden_state_layer_ids: Sequence[int] | None = None,
        online: OnlineSource | None = None,
        read_files: bool = True,
        tokens_only: bool = False,
        process_rows: ProcessRows | None = None,
    ):
        if tokens_only:  # in-step backend: no file is read
            read_files = False
        self.tokens_only = tokens_only
        if (on_missing == "generate") != (online is not None):
            raise ValueError(
                "on_missing='generate' and an online source (dspark_jax.data.online) go "
                f"together; got on_missing={on_missing!r}, online={online!r}"
            )
        if on_missing not in (*ON_MISSING, "generate"):
            raise ValueError(
                f"on_missing must be one of {(*ON_MISSING, 'generate')}, got {on_missing!r}"
            )
        if not 0.0 < train_data_ratio <= 1.0:
            raise ValueError(f"train_data_ratio must be in (0, 1], got {train_data_ratio}")
        for name, v in (
            ("total_seq_len", total_seq_len),
            ("n_aux", n_aux),
            ("hidden_size", hidden_size),
            ("rows_per_process", rows_per_process),
        ):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if process_index is None or process_count is None:
            import jax

            process_index = jax.process_index() if process_index is None else process_index
            process_count = jax.process_count() if process_count is None else process_count
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, {process_count})")
        if process_rows is None:
            r = rows_per_process
            process_rows = ProcessRows(
                range(process_index * r, (process_index + 1) * r), process_count * r
            )
        lo, hi = process_rows.tokens or (0, total_seq_len)
        if not 0 <= lo < hi <= total_seq_len:
            raise ValueError(f"process_rows.tokens [{lo}, {hi}) not in [0, {total_seq_len})")
        ranks = list(process_rows.ranks)
        if (
            not ranks
            or ranks != sorted(set(ranks))
            or not 0 <= ranks[0] <= ranks[-1] < (process_rows.num_ranks)
        ):
            raise ValueError(f"process_rows {process_rows} feeds no row of the step")
        if (lo, hi) != (0, total_seq_len) and online is not None:
            raise ValueError(
                "on_missing='generate' with a row's tokens split over processes: every "
                "process would generate the whole document; use files"
            )
        if aux_hidden_state_layer_ids is not None and len(aux_hidden_state_layer_ids) != n_aux:
            raise ValueError(
                f"aux_hidden_state_layer_ids {list(aux_hidden_state_layer_ids)} "
                f"has {len(aux_hidden_state_layer_ids)} layers, n_aux is {n_aux}"
            )

        self.data_path = Path(data_path)
        self.hidden_states_path = Path(hidden_states_path or self.data_path / "hidden_states")
        self.online = online
        self.read_files = read_files
        if read_files and not self.hidden_states_path.is_dir() and online is None:
            raise DataError(f"{self.hidden_states_path}: hidden states folder not found")
        if not tokens_only:  # no files: nothing to check against
            check_extraction_config(
                self.hidden_states_path,
                n_aux=n_aux,
                hidden_size=hidden_size,
                aux_layer_ids=aux_hidden_state_layer_ids,
            )
        self.dataset = PreparedDataset(self.data_path)
        self.total_seq_len = total_seq_len
        self.n_aux = n_aux
        self.hidden_size = 0 if tokens_only else hidden_size  # in-step: no hidden width
        self.train_data_ratio = train_data_ratio
        self.process_rows = process_rows
        self.tokens = None if (lo, hi) == (0, total_seq_len) else (lo, hi)
        self.rows_per_process = len(process_rows.ranks)
        self.process_index = process_index
        self.process_count = process_count
        self.seed = seed
        self.on_missing = on_missing
        self.check_finite = check_finite
        n = len(self.dataset)
        self.split_index = int(n * train_data_ratio)  # the reference's expression
        self.split_range("train")
        if hidden_states_dtype is None:
            hidden_states_dtype = self._detect_dtype()
        if hidden_states_dtype not in _DTYPES:
            raise ValueError(
                f"hidden_states_dtype must be one of {list(_DTYPES)}, got {hidden_states_dtype!r}"
            )
        self.hidden_states_dtype = hidden_states_dtype
        self._plans: dict[tuple[str, int], concurrent.futures.Future] = {}
        self._plans_lock = threading.Lock()
        self._planner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plan")

    # ------------------------------------------------------------------ geometry
    @property
    def num_replicas(self) -> int:
        """Data-parallel rows per step over all processes."""
        return self.process_rows.num_ranks

    @property
    def ranks(self) -> Sequence[int]:
        """The global ranks (rows) this process feeds."""
        return self.process_rows.ranks

    def split_range(self, split: Split) -> tuple[int, int]:
        """[start, stop) dataset rows (= hs file indices) of ``split``.

        Raises DataError when the split has fewer documents than ranks (no step).
        """
        if split == "train":
            start, stop = 0, self.split_index
        elif split == "val":
            start, stop = self.split_index, len(self.dataset)
        else:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if stop - start < self.num_replicas:
            name = "train" if split == "train" else "validation"
            what = f"{name} split is " + ("empty" if stop == start else "too small")
            raise DataError(
                f"{self.data_path}: {what}: {stop - start} of {len(self.dataset)} rows "
                f"(train_data_ratio={self.train_data_ratio}), fewer than the "
                f"{self.num_replicas} data-parallel ranks that each need a document per step"
            )
        return start, stop

    def _detect_dtype(self) -> str:
        if not self.read_files or (
            self.online is not None and not self.hidden_states_path.is_dir()
        ):
            return "bfloat16"  # the verifier dtype the reference trains in
        for i in range(len(self.dataset)):
            p = hs_path(self.hidden_states_path, i)
            if p.exists():
                try:
                    return _AUTO_DTYPE[hidden_states_file_dtype(p)]
                except (DataError, KeyError):
                    continue
        if self.online is not None:
            return "bfloat16"
        raise DataError(
            f"{self.hidden_states_path}: no readable hs_{{i}}.safetensors for "
            f"the {len(self.dataset)} rows of {self.data_path}"
        )

    # ------------------------------------------------------------------ plans
    def _plan_future(self, split: Split, epoch: int) -> concurrent.futures.Future:
        with self._plans_lock:
            key = (split, epoch)
            if key not in self._plans:
                start, stop = self.split_range(split)
                seed = self.seed if split == "train" else VAL_SEED
                self._plans[key] = self._planner.submit(
                    plan_epoch,
                    self.dataset.seq_len[start:stop],
                    self.total_seq_len,
                    self.num_replicas,
                    seed,
                    epoch,
                )
                # Keep the cache small: plans of old epochs are not needed again.
                for old in [k for k in self._plans if k[0] == split and k[1] < epoch - 1]:
                    del self._plans[old]
            return self._plans[key]

    def plan(self, split: Split, epoch: int) -> EpochPlan:
        """The packing plan of ``split`` in ``epoch`` (all ranks; cached)."""
        return self._plan_future(split, epoch).result()

    def prefetch_plan(self, split: Split, epoch: int) -> None:
        """Start planning ``epoch`` in a background thread."""
        self._plan_future(split, epoch)

    def steps_per_epoch(self, split: Split = "train", epoch: int = 0) -> int:
        """Steps of ``epoch`` (equal on every rank). Epochs differ slightly in length."""
        return self.plan(split, epoch).num_steps

    # ------------------------------------------------------------------ pipelines
    def step_loader(self, split: Split, epoch: int, shared_memory: bool = False) -> StepLoader:
        return StepLoader(
            self.dataset,
            self.hidden_states_path,
            self.plan(split, epoch),
            self.ranks,
            self.split_range(split)[0],
            total_seq_len=self.total_seq_len,
            n_aux=self.n_aux,
            hidden_size=self.hidden_size,
            dtype=self.hidden_states_dtype,
            on_missing=self.on_missing,
            check_finite=self.check_finite,
            shared_memory=shared_memory,
            online=self.online,
            read_files=self.read_files,
            tokens_only=self.tokens_only,
            tokens=self.tokens,
        )

    def epoch_dataset(
        self,
        split: Split,
        epoch: int,
        *,
        start_step: int = 0,
        num_workers: int = 0,
        prefetch: int = 2,
        read_threads: int = 1,
    ) -> grain.IterDataset:
        """The Grain pipeline of steps ``start_step..`` of one epoch: one element per step.

        A step's batch is a pure function of (plan, step), so resuming is starting
        the range later; no Grain iterator state is needed.
        """
        loader = self.step_loader(split, epoch, shared_memory=num_workers > 0)
        ds = grain.MapDataset.range(start_step, loader.plan.num_steps).map(loader)
        it = ds.to_iter_dataset(
            grain.ReadOptions(
                num_threads=self._read_threads(loader.plan, read_threads) if prefetch else 0,
                prefetch_buffer_size=prefetch,
            )
        )
        if num_workers:
            _mark_absl_flags_parsed()
            # Arrays under 64 KiB (ids, masks) travel pickled, cheaper than a shared
            # memory block each; the hidden states are already in shared memory.
            it = grain.experimental.WithOptionsIterDataset(
                it, grain.experimental.DatasetOptions(min_shm_size=_MIN_SHM_BYTES)
            )
            it = it.mp_prefetch(
                grain.MultiprocessingOptions(
                    num_workers=num_workers, per_worker_buffer_size=max(1, prefetch)
                )
            )
        return it

    def _read_threads(self, plan: EpochPlan, read_threads: int) -> int:
        """Steps loaded at once. Generating samples, enough steps to keep
        ``requests_in_flight`` requests busy, and at least two, so that the extractor
        works on the next step while this one is packed."""
        if self.online is None:
            return read_threads
        docs = sum(len(plan.rank_docs(r)) for r in self.ranks) / max(1, plan.num_steps)
        want = math.ceil(self.online.settings.requests_in_flight / max(1.0, docs))
        return max(read_threads, 2, want)

    def train_iterator(
        self,
        *,
        num_epochs: int | None = None,
        num_workers: int = 0,
        prefetch: int = 2,
        read_threads: int = 1,
    ) -> EpochIterator:
        """Train batches, epoch after epoch (``num_epochs=None``: forever)."""
        return EpochIterator(
            self,
            "train",
            0,
            num_epochs,
            num_workers=num_workers,
            prefetch=prefetch,
            read_threads=read_threads,
        )

    def val_iterator(
        self, *, epoch: int = 0, num_workers: int = 0, prefetch: int = 2, read_threads: int = 1
    ) -> EpochIterator:
        """Validation batches of one epoch (the reference re-plans them per epoch)."""
        return EpochIterator(
            self,
            "val",
            epoch,
            epoch + 1,
            num_workers=num_workers,
            prefetch=prefetch,
            read_threads=read_threads,
        )


class EpochIterator(grain.DatasetIterator):
    """Checkpointable iterator over consecutive epochs of one split.

    ``get_state()`` -> ``{"epoch": e, "step": s}``: the next batch is step s of epoch
    e. Each batch is a pure function of (seed, epoch, step, topology), so that is
    the whole state: ``set_state`` starts the epoch's pipeline at step s. It restores
    exactly with any ``num_workers``/``prefetch``; the plan depends on the number of
    ranks (``process_count * rows_per_process``), so resume with the same topology
    for the same batches. :attr:`steps_in_epoch` tells the trainer where an epoch ends.
    """

    def __init__(
        self,
        data: PackedData,
        split: Split,
        first_epoch: int,
        end_epoch: int | None,
        *,
        num_workers: int,
        prefetch: int,
        read_threads: int,
    ):
        super().__init__()
        self._inner: grain.DatasetIterator | None = None
        self._closers: list[threading.Thread] = []
        data.split_range(split)  # fail now on an empty split
        data.prefetch_plan(split, first_epoch)
        self._data = data
        self._split = split
        self._end = end_epoch
        self._opts = {
            "num_workers": num_workers,
            "prefetch": prefetch,
            "read_threads": read_threads,
        }
        self._epoch = first_epoch
        self._step = 0
        self._skipped_in_epoch = 0  # documents dropped by skip/warn, this process

    @property
    def epoch(self) -> int:
        """Epoch of the next batch."""
        return self._epoch

    @property
    def step(self) -> int:
        """Step within the epoch of the next batch."""
        return self._step

    @property
    def steps_in_epoch(self) -> int:
        return self._data.steps_per_epoch(self._split, self._epoch)

    def _exhausted(self) -> bool:
        return self._end is not None and self._epoch >= self._end

    def _open_epoch(self) -> None:
        self._inner = iter(
            self._data.epoch_dataset(self._split, self._epoch, start_step=self._step, **self._opts)
        )
        if self._end is None or self._epoch + 1 < self._end:
            self._data.prefetch_plan(self._split, self._epoch + 1)

    def _close_inner(self) -> None:
        if self._inner is not None:
            self._inner.close()
            self._inner = None

    def __next__(self) -> dict[str, np.ndarray]:
        self._assert_not_closed()
        while not self._exhausted():
            if self._step >= self.steps_in_epoch:  # empty epoch, or resumed at its end
                self._next_epoch()
                continue
            if self._inner is None:
                self._open_epoch()
            batch = next(self._inner)
            self._step += 1
            self._skipped_in_epoch += int(batch["error_records"].sum())
            if self._step == self.steps_in_epoch:
                self._next_epoch()
            return batch
        raise StopIteration

    def _next_epoch(self) -> None:
        # The finished epoch's workers are shut down in the background (joining them
        # takes seconds) and the next epoch is opened at once, so that its workers
        # start while the caller uses the last batch.
        if self._inner is not None:
            closer = threading.Thread(target=self._inner.close, daemon=True)
            closer.start()
            self._closers.append(closer)
            self._inner = None
        if self._skipped_in_epoch:
            logger.warning(
                "%s epoch %d: skipped %d bad or missing samples on this process (on_missing=%s)",
                self._split,
                self._epoch,
                self._skipped_in_epoch,
                self._data.on_missing,
            )
        self._skipped_in_epoch = 0
        self._epoch += 1
        self._step = 0
        if not self._exhausted():
            self._open_epoch()
            self._inner.start_prefetch()

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "step": self._step}

    def set_state(self, state: dict[str, Any]) -> None:
        self._close_inner()
        self._epoch = int(state["epoch"])
        self._step = int(state["step"])
        self._skipped_in_epoch = 0
        if not self._exhausted() and self._step < self.steps_in_epoch:
            self._open_epoch()

    def start_prefetch(self) -> None:
        if self._inner is not None:
            self._inner.start_prefetch()

    def close(self) -> None:
        if not self._closed:
            self._close_inner()
            for closer in self._closers:
                closer.join()
        super().close()

    def __str__(self) -> str:
        return f"EpochIterator(split={self._split}, epoch={self._epoch}, step={self._step})"


def make_train_iterator(
    data_path: str | os.PathLike,
    hidden_states_path: str | os.PathLike | None = None,
    *,
    num_epochs: int | None = None,
    num_workers: int = 0,
    prefetch: int = 2,
    read_threads: int = 1,
    **data_args: Any,
) -> EpochIterator:
    """``PackedData(data_path, hidden_states_path, **data_args).train_iterator(...)``.

    ``data_args``: total_seq_len, n_aux, hidden_size (required), rows_per_process,
    seed, train_data_ratio, on_missing, hidden_states_dtype, process_index,
    process_count, ... (see :class:`PackedData`).
    """
    data = PackedData(data_path, hidden_states_path, **data_args)
    return data.train_iterator(
        num_epochs=num_epochs, num_workers=num_workers, prefetch=prefetch, read_threads=read_threads
    )


def make_val_iterator(
    data_path: str | os.PathLike,
    hidden_states_path: str | os.PathLike | None = None,
    *,
    epoch: int = 0,
    num_workers: int = 0,
    prefetch: int = 2,
    read_threads: int = 1,
    **data_args: Any,
) -> EpochIterator:
    """``PackedData(...).val_iterator(epoch=...)``: one validation epoch (same args)."""
    data = PackedData(data_path, hidden_states_path, **data_args)
    return data.val_iterator(
        epoch=epoch, num_workers=num_workers, prefetch=prefetch, read_threads=read_threads
    )


def to_global_arrays(batch: dict[str, np.ndarray], sharding: Any) -> dict[str, Any]:
    """Host batch -> global ``jax.Array``s, leading axis sharded by ``sharding``.

    ``sharding``: a ``jax.sharding.NamedSharding`` whose spec names the batch axis
    first (e.g. ``P(("data", "fsdp"))``); each process passes its own R rows.
    """
    import jax

    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
