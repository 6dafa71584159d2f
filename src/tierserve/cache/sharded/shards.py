"""Which KV heads and layers of every page a rank holds, and the names of its L3 objects
(``docs/tp.md``, ``docs/pp.md``).

A page of KV is stored in L3 as one object per head range: the rank holding KV heads
``[start, start + count)`` of the model's ``total`` writes the object named ``object_key(page key,
range)``. The whole range keeps the page key itself, so a single-rank node's objects are named as
before. Ranges are aligned chunks whose size divides ``total`` (that is what every TP size makes),
so a reader of any TP size finds the objects covering its heads among ``covering`` chunk sizes.
A writer told the TP sizes of the nodes sharing its L3 also stores its range cut into their ranks'
smaller shares (``finer_chunks``), which those ranks then read as their own.

Pipeline stages cut the layers the same way: a stage's object holds its ``LayerRange`` of its
heads (``Piece``), named by both ranges; the whole layer range adds nothing to the name, so a node
without stages names its objects as before. Stages need not be equal (``default_split``), so a
reader looks for covering objects among the layer ranges of the default split of every stage count
up to ``MAX_STAGES`` (aligned chunks where the count divides the layers).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from tierserve.core.layer_split import default_split

R = TypeVar("R", bound="HeadRange")
MAX_STAGES = 8  # layer ranges a reader looks for: those of up to this many pipeline stages


@dataclass(frozen=True)
class HeadRange:
    """KV heads ``[start, start + count)`` of a model with ``total`` KV heads."""

    start: int
    count: int
    total: int

    def __post_init__(self) -> None:
        if self.count < 1 or self.start < 0 or self.start + self.count > self.total:
            raise ValueError(f"[{self.start}, {self.start + self.count}) does not fit {self.total} "
                             f"{type(self).__name__}")

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def whole(self) -> bool:
        return self.count == self.total


class LayerRange(HeadRange):
    """Layers ``[start, start + count)`` of a model with ``total`` layers (a pipeline stage's)."""


@dataclass(frozen=True)
class Piece:
    """One L3 object's share of a page: ``heads`` of ``layers``."""

    heads: HeadRange
    layers: LayerRange

    @property
    def whole(self) -> bool:
        return self.heads.whole and self.layers.whole


@dataclass(frozen=True)
class KVShard:
    """One rank's share of every page: its ``heads`` and whether it ``writes`` their L3 objects
    (ranks that replicate a KV head, when the TP size exceeds the KV heads, leave it to the first of
    them), among the node's ``ranks``. ``rank`` names the rank for per-rank settings (its share of
    the node's L3 segment, test faults), never for a cache decision. ``finer``: head counts of the
    extra objects a writer also stores inside its range, largest first (``finer_chunks``).
    ``layers``: the rank's pipeline stage's layers (None: every layer of its pool)."""

    heads: HeadRange
    rank: int = 0
    writes: bool = True
    ranks: int = 1
    finer: tuple[int, ...] = ()
    layers: LayerRange | None = None

    def piece(self, num_layers: int) -> Piece:
        """What this rank holds of every page, given its pool's ``num_layers``."""
        return Piece(self.heads, self.layers or LayerRange(0, num_layers, num_layers))

    @classmethod
    def whole(cls, num_kv_heads: int) -> KVShard:
        """The only rank of a node: every head."""
        return cls(HeadRange(0, num_kv_heads, num_kv_heads))


def object_key(page_key: bytes, heads: HeadRange, layers: LayerRange | None = None) -> bytes:
    """The L3 name of ``heads``' share (of ``layers``; None: every layer) of the page ``page_key``:
    the page key for the whole page, else a hash of it with the ranges (so every TP and PP size
    names the same ranges alike; the whole layer range keeps the head range's name)."""
    key = page_key
    if not heads.whole:
        key = hashlib.sha256(key + b"heads" + struct.pack("<3I", heads.start, heads.count, heads.total)).digest()
    if layers is None or layers.whole:
        return key
    return hashlib.sha256(key + b"layers" + struct.pack("<3I", layers.start, layers.count, layers.total)).digest()


@dataclass(frozen=True)
class Source:
    """Where a reader finds its heads of a page: the ``objects`` (aligned chunks of one size) that
    cover them, in head order. ``direct``: one object that is exactly the reader's range."""

    objects: tuple[Piece, ...]
    direct: bool

    def keys(self, page_keys: list[bytes]) -> list[bytes]:
        """Object keys page by page, each page's objects in layer then head order."""
        return [object_key(k, p.heads, p.layers) for k in page_keys for p in self.objects]


def chunks(mine: R, chunk: int) -> list[R]:
    """The aligned ranges of ``chunk`` that cover ``mine`` (of its type: heads or layers)."""
    first, last = mine.start // chunk, (mine.end - 1) // chunk
    return [type(mine)(i * chunk, chunk, mine.total) for i in range(first, last + 1)]


def covering(mine: Piece, chunk: int, layers: tuple[LayerRange, ...] | None = None) -> Source:
    """The aligned objects of ``chunk`` heads of the layer ranges ``layers`` (default: ``mine``'s)
    that cover ``mine``, layer-major."""
    objects = tuple(Piece(h, la) for la in layers or (mine.layers,) for h in chunks(mine.heads, chunk))
    return Source(objects, objects == (mine,))


def stage_ranges(mine: LayerRange, counts: tuple[int, ...]) -> tuple[LayerRange, ...]:
    """The ranges of stages of ``counts`` layers each (in order from layer 0) that share a layer with ``mine``."""
    ranges, start = [], 0
    for count in counts:
        if start < mine.end and mine.start < start + count:
            ranges.append(LayerRange(start, count, mine.total))
        start += count
    return tuple(ranges)


def layer_covers(mine: LayerRange) -> list[tuple[LayerRange, ...]]:
    """The layer ranges of other stage layouts covering ``mine``: those of the default split of 1 to
    ``MAX_STAGES`` stages, each once, fewest objects then fewest layers first (``mine`` itself left out)."""
    covers = {stage_ranges(mine, default_split(mine.total, s)) for s in range(1, min(MAX_STAGES, mine.total) + 1)}
    covers.discard((mine,))
    return sorted(covers, key=lambda c: (len(c), c[-1].end - c[0].start, c[0].start))


def _sizes(mine: HeadRange) -> list[int]:
    """Chunk sizes dividing ``mine.total``: own first, then larger ones (fewer objects), then smaller."""
    sizes = [c for c in range(1, mine.total + 1) if mine.total % c == 0 and c != mine.count]
    return [mine.count, *sorted(c for c in sizes if c > mine.count),
            *sorted((c for c in sizes if c < mine.count), reverse=True)]


def sources(mine: Piece) -> list[Source]:
    """Every way of reading ``mine``: own range first (zero-copy), then for each layer cover (own
    layers first, then ``layer_covers``) every head chunk size."""
    covers = [(mine.layers,), *layer_covers(mine.layers)]
    return [covering(mine, h, layers) for layers in covers for h in _sizes(mine.heads)]


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
