"""What the HiCache tests share: a tiny page geometry whose KV values name their page, an L3 in a
dict, executors the test steps by hand, a loader that fails on demand, and walks over the tree."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from tierserve.cache.hashing import page_keys, salted_seed
from tierserve.cache.hicache import HiCache
from tierserve.cache.prefetch import PrefetchOptions
from tierserve.cache.radix_tree import Node
from tierserve.cache.storage import StorageBackend
from tierserve.cache.storage.base import StorageError

PS = 2  # tokens per page
SEED = b"m" * 32
DEVICE_PAGES, HOST_PAGES = 12, 24
OPTIONS = PrefetchOptions(threshold_tokens=PS, max_reserved_fraction=0.5)  # prefetch from one page on
CAP = int(HOST_PAGES * OPTIONS.max_reserved_fraction)  # host pages all running prefetches may reserve
MAX_TOKENS = 16
PARTIAL = -1.0  # the value of a request's last, partial page (it has no key)


def value(key: bytes) -> float:
    """The KV every layer, head and token of the page named ``key`` holds (exact in float32)."""
    return float(int.from_bytes(key[:2], "little") + 1)


def keys_of(tokens: list[int] | tuple[int, ...], salt: str) -> list[bytes]:
    return page_keys(salted_seed(SEED, salt), tokens, PS)


class MemoryStorage(StorageBackend):
    """L3 in a dict. ``down`` makes every call raise, as an unreachable store does."""

    def __init__(self) -> None:
        self.objects: dict[bytes, torch.Tensor] = {}
        self.down = False
        self.calls = 0
        self.callers: set[str] = set()  # threads that called
        self._lock = threading.Lock()

    def _call(self) -> None:
        with self._lock:
            self.calls += 1
            self.callers.add(threading.current_thread().name)
        if self.down:
            raise StorageError("store unreachable (test outage)")

    def present(self, keys: list[bytes]) -> int:
        """``batch_exists`` for the test itself: no call counted, works while down."""
        with self._lock:
            return next((i for i, k in enumerate(keys) if k not in self.objects), len(keys))

    def batch_exists(self, keys: list[bytes]) -> int:
        self._call()
        return self.present(keys)

    def batch_get_into(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        self._call()
        out = []
        for key, span in zip(keys, spans, strict=True):
            with self._lock:
                data = self.objects.get(key)
            if data is not None:
                span.copy_(data)
            out.append(data is not None)
        return out

    def batch_set_from(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        self._call()
        with self._lock:
            for key, span in zip(keys, spans, strict=True):
                self.objects.setdefault(key, span.clone())
        return [True] * len(keys)

    def get(self, key: bytes) -> bytes | None:
        self._call()
        with self._lock:
            data = self.objects.get(key)
        return None if data is None else data.numpy().tobytes()

    def set(self, key: bytes, data: bytes) -> bool:
        raise NotImplementedError

    def clear(self) -> None:
        with self._lock:
            self.objects.clear()

    def stats(self) -> dict[str, Any]:
        return {"pages": len(self.objects), "calls": self.calls}


class FaultyLoader:
    """The cache's L2 -> L1 loader with host-memory faults on demand: after ``arm(layer)`` the next
    load started fails while copying ``layer`` (its earlier layers are copied), as a failing
    host-to-device copy does; the decision is taken on the engine thread, so it replays alike."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.armed: int | None = None

    def submit(self, fn, copy_layer) -> Future:
        if self.armed is None:
            return self.inner.submit(fn, copy_layer)
        layer, self.armed = self.armed, None

        def faulty(i: int) -> None:
            if i == layer:
                raise RuntimeError("host memory copy failed (test fault)")
            copy_layer(i)

        return self.inner.submit(fn, faulty)

    def shutdown(self, wait: bool = True) -> None:
        self.inner.shutdown(wait)


class StepExecutor:
    """A single-worker executor whose tasks run, in order, only when the test says so."""

    def __init__(self) -> None:
        self.queue: deque[tuple[Future, Any, tuple]] = deque()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self.queue.append((future, fn, args))
        return future

    def run(self, n: int) -> None:
        for _ in range(min(n, len(self.queue))):
            future, fn, args = self.queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the future, as a real executor does
                future.set_exception(exc)

    def shutdown(self, wait: bool = True) -> None:
        self.run(len(self.queue))


@dataclass
class Held:
    """A running request: its pages (the hit's, then its own) and its hit."""

    tokens: list[int]
    salt: str
    pages: list[int]
    hit: Any


def pick(data, items: list) -> int | None:
    """An index into ``items`` (None if empty), drawn the same way whatever their number: with
    worker threads the number may depend on timing, and hypothesis needs the same draws on replay."""
    i = data.draw(st.integers(0, 63))
    return i % len(items) if items else None


def loaded(node: Node) -> bool:
    return node.loading is None or node.loading.done()




def assert_loads_tracked(cache: HiCache) -> None:
    """A ``loading`` node belongs to a load the cache still tracks: once the load is agreed done (or
    failed) none of its nodes, nor the parts they were split into, stays ``loading``."""
    running = {id(x) for x in cache.loads.running}
    for node in cache.tree.nodes():
        assert node.loading is None or id(node.loading) in running, "a node stays loading for good"
