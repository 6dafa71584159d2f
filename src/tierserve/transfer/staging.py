"""Staging memory that coalesces a KV handoff between TP sizes (``docs/tp.md``).

A head sub-range of consecutive token slots is not contiguous in a KV arena, and the transfer engine
charges per entry (``docs/mooncake.md``): written in place, such a handoff is one entry per token.
A rank that holds more heads than the destination rank (P1 -> D2) therefore gathers the route's
heads of a layer's token runs into its staging arena, and sends each run as one block that fills
whole destination slots. A rank that holds fewer heads than the destination rank (P2 -> D1) writes
whole source slots into the destination's staging arena (``StagedPart``), which the destination
scatters into its pages before the request runs. Each arena is registered with the transfer
engines once, beside the pool, so staging costs no registration per handoff.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from tierserve.transfer.layout import Block, KVArena, Route, Run

ALIGN = 64  # bytes: every range starts on a cache line


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class StagingArena:
    """``nbytes`` of memory on ``device`` handed out as byte ranges; any thread."""

    def __init__(self, nbytes: int, device: torch.device | str = "cpu") -> None:
        self.buffer = torch.empty(_aligned(max(nbytes, ALIGN)), dtype=torch.uint8, device=device)
        self.base = self.buffer.data_ptr()
        self.capacity = self.buffer.numel()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size), sorted by offset
        self._cond = threading.Condition()

    def alloc(self, nbytes: int, timeout: float = 0.0) -> int | None:
        """The offset of ``nbytes`` free bytes, waiting up to ``timeout`` s for room; None if none came."""
        size = _aligned(nbytes)
        with self._cond:
            self._cond.wait_for(lambda: self._fit(size) is not None, timeout)
            at = self._fit(size)
            if at is None:
                return None
            offset, free = self._free[at]
            self._free[at: at + 1] = [(offset + size, free - size)] if free > size else []
            return offset

    def free(self, offset: int, nbytes: int) -> None:
        """Gives back a range ``alloc`` returned (the same ``nbytes``)."""
        with self._cond:
            self._free.append((offset, _aligned(nbytes)))
            self._free.sort()
            self._free = _merged(self._free)
            self._cond.notify_all()

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[offset: offset + nbytes]

    @property
    def free_bytes(self) -> int:
        with self._cond:
            return sum(size for _, size in self._free)

    def _fit(self, size: int) -> int | None:
        return next((i for i, (_, free) in enumerate(self._free) if free >= size), None)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for offset, size in ranges:
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + size)
        else:
            out.append((offset, size))
    return out


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_size(*spans: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides every span: copies move words, not bytes
    (a strided uint8 copy ran ~6x slower than the same bytes as int64 on a 16-core machine)."""
    return next(w for w in _WORDS if all(s % w == 0 for s in spans))


def as_words(buffer: torch.Tensor, word: int) -> torch.Tensor:
    """``buffer`` (contiguous) as a flat tensor of ``word``-byte integers."""
    return buffer.view(torch.uint8).view(-1).view(_WORDS[word])


def slot_view(pool: torch.Tensor, arena: KVArena, word: int) -> torch.Tensor:
    """The pool as [layers, 2, slots, slot words] of ``word`` bytes (a view)."""
    return as_words(pool, word).view(arena.num_layers, 2, arena.num_slots, arena.slot_bytes // word)


def gathers(src: KVArena, route: Route) -> bool:
    """The route fills whole destination slots from part of each source slot: gather it."""
    return route.nbytes < src.slot_bytes and route.dst_offset == 0 and route.nbytes == route.dst.slot_bytes


@dataclass(frozen=True)
class Staged:
    """A range of a staging arena holding one layer's gathered runs, until its batch ended."""

    offset: int
    nbytes: int


class Gatherer:
    """A source rank's gathers: ``pool`` is its KV pool (the tensor behind ``src``)."""

    def __init__(self, staging: StagingArena, pool: torch.Tensor, src: KVArena) -> None:
        self.staging, self.src, self.pool = staging, src, pool

    def stage(self, route: Route, runs: list[Run], layer: int, timeout: float, sync: bool = True
              ) -> tuple[Staged, list[Block]] | None:
        """Copies ``layer``'s K and V of ``runs``' tokens, the route's heads only, into staging
        (runs back to back, K then V) and returns one block per run and K/V; None when the arena
        has no room within ``timeout`` s. On CUDA the copy is queued; ``sync`` waits for it
        (the caller that does not, waits on an event recorded after it)."""
        nbytes = 2 * sum(n for _, _, n in runs) * route.nbytes
        offset = self.staging.alloc(nbytes, timeout)
        if offset is None:
            return None
        blocks = self._copy(route, runs, layer, offset)
        if sync and self.staging.buffer.is_cuda:
            torch.cuda.current_stream(self.staging.buffer.device).synchronize()  # the engine reads it next
        return Staged(offset, nbytes), blocks

    def _copy(self, route: Route, runs: list[Run], layer: int, offset: int) -> list[Block]:
        word = word_size(self.src.slot_bytes, route.src_offset, route.nbytes)
        slots, staged = slot_view(self.pool, self.src, word), as_words(self.staging.buffer, word)
        heads = slice(route.src_offset // word, (route.src_offset + route.nbytes) // word)
        blocks, at = [], offset
        for kv in (0, 1):
            for s, d, n in runs:
                staged[at // word: (at + n * route.nbytes) // word].view(n, -1).copy_(slots[layer, kv, s: s + n, heads])
                blocks.append((self.staging.base + at, route.dst.address(route.dst_layer(layer), kv, d),
                               n * route.nbytes))
                at += n * route.nbytes
        return blocks
