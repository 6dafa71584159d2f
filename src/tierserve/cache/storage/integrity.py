"""End-to-end integrity of L3 objects (``docs/tenancy.md``): every object ends
with a 16-byte trailer, the XXH3-128 digest of its name and its page bytes. A reader recomputes it
over what landed in its page: a flipped bit, a truncated object, an object stored under another
key or written in another layout fails the check and is a miss (the page is recomputed), never
KV a request attends to.

The trailer keeps reads zero-copy: host pool pages have room for it (``PageRoom``), so an object
moves as one buffer, its trailer landing right after its page; a span without that room moves as two
buffers (Mooncake reads an object into several), the trailer in a small registered buffer of its own.
XXH3-128 because it is fast (~38 GB/s on one core here against ~1.4 for BLAKE2b and ~7 for
CRC-32: ``benchmarks/integrity.py``) and 128 bits make an accidental match impossible in practice;
it guards against corruption and mix-ups, not against a writer who forges objects on purpose
(that one must not reach the store: see authenticated nodes).
"""

from __future__ import annotations

import ctypes
import queue
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import xxhash

DIGEST_BYTES = 16


def page_digest(name: bytes, page: torch.Tensor) -> bytes:
    """The trailer of the object ``name`` holding ``page`` (a contiguous CPU tensor, read in place)."""
    digest = xxhash.xxh3_128(name)
    digest.update(page.reshape(-1).view(torch.uint8).numpy())
    return digest.digest()


def span_digest(name: bytes, address: int, nbytes: int) -> bytes:
    """``page_digest`` of the ``nbytes`` at ``address`` (a span already located): no tensor steps,
    which cost a few µs a page on a read's path."""
    digest = xxhash.xxh3_128(name)
    digest.update((ctypes.c_ubyte * nbytes).from_address(address))
    return digest.digest()


def bytes_digest(name: bytes, data: bytes | memoryview) -> bytes:
    digest = xxhash.xxh3_128(name)
    digest.update(data)
    return digest.digest()


class Trailers:
    """A registered buffer of ``slots`` trailers in ``lanes`` of ``lane_slots``, each lent to one
    batch call at a time: two calls in flight (a prefetch reads its next chunk while it checks
    this one's digests, ``cache/prefetch.py``) each have their own."""

    def __init__(self, slots: int = 4096, lanes: int = 2) -> None:
        self.buffer = torch.zeros((slots, DIGEST_BYTES), dtype=torch.uint8)
        self.lane_slots = slots // lanes
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for lane in range(lanes):
            self._free.put(lane * self.lane_slots)

    @contextmanager
    def lend(self) -> Iterator[int]:
        """A lane's first slot, for one batch call of at most ``lane_slots`` objects (waits for one)."""
        base = self._free.get()
        try:
            yield base
        finally:
            self._free.put(base)

    def address(self, slot: int) -> int:
        return self.buffer.data_ptr() + slot * DIGEST_BYTES

    def write(self, slot: int, digest: bytes) -> None:
        self.buffer[slot] = torch.from_numpy(np.frombuffer(digest, dtype=np.uint8).copy())

    def read(self, base: int, n: int) -> list[bytes]:
        """Slots ``base .. base + n``'s trailers (one copy for the batch, not one per page)."""
        raw = self.buffer[base : base + n].numpy().tobytes()
        return [raw[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES] for i in range(n)]



class PageRoom:
    """Pools whose pages (dim 0) each have spare bytes for a trailer right after them
    (``HostKVPool``'s page-first layouts, ``PAGE_ROOM_BYTES``): a span that is one of their pages
    moves with its trailer as one buffer. Only pools handed over by ``attach_host_buffer`` count,
    whose contract makes the bytes between pages spare (a view of a wider tensor is not)."""

    def __init__(self) -> None:
        self._pools: list[tuple[int, int, int, int]] = []  # (first page's address, pages, stride, page bytes)

    def add(self, pool: torch.Tensor) -> None:
        if pool.dim() < 2 or not pool[0].is_contiguous():
            return
        page, stride = pool[0].nbytes, pool.stride(0) * pool.element_size()
        if stride - page >= DIGEST_BYTES:
            self._pools.append((pool.data_ptr(), pool.shape[0], stride, page))

    def covers(self, ptrs: list[int], sizes: list[int]) -> bool:
        """Whether every span (address, bytes) is a whole page of a pool with room."""
        return bool(self._pools) and all(self._page(p, n) for p, n in zip(ptrs, sizes, strict=True))

    def _page(self, ptr: int, nbytes: int) -> bool:
        return any(0 <= ptr - a < pages * stride and (ptr - a) % stride == 0 and nbytes == page
                   for a, pages, stride, page in self._pools)


def trailer_at(address: int) -> bytes:
    return ctypes.string_at(address, DIGEST_BYTES)


def write_trailer(address: int, digest: bytes) -> None:
    ctypes.memmove(address, digest, DIGEST_BYTES)
