"""How L3 calls reach host pages: zero-copy spans of the host pool, or a staging buffer.

L3 stores one object per host page, as one contiguous span. The ``page_first`` layouts have that
span in the pool itself, so backends read and write the pool directly (``DirectPageIO``). In
``layer_first`` a page is scattered over 2 x layers blocks, so ``StagedPageIO`` gathers pages into
a small ``page_first``-shaped buffer before a write and scatters them out of it after a read: its
objects have the ``page_first`` byte format, so ``layer_first`` and ``page_first`` nodes share L3.
"""

from __future__ import annotations

import threading

import torch

from tierserve.cache.host_pool import HostKVPool
from tierserve.cache.options import HostLayout
from tierserve.cache.storage import StorageBackend

STAGING_PAGES = 16  # one prefetch chunk (prefetch.CHUNK_PAGES): one backend call per chunk either way


class PageIO:
    """Moves host pages to and from a backend; ``buffer`` is what the backend registers
    (``StorageBackend.attach_host_buffer``): every span handed to the backend lies inside it."""

    buffer: torch.Tensor

    def set_from(self, storage: StorageBackend, keys: list[bytes], host_pages: list[int]) -> list[bool]:
        """Stores ``host_pages[i]`` under ``keys[i]``; per-page success (``batch_set_from``)."""
        raise NotImplementedError

    def get_into(self, storage: StorageBackend, keys: list[bytes], host_pages: list[int]) -> list[bool]:
        """Reads ``keys[i]`` into ``host_pages[i]``; per-page success (``batch_get_into``). A page
        that failed may hold anything."""
        raise NotImplementedError


class DirectPageIO(PageIO):
    """Zero-copy: the backend reads and writes the host pool's own page spans."""

    def __init__(self, host: HostKVPool) -> None:
        self.host, self.buffer = host, host.buffer

    def set_from(self, storage: StorageBackend, keys: list[bytes], host_pages: list[int]) -> list[bool]:
        return storage.batch_set_from(keys, [self.host.page_span(p) for p in host_pages])

    def get_into(self, storage: StorageBackend, keys: list[bytes], host_pages: list[int]) -> list[bool]:
        return storage.batch_get_into(keys, [self.host.page_span(p) for p in host_pages])


class StagedPageIO(PageIO):
    """Through a ``page_first`` buffer of ``capacity`` pages, allocated once (pinned if the pool is).

    Calls are serialised (one staging buffer); a batch larger than ``capacity`` becomes several
    backend calls.
    """

    def __init__(self, host: HostKVPool, capacity: int = STAGING_PAGES) -> None:
        if capacity < 1:
            raise ValueError("the staging buffer needs at least one page")
        self.host = host
        self.staging = HostKVPool(host.geometry, capacity, HostLayout.PAGE_FIRST, pin_memory=host.buffer.is_pinned())
        self.buffer = self.staging.buffer
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self.staging.num_pages

    def set_from(self, storage: StorageBackend, keys: list[bytes], host_pages: list[int]) -> list[bool]:
        ok: list[bool] = []
        with self._lock:
            for at in range(0, len(keys), self.capacity):
                pages = host_pages[at : at + self.capacity]
                _copy(self.staging, list(range(len(pages))), self.host, pages)
                ok += storage.batch_set_from(keys[at : at + len(pages)], self._spans(len(pages)))
        return ok

    def get_into(self, storage: StorageBackend, keys: list[bytes], host_pages: list[int]) -> list[bool]:
        ok: list[bool] = []
        with self._lock:
            for at in range(0, len(keys), self.capacity):
                pages = host_pages[at : at + self.capacity]
                got = storage.batch_get_into(keys[at : at + len(pages)], self._spans(len(pages)))
                # pages that did not arrive are left alone: their contents are undefined anyway
                good = [i for i, x in enumerate(got) if x]
                _copy(self.host, [pages[i] for i in good], self.staging, good)
                ok += got
        return ok

    def _spans(self, n: int) -> list[torch.Tensor]:
        return [self.staging.page_span(i) for i in range(n)]


def page_io(host: HostKVPool, staging_pages: int = STAGING_PAGES) -> PageIO:
    """Zero-copy where the layout keeps a page contiguous, else staged."""
    if host.layout is HostLayout.LAYER_FIRST:
        return StagedPageIO(host, min(staging_pages, host.num_pages))
    return DirectPageIO(host)


def _copy(dst: HostKVPool, dst_pages: list[int], src: HostKVPool, src_pages: list[int]) -> None:
    """dst[dst_pages[i]] = src[src_pages[i]] across all layers; a run consecutive on both sides is
    one strided copy (its own loop: host_pool's copy helpers move L1 <-> L2 only)."""
    i = 0
    while i < len(dst_pages):
        n = 1
        while i + n < len(dst_pages) and dst_pages[i + n] == dst_pages[i] + n and src_pages[i + n] == src_pages[i] + n:
            n += 1
        dst.run_all_layers(dst_pages[i], n).copy_(src.run_all_layers(src_pages[i], n))
        i += n
