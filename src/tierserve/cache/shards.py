"""Which KV heads of every page a rank holds, and the names of its L3 objects
(``docs/architecture.md``, L3 across TP sizes).

A page of KV is stored in L3 as one object per head range: the rank holding KV heads
``[start, start + count)`` of the model's ``total`` writes the object named ``object_key(page key,
range)``. The whole range keeps the page key itself, so a single-rank node's objects are named as
before. Ranges are aligned chunks whose size divides ``total`` (that is what every TP size makes),
so a reader of any TP size finds the objects covering its heads among ``covering`` chunk sizes.
A writer told the TP sizes of the nodes sharing its L3 also stores its range cut into their ranks'
smaller shares (``finer_chunks``), which those ranks then read as their own.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class HeadRange:
    """KV heads ``[start, start + count)`` of a model with ``total`` KV heads."""

    start: int
    count: int
    total: int

    def __post_init__(self) -> None:
        if self.count < 1 or self.start < 0 or self.start + self.count > self.total:
            raise ValueError(f"heads [{self.start}, {self.start + self.count}) do not fit {self.total} KV heads")

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def whole(self) -> bool:
        return self.count == self.total


@dataclass(frozen=True)
class KVShard:
    """One rank's share of every page: its ``heads`` and whether it ``writes`` their L3 objects
    (ranks that replicate a KV head, when the TP size exceeds the KV heads, leave it to the first of
    them), among the node's ``ranks``. ``rank`` names the rank for per-rank settings (its share of
    the node's L3 segment, test faults), never for a cache decision. ``finer``: head counts of the
    extra objects a writer also stores inside its range, largest first (``finer_chunks``)."""

    heads: HeadRange
    rank: int = 0
    writes: bool = True
    ranks: int = 1
    finer: tuple[int, ...] = ()

    @classmethod
    def whole(cls, num_kv_heads: int) -> KVShard:
        """The only rank of a node: every head."""
        return cls(HeadRange(0, num_kv_heads, num_kv_heads))


def object_key(page_key: bytes, heads: HeadRange) -> bytes:
    """The L3 name of ``heads``' share of the page ``page_key``: the page key for the whole range,
    else a hash of it with the range (so every TP size names the same range alike)."""
    if heads.whole:
        return page_key
    return hashlib.sha256(page_key + b"heads" + struct.pack("<3I", heads.start, heads.count, heads.total)).digest()


@dataclass(frozen=True)
class Source:
    """Where a reader finds its heads of a page: the ``objects`` (aligned chunks of one size) that
    cover them, in head order. ``direct``: one object that is exactly the reader's range."""

    objects: tuple[HeadRange, ...]
    direct: bool

    def keys(self, page_keys: list[bytes]) -> list[bytes]:
        """Object keys page by page, each page's objects in head order."""
        return [object_key(k, r) for k in page_keys for r in self.objects]


def covering(mine: HeadRange, chunk: int) -> Source:
    """The aligned chunks of ``chunk`` heads that cover ``mine``."""
    first, last = mine.start // chunk, (mine.end - 1) // chunk
    objects = tuple(HeadRange(i * chunk, chunk, mine.total) for i in range(first, last + 1))
    return Source(objects, objects == (mine,))


def sources(mine: HeadRange) -> list[Source]:
    """Every way of reading ``mine``, own range first (zero-copy), then larger chunks (fewer
    objects), then smaller: one per chunk size that divides the model's KV heads."""
    sizes = [c for c in range(1, mine.total + 1) if mine.total % c == 0 and c != mine.count]
    larger = sorted(c for c in sizes if c > mine.count)
    smaller = sorted((c for c in sizes if c < mine.count), reverse=True)
    order = [mine.count, *larger, *smaller]
    return [covering(mine, c) for c in order]


def rank_heads(total: int, tp_size: int) -> int:
    """KV heads one rank holds at ``tp_size`` (ranks beyond the KV heads each replicate one)."""
    if tp_size < 1:
        raise ValueError(f"a TP size is at least 1, not {tp_size}")
    return max(1, total // tp_size)


def finer_chunks(mine: HeadRange, tp_sizes: Iterable[int]) -> tuple[int, ...]:
    """The rank shares at ``tp_sizes`` smaller than ``mine`` that tile it as aligned chunks,
    largest first: the objects a writer of ``mine`` stores besides its own so that those ranks
    read their heads zero-copy instead of fetching ``mine`` whole and dropping the rest."""
    counts = {rank_heads(mine.total, t) for t in tp_sizes}
    return tuple(sorted((c for c in counts if c < mine.count and mine.count % c == 0 and mine.total % c == 0),
                        reverse=True))
