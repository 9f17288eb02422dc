"""Readers for what the PyTorch/vLLM side writes (docs/formats.md, sections 2 and 4).

* :class:`PreparedDataset`: the ``speculators prepare-data`` output, a HuggingFace
  ``Dataset.save_to_disk`` folder (``state.json`` + Arrow IPC stream shards) with
  columns ``input_ids``, ``loss_mask`` (int lists) and ``seq_len``. Read with
  pyarrow, memory-mapped, without the ``datasets`` package.
* :class:`SafetensorsFile`: a minimal, torch-free safetensors reader (header parse,
  bounds checks, bf16/fp8 through ml_dtypes; ``safetensors.numpy`` can read neither
  fp8 nor, without ml_dtypes registered, bf16).
* :func:`read_hidden_states`: one ``hs_{i}.safetensors`` file, validated against the
  prepared row: ``hidden_states`` [T, n_aux+1, H] (bf16, or fp8 + per-token
  ``hidden_states_scales`` [T, 1, 1]) and ``token_ids`` [T].

Every malformed input raises :class:`DataError` (or its subclass :class:`BadSampleError`
for one sample) with the file and the reason; the skip policy lives in pipeline.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pyarrow as pa

from dspark_jax.data.hs_names import EXTRACTION_CONFIG, SCALES_KEY

REQUIRED_COLUMNS = ("input_ids", "loss_mask", "seq_len")

# safetensors dtype names -> numpy dtypes (ml_dtypes for the ones numpy lacks).
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # same cap as the safetensors crate


class DataError(ValueError):
    """Malformed input data; the message names the file and what was expected."""


class BadSampleError(DataError):
    """One sample (one dataset row / one ``hs_{i}.safetensors``) is unusable."""

    def __init__(self, path: str | os.PathLike, row: int, reason: str):
        self.path = str(path)
        self.row = row
        self.reason = reason
        super().__init__(f"{self.path} (dataset row {row}): {reason}")

    def __reduce__(self):  # picklable: raised in Grain worker processes
        return (type(self), (self.path, self.row, self.reason))


# --------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def np_dtype(self) -> np.dtype:
        return SAFETENSORS_DTYPES[self.dtype]


class SafetensorsFile:
    """A safetensors file whose header is parsed and checked up front.

    Only the header is read at construction; :meth:`read` reads one tensor (or its
    first rows) with ``pread``, so untouched tensors are never loaded. Checks: header
    length and JSON, known dtypes, ``nbytes == prod(shape) * itemsize``, offsets
    inside the data section, and the file being exactly as long as the header says
    (a truncated copy fails here, not with garbage later).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.path}: no such file") from None
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise DataError(f"{self.path}: not a safetensors file ({size} bytes, truncated)")
            n = int.from_bytes(head, "little")
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise DataError(
                    f"{self.path}: not a valid safetensors file: header length {n} "
                    f"exceeds the file size {size} (truncated or not safetensors)"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{self.path}: safetensors header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise DataError(f"{self.path}: safetensors header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        data_start = 8 + n
        self._tensors: dict[str, TensorInfo] = {}
        data_end = 0
        for name, info in header.items():
            try:
                dtype, shape, (b, e) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise DataError(f"{self.path}: malformed header entry for {name!r}") from None
            if dtype not in SAFETENSORS_DTYPES:
                raise DataError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype}")
            expected = int(np.prod(shape, dtype=np.int64)) * SAFETENSORS_DTYPES[dtype].itemsize
            if e - b != expected or b < 0:
                raise DataError(
                    f"{self.path}: tensor {name!r} {dtype}{list(shape)} should take "
                    f"{expected} bytes, header says [{b}, {e})"
                )
            data_end = max(data_end, e)
            self._tensors[name] = TensorInfo(dtype, shape, data_start + b, data_start + e)
        if data_start + data_end != size:
            raise DataError(
                f"{self.path}: file is truncated or has trailing bytes: the header needs "
                f"{data_start + data_end} bytes, the file has {size}"
            )

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def info(self, key: str) -> TensorInfo:
        try:
            return self._tensors[key]
        except KeyError:
            raise DataError(
                f"{self.path}: missing tensor {key!r} (found: {sorted(self._tensors)})"
            ) from None

    def _rows(self, t: TensorInfo, rows: int | None, start: int) -> tuple[tuple[int, ...], int]:
        """Shape and byte offset (from the file start) of rows [start, start + rows)."""
        shape = t.shape
        if not shape:
            return shape, t.begin
        end = shape[0] if rows is None else min(start + rows, shape[0])
        start = min(start, end)
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * t.np_dtype.itemsize
        return (end - start, *shape[1:]), t.begin + start * row_bytes

    def view(self, key: str, rows: int | None = None, start: int = 0) -> np.ndarray:
        """Tensor ``key`` (rows ``start .. start + rows``; default to the end) as a
        read-only memory-mapped array.

        No copy is made: copying out of the view is the only pass over the data (a
        ``read`` then a copy is two), and only the pages of those rows are touched.
        The mapping lives as long as the array.
        """
        t = self.info(key)
        shape, offset = self._rows(t, rows, start)
        nbytes = int(np.prod(shape, dtype=np.int64)) * t.np_dtype.itemsize
        if nbytes == 0:
            return np.zeros(shape, t.np_dtype)
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,))
        return mm.view(t.np_dtype).reshape(shape)

    def read(self, key: str, rows: int | None = None, start: int = 0) -> np.ndarray:
        """Tensor ``key`` as an owned numpy array; only rows ``start .. start + rows``
        if given."""
        t = self.info(key)
        shape, offset = self._rows(t, rows, start)
        nbytes = int(np.prod(shape, dtype=np.int64)) * t.np_dtype.itemsize
        out = np.empty(shape, dtype=t.np_dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < nbytes:
                got = os.preadv(fd, [buf[done:nbytes]], offset + done)
                if got == 0:
                    raise DataError(f"{self.path}: unexpected end of file reading {key!r}")
                done += got
        finally:
            os.close(fd)
        return out


# --------------------------------------------------------------------------- hidden states


@dataclass
class HiddenStates:
    """Tokens ``[first_token, n)`` of one ``hs_{i}.safetensors`` (``first_token`` 0 but
    for a process that holds part of a row).

    ``values``: [n, n_aux+1, H] in ``dtype`` (fp8 files already dequantised);
    slot ``:-1`` are the aux layers (flattened layer-major to [n, n_aux*H] by the
    packer), slot ``-1`` the verifier's last layer output before its final norm.
    ``nbytes_read``: bytes read from disk, for throughput accounting.
    """

    values: np.ndarray
    nbytes_read: int


def read_hidden_states(
    path: str | os.PathLike,
    *,
    row: int,
    input_ids: np.ndarray,
    n_aux: int,
    hidden_size: int,
    dtype: np.dtype,
    max_tokens: int | None = None,
    first_token: int = 0,
    check_finite: bool = True,
    mmap: bool = False,
) -> HiddenStates:
    """Read and validate one hidden-state file against its prepared-dataset row.

    Args:
      path: the ``hs_{row}.safetensors`` file.
      row: dataset row index (file index), for messages.
      input_ids: [T] the row's ``input_ids``; ``token_ids`` must equal it.
      n_aux, hidden_size: expected geometry, ``hidden_states`` is [T, n_aux+1, H].
      dtype: output dtype of ``values`` (fp8 is dequantised into it).
      max_tokens: read only the first ``max_tokens`` tokens (the row truncates).
      first_token: read from this token on: ``values`` holds tokens
        ``[first_token, n)`` (a process that holds only part of a row's tokens,
        docs/design.md "Context parallelism"). The token ids are checked whole.
      check_finite: reject NaN/inf in the tokens read (callers that copy the values
        anyway can pass False and run :func:`check_finite_values` on the copy, which
        is faster than a pass over the file pages).
      mmap: when no conversion is needed, return a read-only memory-mapped view
        instead of a copy (a file truncated while mapped would raise SIGBUS, so
        use it only for files that are complete, as offline data is).

    Raises:
      BadSampleError: missing file, truncated file, missing key, token mismatch,
        wrong T / slot count / H, unsupported dtype, non-finite values.
    """
    path = Path(path)

    def bad(reason: str) -> BadSampleError:
        return BadSampleError(path, row, reason)

    try:
        f = SafetensorsFile(path)
    except FileNotFoundError:
        raise bad("hidden states file not found") from None
    except DataError as e:
        raise bad(str(e).removeprefix(f"{path}: ")) from None
    for key in ("hidden_states", "token_ids"):
        if key not in f:
            raise bad(f"missing tensor {key!r} (found: {sorted(f.keys())})")
    hs, tok = f.info("hidden_states"), f.info("token_ids")
    if len(tok.shape) != 1 or tok.dtype not in ("I64", "I32", "U32", "U64"):
        raise bad(f"token_ids must be a 1-D integer tensor, got {tok.dtype}{list(tok.shape)}")
    token_ids = f.read("token_ids")
    problem = sample_problem(token_ids, hs.shape, input_ids, n_aux=n_aux, hidden_size=hidden_size)
    if problem:
        raise bad(problem)
    n_tokens, t = len(input_ids), hs.shape[0]
    n = n_tokens if max_tokens is None else min(max_tokens, n_tokens)
    a = min(max(first_token, 0), n)  # tokens [a, n) are read
    if hs.dtype in FP8_DTYPES:
        if SCALES_KEY not in f:
            raise bad(f"{hs.dtype} hidden_states without {SCALES_KEY!r}")
        sc = f.info(SCALES_KEY)
        if sc.shape != (t, 1, 1) or sc.dtype not in FLOAT_DTYPES:
            raise bad(
                f"{SCALES_KEY} must be float [T, 1, 1] = [{t}, 1, 1], got "
                f"{sc.dtype}{list(sc.shape)}"
            )
        q = f.read("hidden_states", rows=n - a, start=a)
        scales = f.read(SCALES_KEY, rows=n - a, start=a).astype(np.float32)
        values = dequantize_fp8(q, scales, dtype)
        nbytes = q.nbytes + scales.nbytes
    elif hs.dtype in FLOAT_DTYPES:
        if mmap and hs.np_dtype == dtype:
            raw = f.view("hidden_states", rows=n - a, start=a)
        else:
            raw = f.read("hidden_states", rows=n - a, start=a)
        nbytes = raw.nbytes
        values = raw if raw.dtype == dtype else raw.astype(dtype)
    else:
        raise bad(f"hidden_states has dtype {hs.dtype}, expected a float or float8 type")
    nbytes += token_ids.nbytes
    if check_finite:
        check_finite_values(values, path=path, row=row)
    return HiddenStates(values=values, nbytes_read=nbytes)


def sample_problem(
    token_ids: np.ndarray,
    hs_shape: Sequence[int],
    input_ids: np.ndarray,
    *,
    n_aux: int,
    hidden_size: int,
) -> str | None:
    """Why a sample (``token_ids`` [T], ``hidden_states`` of ``hs_shape``) does not fit
    its prepared row ``input_ids`` and the drafter geometry; None when it does."""
    n_tokens = len(input_ids)
    if len(token_ids) != n_tokens:
        return (
            f"token_ids has {len(token_ids)} tokens but the prepared dataset row has "
            f"{n_tokens} input_ids (hidden states were extracted from different data)"
        )
    if not np.array_equal(token_ids, input_ids):
        p = int(np.argmax(token_ids != input_ids))
        return (
            f"token_ids differ from the prepared dataset's input_ids (first at position {p}: "
            f"sample has {int(token_ids[p])}, dataset has {int(input_ids[p])})"
        )
    if len(hs_shape) != 3:
        return f"hidden_states must be [T, n_aux+1, H], got shape {list(hs_shape)}"
    t, slots, h = hs_shape
    if t != n_tokens:
        return f"hidden_states has T={t} tokens but token_ids has {n_tokens}"
    if slots != n_aux + 1:
        return (
            f"hidden_states has {slots} layer slots, expected n_aux+1 = {n_aux + 1} "
            f"({n_aux} aux layers + the last layer); wrong aux_hidden_state_layer_ids?"
        )
    if h != hidden_size:
        return f"hidden_states has hidden size {h}, expected {hidden_size}"
    return None


def check_finite_values(
    values: np.ndarray, *, path: str | os.PathLike, row: int, first_token: int = 0
) -> None:
    """Raise BadSampleError if ``values`` [n, n_aux+1, H] (token-major) has NaN/inf.

    ``first_token`` offsets the token index in the message (for a view of a part).
    """
    bad_at = first_non_finite(values)
    if bad_at is not None:
        raise BadSampleError(
            path,
            row,
            f"hidden_states has non-finite values (first at token "
            f"{bad_at[0] + first_token}, slot {bad_at[1]})",
        )


def dequantize_fp8(q: np.ndarray, scales: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``q * scale`` per token: [n, K, H] fp8, [n, 1, 1] fp32 -> [n, K, H] ``dtype``.

    For a bf16 output this reproduces hs_connectors' ``fp8.to(bf16) * scale.to(bf16)``
    bit for bit (both factors rounded to bf16, product rounded once); for float32 the
    scale is kept in full precision.
    """
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return q.astype(np.float32) * scales
    s = scales.astype(dtype).astype(np.float32)
    return (q.astype(np.float32) * s).astype(dtype)


_FINITE_CHUNK = 1 << 18  # elements; keeps the scratch in cache (~4x faster than whole-array)


def _all_finite(x: np.ndarray) -> bool:
    flat = x.reshape(-1)
    if x.dtype == np.dtype(ml_dtypes.bfloat16):
        # bf16 is non-finite iff its 8 exponent bits are all set: max(|bits|) >= 0x7F80.
        bits = flat.view(np.uint16)
        scratch = np.empty(min(_FINITE_CHUNK, len(bits)), np.uint16)
        for i in range(0, len(bits), _FINITE_CHUNK):
            s = scratch[: len(bits[i : i + _FINITE_CHUNK])]
            np.bitwise_and(bits[i : i + _FINITE_CHUNK], 0x7FFF, out=s)
            if s.max() >= 0x7F80:
                return False
        return True
    for i in range(0, len(flat), _FINITE_CHUNK):
        part = flat[i : i + _FINITE_CHUNK]  # min/max propagate NaN and expose +-inf
        if not (np.isfinite(part.min()) and np.isfinite(part.max())):
            return False
    return True


def first_non_finite(x: np.ndarray) -> tuple[int, ...] | None:
    """Index of the first NaN/inf in ``x``, or None (chunked; bf16 by a bit test)."""
    if x.size == 0 or _all_finite(x):
        return None
    bad = ~np.isfinite(x.astype(np.float32))
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), x.shape))


def check_extraction_config(
    hidden_states_dir: str | os.PathLike,
    *,
    n_aux: int,
    hidden_size: int,
    aux_layer_ids: Sequence[int] | None = None,
) -> dict | None:
    """Check ``extraction_config.json`` (written by launch/extract_hidden_states.py).

    Per-file checks see the slot count and H, not *which* layers were extracted;
    the record does. Returns the record, or None when the folder has none (files
    from other extractors). Raises DataError naming the field that disagrees.
    """
    path = Path(hidden_states_dir) / EXTRACTION_CONFIG
    if not path.exists():
        return None
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    ids = cfg.get("layer_ids")
    if ids is not None:
        if len(ids) != n_aux + 1:
            raise DataError(
                f"{path}: layer_ids {ids} has {len(ids)} slots, expected n_aux+1 = {n_aux + 1}"
            )
        n_layers = cfg.get("num_hidden_layers")
        if n_layers is not None and ids[-1] != n_layers:
            raise DataError(
                f"{path}: the last slot holds layer {ids[-1]}, but the trainer needs "
                f"the verifier's last layer ({n_layers}) there"
            )
        if aux_layer_ids is not None and list(ids[:-1]) != list(aux_layer_ids):
            raise DataError(
                f"{path}: hidden states hold aux layers {ids[:-1]}, the draft "
                f"config asks for {list(aux_layer_ids)}"
            )
    if cfg.get("hidden_size") is not None and cfg["hidden_size"] != hidden_size:
        raise DataError(f"{path}: hidden_size {cfg['hidden_size']}, expected {hidden_size}")
    return cfg


def hidden_states_file_dtype(path: str | os.PathLike) -> str:
    """The safetensors dtype name of ``hidden_states`` in ``path`` (header only)."""
    return SafetensorsFile(path).info("hidden_states").dtype


# --------------------------------------------------------------------------- prepared dataset


class _ListColumn:
    """Zero-copy row access to an Arrow list<int> column split into chunks."""

    def __init__(self, chunks: Sequence[pa.Array]):
        self.offsets = [
            np.asarray(c.offsets.to_numpy(zero_copy_only=False), np.int64) for c in chunks
        ]
        self.values = [c.values.to_numpy(zero_copy_only=False) for c in chunks]
        self.starts = np.cumsum([0] + [len(c) for c in chunks])

    def lengths(self) -> np.ndarray:
        return np.concatenate([np.diff(o) for o in self.offsets] or [np.zeros(0, np.int64)])

    def __getitem__(self, i: int) -> np.ndarray:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        j = i - int(self.starts[k])
        o = self.offsets[k]
        return self.values[k][o[j] : o[j + 1]]


class PreparedDataset:
    """The prepared dataset folder, memory-mapped; row ``i`` is sample ``i``.

    ``input_ids(i)`` -> int64 [T_i], ``loss_mask(i)`` -> int64 [T_i] (0/1),
    ``seq_len`` -> int64 [N]. Checked on open: ``state.json`` and its shards exist,
    the three columns exist without nulls, ``seq_len`` equals the number of
    ``input_ids`` and ``loss_mask`` has the same length, row by row.

    Picklable (only the path travels; worker processes re-open the files).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._open()

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.path = state["path"]
        self._open()

    def _shard_paths(self) -> list[Path]:
        state_file = self.path / "state.json"
        if not self.path.is_dir():
            raise DataError(f"{self.path}: prepared dataset folder not found")
        if not state_file.exists():
            raise DataError(
                f"{self.path}: no state.json; expected a HuggingFace save_to_disk folder "
                "as written by `speculators prepare-data`"
            )
        try:
            files = json.loads(state_file.read_text())["_data_files"]
            paths = [self.path / d["filename"] for d in files]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(f"{state_file}: no valid _data_files list ({e})") from None
        for p in paths:
            if not p.exists():
                raise DataError(f"{state_file}: lists shard {p.name}, which does not exist")
        return paths

    def _open(self) -> None:
        tables = []
        for p in self._shard_paths():
            source = pa.memory_map(str(p), "r")
            try:
                tables.append(pa.ipc.open_stream(source).read_all())
            except pa.ArrowInvalid:
                try:
                    tables.append(pa.ipc.open_file(pa.memory_map(str(p), "r")).read_all())
                except pa.ArrowInvalid as e:
                    raise DataError(f"{p}: not an Arrow IPC file ({e})") from None
        schemas = {t.schema.remove_metadata() for t in tables}
        if len(schemas) > 1:
            raise DataError(f"{self.path}: shards have different schemas: {schemas}")
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
        if missing:
            raise DataError(
                f"{self.path}: prepared dataset has no column(s) {missing} "
                f"(columns: {table.column_names}); expected {list(REQUIRED_COLUMNS)} "
                "as written by `speculators prepare-data`"
            )
        for c in REQUIRED_COLUMNS:
            col = table.column(c)
            if col.null_count:
                raise DataError(f"{self.path}: column {c!r} has {col.null_count} nulls")
        for c in ("input_ids", "loss_mask"):
            t = table.schema.field(c).type
            if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_integer(
                t.value_type
            ):
                raise DataError(f"{self.path}: column {c!r} must be a list of ints, got {t}")
        self._ids = _ListColumn(table.column("input_ids").chunks)
        self._mask = _ListColumn(table.column("loss_mask").chunks)
        self.seq_len = table.column("seq_len").to_numpy().astype(np.int64)
        n_ids = self._ids.lengths()
        bad = np.flatnonzero(n_ids != self.seq_len)
        if len(bad):
            raise DataError(
                f"{self.path}: seq_len differs from len(input_ids) at {len(bad)} rows "
                f"(first: row {bad[0]}, seq_len {self.seq_len[bad[0]]}, "
                f"{n_ids[bad[0]]} input_ids)"
            )
        bad = np.flatnonzero(self._mask.lengths() != n_ids)
        if len(bad):
            raise DataError(
                f"{self.path}: loss_mask and input_ids lengths differ at {len(bad)} rows "
                f"(first: row {bad[0]})"
            )

    def __len__(self) -> int:
        return len(self.seq_len)

    def max_token_id(self) -> int:
        """The largest input id of any row (-1 when there are none)."""
        c = self._ids
        parts = [v[o[0] : o[-1]] for v, o in zip(c.values, c.offsets, strict=True) if o[-1] > o[0]]
        return max((int(p.max()) for p in parts), default=-1)

    def input_ids(self, i: int) -> np.ndarray:
        return self._ids[i]

    def loss_mask(self, i: int) -> np.ndarray:
        return self._mask[i]
