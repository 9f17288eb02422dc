"""Hidden states through a Mooncake store: both wire formats, both sides.

The store is ``mooncake.store.MooncakeDistributedStore`` (package
``mooncake-transfer-engine``; ``-non-cuda`` on machines without CUDA), started
against a ``mooncake_master``. Only these calls are used, so a test fake can
stand in for it: ``setup``, ``put``, ``get``, ``put_from``, ``get_into``,
``get_size``, ``is_exist``, ``remove(key, force=True)``, ``register_buffer``,
``unregister_buffer``. Status codes are negative on failure (-704: no such key).

Two formats (docs/formats.md, "Mooncake transport"), told apart by the HTTP answer's
``kv_transfer_params``:

* **packed** (hs_connectors 0.9.0, ``MooncakeHiddenStatesConnector``): one raw
  object under the handle holding every tensor at a 64-byte-aligned offset; the
  manifest ``{"handle", "version": 1, "tensors": {name: {"shape", "dtype"
  ("torch.bfloat16"), "nbytes", "offset"}}, "metadata": {"num_tokens",
  "total_aligned_bytes", ...}}`` *is* the kv_transfer_params. The object may land
  a few ms after the answer; a producer failure publishes ``<handle>:error``
  (JSON ``{"error": ...}``) instead.
* **per-tensor** (the Kimi-K3 example branch): ``kv_transfer_params`` is just
  ``{"handle": K}``; the producer puts ``K:hidden_states`` and ``K:token_ids`` (raw
  C-order bytes), then ``K:meta``, JSON ``{"version": 1, "tensors": {name:
  {"shape", "dtype", "nbytes", "crc32"}}}``, last, so its presence marks the sample
  complete. The consumer checks sizes and the zlib CRC32 of every tensor.

Reads go through a registered per-thread staging buffer (``get_into``), as the
reference does, so the store copies straight into it; tensors are then copied out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import zlib
from typing import Any

import ml_dtypes
import numpy as np

logger = logging.getLogger(__name__)

VERSION = 1
OBJECT_NOT_FOUND = -704
_ALIGN = 64
_GRANULE = 64 << 20  # staging buffers grow in 64 MiB steps
TENSORS = ("hidden_states", "token_ids")

_NP_DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "uint8": np.dtype(np.uint8),
}
_NAMES = {v: k for k, v in _NP_DTYPES.items()}


class MooncakeError(RuntimeError):
    """A sample that is missing, late, corrupt or marked failed in the store."""


def np_dtype(name: Any) -> np.dtype:
    """``"torch.bfloat16"`` / ``"bfloat16"`` -> numpy dtype."""
    key = str(name).removeprefix("torch.")
    if key not in _NP_DTYPES:
        raise MooncakeError(f"unknown tensor dtype {name!r} (known: {sorted(_NP_DTYPES)})")
    return _NP_DTYPES[key]


def dtype_name(dtype: np.dtype, torch_style: bool = False) -> str:
    name = _NAMES[np.dtype(dtype)]
    return f"torch.{name}" if torch_style else name


@dataclasses.dataclass
class MooncakeConfig:
    """Connection settings, in ``MooncakeDistributedStore.setup`` order (the
    reference's ``MooncakeStoreConfig``; ``--mooncake-*`` flags)."""

    local_hostname: str = "localhost"
    metadata_server: str = "P2PHANDSHAKE"
    master_server_address: str = "127.0.0.1:50051"
    global_segment_size: int = 4 << 30
    local_buffer_size: int = 2 << 30
    protocol: str = "tcp"
    device_name: str = ""
    num_writer_threads: int = 4

    @classmethod
    def from_gib(
        cls, *, global_segment_gib: float, local_buffer_gib: float, **kw
    ) -> MooncakeConfig:
        return cls(
            global_segment_size=round(global_segment_gib * 1024**3),
            local_buffer_size=round(local_buffer_gib * 1024**3),
            **kw,
        )


def open_store(config: MooncakeConfig) -> Any:
    """A ``MooncakeDistributedStore`` connected to the master of ``config``."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ImportError(
            "--hidden-states-backend mooncake needs the mooncake-transfer-engine package "
            f"(pip install -e '.[mooncake]'; without CUDA: mooncake-transfer-engine-non-cuda): {e}"
        ) from e
    store = MooncakeDistributedStore()
    status = store.setup(
        config.local_hostname,
        config.metadata_server,
        config.global_segment_size,
        config.local_buffer_size,
        config.protocol,
        config.device_name,
        config.master_server_address,
    )
    if status != 0:
        raise MooncakeError(
            f"Mooncake setup against master {config.master_server_address} "
            f"(metadata {config.metadata_server}, {config.protocol}) failed with status {status}"
        )
    return store


def _check(op: str, key: str, status: Any) -> None:
    if not isinstance(status, int) or status < 0:
        raise MooncakeError(f"Mooncake {op} failed for key {key!r} with status {status}")


class _Staging:
    """Registered host buffers, one per (thread, role), grown on demand. Callers use
    fixed thread pools (the online source, the server's writers), so the number of
    buffers stays bounded."""

    def __init__(self, store: Any):
        self.store = store
        self.buffers: dict[tuple[int, str], np.ndarray] = {}

    def get(self, role: str, nbytes: int) -> np.ndarray:
        slot = (threading.get_ident(), role)
        buf = self.buffers.get(slot)
        if buf is not None and buf.nbytes >= nbytes:
            return buf
        if buf is not None:
            del self.buffers[slot]
            self.store.unregister_buffer(buf.ctypes.data)
        # Samples round up to 64 MiB steps (few re-registrations as lengths vary);
        # small objects (meta JSON, error markers) to 1 MiB.
        granule = _GRANULE if role != "meta" else 1 << 20
        capacity = -(-max(nbytes, 1) // granule) * granule
        buf = np.empty(capacity, np.uint8)
        _check(
            "register_buffer",
            f"<{role} staging>",
            self.store.register_buffer(buf.ctypes.data, capacity),
        )
        self.buffers[slot] = buf
        return buf


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def packed_manifest(handle: str, hidden_states: np.ndarray, token_ids: np.ndarray) -> dict:
    """The 0.9.0 transfer manifest for these tensors (what vLLM returns)."""
    tensors, offset = {}, 0
    for name, arr in zip(TENSORS, (hidden_states, token_ids)):
        tensors[name] = {
            "shape": list(arr.shape),
            "dtype": dtype_name(arr.dtype, torch_style=True),
            "nbytes": int(arr.nbytes),
            "offset": offset,
        }
        offset = _align(offset + arr.nbytes)
    return {
        "handle": handle,
        "version": VERSION,
        "tensors": tensors,
        "metadata": {
            "num_tokens": int(token_ids.shape[0]),
            "total_aligned_bytes": offset,
            "extract_mode": "prompt_only",
        },
    }


class MooncakeHiddenStates:
    """Put / wait / get / delete hidden-state samples in one store (both formats)."""

    def __init__(self, store: Any, poll_interval: float = 0.05):
        self.store = store
        self.poll_interval = poll_interval
        self._staging = _Staging(store)

    # ----------------------------------------------------------------- producer
    def _put_array(self, key: str, arr: np.ndarray) -> None:
        buf = self._staging.get("put", arr.nbytes)
        buf[: arr.nbytes] = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        _check("put_from", key, self.store.put_from(key, buf.ctypes.data, arr.nbytes))

    def put_packed(self, handle: str, hidden_states: np.ndarray, token_ids: np.ndarray) -> dict:
        """Publish one packed object; returns the manifest (the kv_transfer_params)."""
        manifest = packed_manifest(handle, hidden_states, token_ids)
        total = manifest["metadata"]["total_aligned_bytes"]
        buf = self._staging.get("put", total)
        for name, arr in zip(TENSORS, (hidden_states, token_ids)):
            spec = manifest["tensors"][name]
            region = buf[spec["offset"] : spec["offset"] + spec["nbytes"]]
            region[:] = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        _check("put_from", handle, self.store.put_from(handle, buf.ctypes.data, total))
        return manifest

    def put_per_tensor(self, handle: str, hidden_states: np.ndarray, token_ids: np.ndarray) -> dict:
        """Publish ``K:hidden_states``, ``K:token_ids``, then ``K:meta``; returns the
        kv_transfer_params ``{"handle": K}``."""
        meta = {"version": VERSION, "tensors": {}}
        for name, arr in zip(TENSORS, (hidden_states, token_ids)):
            arr = np.ascontiguousarray(arr)
            self._put_array(f"{handle}:{name}", arr)
            meta["tensors"][name] = {
                "shape": list(arr.shape),
                "dtype": dtype_name(arr.dtype),
                "nbytes": int(arr.nbytes),
                "crc32": zlib.crc32(arr.reshape(-1).view(np.uint8)),
            }
        blob = json.dumps(meta).encode()
        _check("put", f"{handle}:meta", self.store.put(f"{handle}:meta", blob))
        return {"handle": handle}

    def put_error(self, handle: str, message: str) -> None:
        """A terminal marker so the consumer fails fast (and may retry)."""
        blob = json.dumps({"error": message[:4096]}).encode()
        _check("put", f"{handle}:error", self.store.put(f"{handle}:error", blob))

    # ----------------------------------------------------------------- consumer
    @staticmethod
    def is_packed(params: dict) -> bool:
        return "tensors" in params or "version" in params

    def get(self, params: dict, timeout: float) -> tuple[np.ndarray, np.ndarray]:
        """Wait for the sample of ``params`` (either format); (hidden_states, token_ids)."""
        handle = str(params.get("handle") or "")
        if not handle:
            raise MooncakeError(f"kv_transfer_params has no Mooncake handle: {params}")
        if self.is_packed(params):
            if params.get("version") != VERSION:
                raise MooncakeError(
                    f"Mooncake manifest version {params.get('version')!r} for {handle!r}, "
                    f"this trainer reads version {VERSION}"
                )
            self._wait(handle, handle, timeout)
            return self._get_packed(params)
        self._wait(handle, f"{handle}:meta", timeout)
        return self._get_per_tensor(handle)

    def delete(self, params_or_handle: dict | str) -> None:
        """Remove every key of a sample (both formats; missing keys are fine)."""
        handle = (
            params_or_handle
            if isinstance(params_or_handle, str)
            else str(params_or_handle.get("handle") or "")
        )
        for key in (handle, *(f"{handle}:{s}" for s in (*TENSORS, "meta", "error"))):
            status = self.store.remove(key, force=True)
            if status != OBJECT_NOT_FOUND:
                _check("remove", key, status)

    def _exists(self, key: str) -> bool:
        status = self.store.is_exist(key)
        if status not in (0, 1):
            raise MooncakeError(f"Mooncake is_exist failed for key {key!r} with status {status}")
        return status == 1

    def _wait(self, handle: str, ready_key: str, timeout: float) -> None:
        # The extractor answers the HTTP request before its put completes; poll with
        # backoff. The error marker wins over the data if both are present.
        deadline = time.monotonic() + timeout
        delay = min(0.001, self.poll_interval)
        while True:
            if self._exists(f"{handle}:error"):
                raise MooncakeError(
                    f"extractor failed to publish {handle!r}: {self._error(handle)}"
                )
            if self._exists(ready_key):
                return
            if time.monotonic() >= deadline:
                raise MooncakeError(
                    f"timed out after {timeout:g}s waiting for Mooncake key {ready_key!r}"
                )
            time.sleep(delay)
            delay = min(delay * 2, self.poll_interval)

    def _error(self, handle: str) -> str:
        raw = self._read(f"{handle}:error", role="meta")
        try:
            return str(json.loads(raw.tobytes()).get("error", "unknown producer error"))
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            return f"(unreadable error marker: {raw[:64].tobytes()!r})"

    def _read(self, key: str, expected: int | None = None, role: str = "get") -> np.ndarray:
        """The object under ``key`` in this thread's staging buffer (a view)."""
        size = self.store.get_size(key)
        if not isinstance(size, int) or size < 0:
            raise MooncakeError(f"Mooncake object {key!r} unavailable (status {size})")
        if expected is not None and size != expected:
            raise MooncakeError(f"Mooncake object {key!r} has {size} bytes, expected {expected}")
        buf = self._staging.get(role, size)
        got = self.store.get_into(key, buf.ctypes.data, size)
        if got != size:
            raise MooncakeError(f"Mooncake get_into {key!r} returned {got}, expected {size} bytes")
        return buf[:size]

    @staticmethod
    def _tensor(key: str, raw: np.ndarray, spec: Any, offset: int = 0) -> np.ndarray:
        try:
            shape = tuple(int(d) for d in spec["shape"])
            dtype = np_dtype(spec["dtype"])
            nbytes = int(spec["nbytes"])
        except (KeyError, TypeError, ValueError) as e:
            raise MooncakeError(f"invalid tensor spec for {key!r}: {spec!r}") from e
        want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes != want or offset < 0 or offset + nbytes > raw.nbytes:
            raise MooncakeError(
                f"tensor {key!r} out of bounds: offset {offset}, nbytes {nbytes}, shape "
                f"{list(shape)} x {dtype.name} needs {want}, object has {raw.nbytes} bytes"
            )
        # Copy out: the staging buffer is reused by the next read.
        return raw[offset : offset + nbytes].view(dtype).reshape(shape).copy()

    def _get_packed(self, manifest: dict) -> tuple[np.ndarray, np.ndarray]:
        handle = manifest["handle"]
        try:
            total = int(manifest["metadata"]["total_aligned_bytes"])
            specs = manifest["tensors"]
            missing = [n for n in TENSORS if n not in specs]
        except (KeyError, TypeError, ValueError) as e:
            raise MooncakeError(f"invalid Mooncake manifest for {handle!r}: {manifest}") from e
        if missing:
            raise MooncakeError(f"Mooncake manifest for {handle!r} lacks {missing}")
        raw = self._read(handle, expected=total)
        hs, tok = (
            self._tensor(f"{handle}:{n}", raw, specs[n], int(specs[n].get("offset", -1)))
            for n in TENSORS
        )
        return hs, tok

    def _get_per_tensor(self, handle: str) -> tuple[np.ndarray, np.ndarray]:
        raw = self._read(f"{handle}:meta", role="meta")
        try:
            meta = json.loads(raw.tobytes())
            specs = meta["tensors"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise MooncakeError(f"corrupt Mooncake meta {handle + ':meta'!r}: {e}") from e
        if meta.get("version", VERSION) != VERSION:
            raise MooncakeError(
                f"{handle}:meta has version {meta.get('version')!r}, expected {VERSION}"
            )
        out = []
        for name in TENSORS:
            key = f"{handle}:{name}"
            if name not in specs:
                raise MooncakeError(f"{handle}:meta lists no {name!r}")
            spec = specs[name]
            data = self._read(key, expected=int(spec.get("nbytes", -1)))
            crc = zlib.crc32(data)
            if crc != spec.get("crc32"):
                raise MooncakeError(
                    f"CRC32 mismatch for {key!r}: data {crc:#010x}, meta {spec.get('crc32')!r}"
                )
            out.append(self._tensor(key, data, spec))
        return out[0], out[1]
