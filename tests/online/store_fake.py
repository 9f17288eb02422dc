"""An in-process stand-in for ``mooncake.store.MooncakeDistributedStore``.

Implements the calls dspark_jax/data/online/mooncake.py makes, with the real store's
return conventions (0 / byte counts on success, negative status on failure,
-704 for a missing key), copying through raw addresses like the real
``put_from`` / ``get_into`` do, so the code under test takes the same path.
``corrupt(key)`` flips a byte of a stored object; ``ops`` records every call.
"""

from __future__ import annotations

import ctypes
import threading

NOT_FOUND = -704


class FakeMooncakeStore:
    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.registered: dict[int, int] = {}
        self.ops: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.setup_args = None

    def setup(self, *args) -> int:
        self.setup_args = args
        return 0

    def _in_registered(self, ptr: int, size: int) -> bool:
        return any(p <= ptr and ptr + size <= p + n for p, n in self.registered.items())

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered[ptr] = size
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return 0 if self.registered.pop(ptr, None) is not None else -1

    def put(self, key: str, value: bytes) -> int:
        with self.lock:
            self.ops.append(("put", key))
            self.objects[key] = bytes(value)
        return 0

    def put_from(self, key: str, ptr: int, size: int) -> int:
        if not self._in_registered(ptr, size):
            return -600  # the real store rejects unregistered memory
        with self.lock:
            self.ops.append(("put_from", key))
            self.objects[key] = ctypes.string_at(ptr, size)
        return 0

    def get(self, key: str) -> bytes:
        with self.lock:
            self.ops.append(("get", key))
            return self.objects.get(key, b"")

    def get_size(self, key: str) -> int:
        with self.lock:
            return len(self.objects[key]) if key in self.objects else NOT_FOUND

    def get_into(self, key: str, ptr: int, size: int) -> int:
        if not self._in_registered(ptr, size):
            return -600
        with self.lock:
            self.ops.append(("get_into", key))
            data = self.objects.get(key)
        if data is None:
            return NOT_FOUND
        n = min(size, len(data))
        ctypes.memmove(ptr, data, n)
        return n

    def is_exist(self, key: str) -> int:
        with self.lock:
            return int(key in self.objects)

    def remove(self, key: str, force: bool = False) -> int:
        with self.lock:
            self.ops.append(("remove", key))
            return 0 if self.objects.pop(key, None) is not None else NOT_FOUND

    # test helpers ---------------------------------------------------------------
    def corrupt(self, key: str, at: int = 0) -> None:
        with self.lock:
            data = bytearray(self.objects[key])
            data[at] ^= 0xFF
            self.objects[key] = bytes(data)
