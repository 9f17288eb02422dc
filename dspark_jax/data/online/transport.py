"""Transports: how a generated sample gets from the extractor to the trainer.

The extractor's HTTP answer carries ``kv_transfer_params``; a transport turns them
into arrays and removes the sample afterwards (``--on-generate delete``):

* :class:`FileTransport` (``--hidden-states-backend file|fp8``): a safetensors file
  on shared storage at ``hidden_states_path``. The writer (vLLM's
  ``ExampleHiddenStatesConnector``, or launch/serve_hidden_states.py) holds an
  exclusive ``flock`` on ``<path>.lock`` until the file is complete; the reader takes
  that lock, removes the ``.lock`` file, then reads (speculators' protocol).
* :class:`MooncakeTransport` (``--hidden-states-backend mooncake``): a Mooncake
  store, either wire format (dspark_jax/data/online/mooncake.py).

``fetch`` returns ``(hidden_states [T, slots, H], token_ids [T])`` as stored (fp8
files dequantised to float32) or raises :class:`TransportError`; validation
against the prepared row is the caller's (online.py). Transports connect lazily
(``setup``), so they can be pickled into Grain worker processes before use.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from dspark_jax.data.files import FP8_DTYPES, DataError, SafetensorsFile, dequantize_fp8
from dspark_jax.data.hs_names import SCALES_KEY
from dspark_jax.data.online.client import transfer_handle
from dspark_jax.data.online.mooncake import (
    MooncakeConfig,
    MooncakeError,
    MooncakeHiddenStates,
    open_store,
)


class TransportError(RuntimeError):
    """The sample could not be obtained (late, missing, corrupt, marked failed)."""


def wait_for_lock(lock_path: str | os.PathLike, timeout: float, poll: float = 0.05) -> None:
    """Take the writer's ``.lock`` (exclusive flock: held until the file is complete),
    then remove it, as speculators' client does. Polls from 1 ms, doubling up to
    ``poll``: the file usually lands a few ms after the answer, and a fixed 50 ms
    poll cost ~40 ms per sample (bench/online_pipeline.py)."""
    fd = os.open(lock_path, os.O_RDWR)
    delay = min(0.001, poll)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"timed out after {timeout:g}s waiting for the writer's lock {lock_path}"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, poll)
    finally:
        os.close(fd)
    Path(lock_path).unlink(missing_ok=True)


class Transport:
    name = "base"

    def setup(self) -> None:
        """Connect (called in the process that fetches, before the first fetch)."""

    def fetch(self, params: dict[str, Any], timeout: float) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def delete(self, params: dict[str, Any]) -> None:
        raise NotImplementedError


class FileTransport(Transport):
    name = "file"

    def fetch(self, params: dict[str, Any], timeout: float) -> tuple[np.ndarray, np.ndarray]:
        path = Path(transfer_handle(params))
        lock = Path(f"{path}.lock")
        try:
            if lock.exists():
                wait_for_lock(lock, timeout)
            f = SafetensorsFile(path)
            for key in ("hidden_states", "token_ids"):
                if key not in f:
                    raise TransportError(f"{path}: missing tensor {key!r} (found {f.keys()})")
            token_ids = f.read("token_ids")
            info = f.info("hidden_states")
            hs = f.read("hidden_states")
            if info.dtype in FP8_DTYPES:
                if SCALES_KEY not in f:
                    raise TransportError(f"{path}: {info.dtype} hidden_states without {SCALES_KEY}")
                scales = f.read(SCALES_KEY).astype(np.float32)
                if scales.shape != (hs.shape[0], 1, 1):
                    raise TransportError(
                        f"{path}: {SCALES_KEY} has shape {list(scales.shape)}, "
                        f"expected [{hs.shape[0]}, 1, 1]"
                    )
                hs = dequantize_fp8(hs, scales, np.float32)
            return hs, token_ids
        except (FileNotFoundError, TimeoutError, DataError) as e:
            raise TransportError(str(e) if str(path) in str(e) else f"{path}: {e}") from None

    def delete(self, params: dict[str, Any]) -> None:
        path = Path(transfer_handle(params))
        lock = Path(f"{path}.lock")
        if lock.exists():  # a rejected answer whose writer may still be busy
            try:
                wait_for_lock(lock, timeout=60.0)
            except (TimeoutError, OSError):
                return  # leave it: the writer still holds it
        path.unlink(missing_ok=True)


class MooncakeTransport(Transport):
    """``store_factory`` (tests) builds a store object instead of connecting to
    ``config``'s master; it must be picklable to reach worker processes."""

    name = "mooncake"

    def __init__(self, config: MooncakeConfig, store_factory=None):
        self.config = config
        self.store_factory = store_factory
        self._hs: MooncakeHiddenStates | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"config": self.config, "store_factory": self.store_factory}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["config"], state["store_factory"])

    def setup(self) -> None:
        with self._lock:
            if self._hs is None:
                store = self.store_factory() if self.store_factory else open_store(self.config)
                self._hs = MooncakeHiddenStates(store)

    @property
    def store(self) -> MooncakeHiddenStates:
        self.setup()
        return self._hs

    def fetch(self, params: dict[str, Any], timeout: float) -> tuple[np.ndarray, np.ndarray]:
        try:
            return self.store.get(params, timeout)
        except MooncakeError as e:
            raise TransportError(str(e)) from None

    def delete(self, params: dict[str, Any]) -> None:
        try:
            self.store.delete(params)
        except MooncakeError as e:
            raise TransportError(str(e)) from None
