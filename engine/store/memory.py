"""An in-memory store with the key-value interface the mesh may use from TCPStore, for tests and benchmarks.

The mesh uses only these methods of its store (an etcd or any other backend must provide them with these
semantics): set, get, add, compare_set, check, delete_key, multi_get, multi_set, wait, clone, num_keys. A store
with leases (`has_leases()` true: engine/store/etcd.py) also provides lease_key, unlease_key, multi_get_or_none.

Same semantics as TCPStore: values come back as bytes; `add` creates a missing counter at 0; `compare_set` on a
missing key sets it only when `expected` is empty and returns the value now stored (or `expected` when nothing
was stored); `get`, `multi_get` and `wait` of a missing key fail at once with LookupError (TCPStore blocks until
its timeout, then raises). `down` simulates a lost store (every call raises ConnectionError); `restart()` a store
process that came back empty.
"""

from __future__ import annotations

import threading


def _b(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class MemoryStore:
    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.down = False  # a test sets this to simulate a lost store

    def _check_up(self) -> None:
        if self.down:
            raise ConnectionError("memory store is down")

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._check_up()
            self._data[key] = _b(value)

    def get(self, key: str) -> bytes:
        with self._lock:
            self._check_up()
            if key not in self._data:
                raise LookupError(f"key {key} not in store")
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            self._check_up()
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            return value

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        with self._lock:
            self._check_up()
            cur = self._data.get(key)
            if cur is None:
                if _b(expected) == b"":
                    self._data[key] = _b(desired)
                    return _b(desired)
                return _b(expected)
            if cur == _b(expected):
                self._data[key] = _b(desired)
            return self._data[key]

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            self._check_up()
            return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._lock:
            self._check_up()
            return self._data.pop(key, None) is not None

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self._lock:
            self._check_up()
            missing = [k for k in keys if k not in self._data]
            if missing:
                raise LookupError(f"keys {missing[:3]} not in store")
            return [self._data[k] for k in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        with self._lock:
            self._check_up()
            for k, v in zip(keys, values, strict=True):
                self._data[k] = _b(v)

    def wait(self, keys: list[str], timeout: object = None) -> None:
        with self._lock:
            self._check_up()
            missing = [k for k in keys if k not in self._data]
        if missing:
            raise LookupError(f"keys {missing[:3]} not in store")

    def num_keys(self) -> int:
        with self._lock:
            self._check_up()
            return len(self._data)

    def restart(self) -> None:
        """The store process restarted: up again, and empty."""
        with self._lock:
            self._data.clear()
            self.down = False

    def clone(self) -> "MemoryStore":
        return self  # thread-safe already; TCPStore clients clone to get their own socket

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._data)
