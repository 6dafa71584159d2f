"""Staging memory that coalesces a KV handoff between TP sizes (``docs/architecture.md``, Ranks).

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


def slot_bytes_view(pool: torch.Tensor, arena: KVArena) -> torch.Tensor:
    """The pool as bytes, [layers, 2, slots, slot_bytes] (a view)."""
    return pool.view(torch.uint8).view(arena.num_layers, 2, arena.num_slots, arena.slot_bytes)


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
        self.staging, self.src = staging, src
        self._bytes = slot_bytes_view(pool, src)

    def stage(self, route: Route, runs: list[Run], layer: int, timeout: float) -> tuple[Staged, list[Block]] | None:
        """Copies ``layer``'s K and V of ``runs``' tokens, the route's heads only, into staging
        (runs back to back, K then V) and returns one block per run and K/V; None when the arena
        has no room within ``timeout`` s."""
        tokens = sum(n for _, _, n in runs)
        nbytes = 2 * tokens * route.nbytes
        offset = self.staging.alloc(nbytes, timeout)
        if offset is None:
            return None
        blocks, at = [], offset
        for kv in (0, 1):
            for s, d, n in runs:
                part = self._bytes[layer, kv, s: s + n, route.src_offset: route.src_offset + route.nbytes]
                self.staging.view(at, n * route.nbytes).view(n, route.nbytes).copy_(part)
                blocks.append((self.staging.base + at, route.dst.address(layer, kv, d), n * route.nbytes))
                at += n * route.nbytes
        if self.staging.buffer.is_cuda:
            torch.cuda.current_stream(self.staging.buffer.device).synchronize()  # the engine reads it next
        return Staged(offset, nbytes), blocks
