"""One rank's L3 objects: it writes its own heads' (and stage's layers') object of every page and
reads them from whatever objects another TP or PP size wrote (``docs/tp.md``, ``docs/pp.md``).

Where the objects are exactly the rank's range, reads and writes go through the host pool's
``PageIO`` (zero-copy in the page-first layouts). Otherwise each object lands in a staging buffer
shaped like it and the rank's heads of its layers are copied out of it into the host page: one
staging copy.
A writer with ``KVShard.finer`` chunk sizes also copies each of its pages' chunks into staging and
stores them as their own objects, for the ranks of smaller TP shares to read zero-copy.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator

import torch

from tierserve.cache.host_pool import HostKVPool
from tierserve.cache.options import HostLayout
from tierserve.cache.sharded.shards import KVShard, Piece, Source, covering, sources
from tierserve.cache.staging import STAGING_PAGES, PageIO
from tierserve.cache.storage import StorageBackend


class _Staging:
    """Staging pools of objects of some head and layer count in the object byte order (page-first,
    as ``staging`` writes ``layer_first`` pools), one per shape, grown, never shrunk; ``lock``
    guards their contents for one call. A new pool is attached to the store at once: a zero-copy
    store (Mooncake) would otherwise register it inside the first transfer, on the caller's clock."""

    def __init__(self, host: HostKVPool) -> None:
        self.host = host
        self.lock = threading.Lock()
        self._pools: dict[tuple[int, int], HostKVPool] = {}

    def slots(self, storage: StorageBackend, objects: tuple[Piece, ...], pages: int) -> list[tuple[HostKVPool, int]]:
        """Where each of ``pages`` pages' ``objects`` is staged: entry ``i * len(objects) + j`` is
        object j of page i, a page of the pool of its shape (a source's objects differ in shape
        where the stages that wrote them hold different layer counts)."""
        shapes = [(o.heads.count, o.layers.count) for o in objects]
        pools = {shape: self.pool(storage, shape, shapes.count(shape) * pages) for shape in set(shapes)}
        used = dict.fromkeys(pools, 0)
        out = []
        for _ in range(pages):
            for shape in shapes:
                out.append((pools[shape], used[shape]))
                used[shape] += 1
        return out

    def pool(self, storage: StorageBackend, shape: tuple[int, int], objects: int) -> HostKVPool:
        """A pool of at least ``objects`` objects of ``shape`` (KV heads, layers), attached to ``storage``."""
        pool = self._pools.get(shape)
        if pool is None or pool.num_pages < objects:
            layout = HostLayout.PAGE_FIRST if self.host.layout is HostLayout.LAYER_FIRST else self.host.layout
            geometry = dataclasses.replace(self.host.geometry, num_kv_heads=shape[0], num_layers=shape[1])
            pool = HostKVPool(geometry, max(objects, STAGING_PAGES), layout, pin_memory=self.host.buffer.is_pinned())
            storage.attach_host_buffer(pool.buffer)
            self._pools[shape] = pool
        return pool


class ShardIO:
    """The L3 side of one rank's host pool. ``io`` moves whole host pages (its ``buffer`` is what
    the backend registers); ``shard`` says which heads (and layers) this rank holds and whether it
    writes them."""

    def __init__(self, host: HostKVPool, io: PageIO, shard: KVShard) -> None:
        self.mine = shard.piece(host.geometry.num_layers)
        if (host.geometry.num_kv_heads, host.geometry.num_layers) != (shard.heads.count, self.mine.layers.count):
            raise ValueError(f"the host pool holds {host.geometry.num_kv_heads} KV heads of "
                             f"{host.geometry.num_layers} layers, the shard {self.mine}")
        self.host, self.io, self.shard = host, io, shard
        self.own, *self._others = sources(self.mine)  # own range first; the rest only when it lacks pages
        self.finer = [covering(self.mine, c) for c in shard.finer]
        # reads (prefetch lane) and writes (backup lane) never wait for each other's staging
        self._reads, self._writes = _Staging(host), _Staging(host)

    @property
    def buffer(self) -> torch.Tensor:
        return self.io.buffer

    def probe(self, storage: StorageBackend, page_keys: list[bytes]) -> tuple[int, Source]:
        """How many leading pages the store has for this rank's heads, and where: its own range
        when all are there, else the source with the longest run (ties: the earlier, cheaper one).
        Another TP size's objects are looked for only where they hold the first page the own
        range lacks (one call for all of them), so a fleet of one TP size pays one extra call."""
        best, where = storage.batch_exists(self.own.keys(page_keys)), self.own
        for source in self._extending(storage, page_keys, best):
            n = storage.batch_exists(source.keys(page_keys)) // len(source.objects)
            if n > best:
                best, where = n, source
            if best == len(page_keys):
                break
        return best, where

    def _extending(self, storage: StorageBackend, page_keys: list[bytes], have: int) -> list[Source]:
        """The other sources that hold every object of page ``have`` (none when all pages are in)."""
        if have >= len(page_keys):
            return []
        flags = storage.exists_each([k for s in self._others for k in s.keys(page_keys[have : have + 1])])
        found, at = [], 0
        for source in self._others:
            if all(flags[at : at + len(source.objects)]):
                found.append(source)
            at += len(source.objects)
        return found

    def set_from(self, storage: StorageBackend, page_keys: list[bytes], host_pages: list[int]) -> list[bool]:
        """Stores this rank's heads of each page, then the finer objects of the pages stored; the
        result is the own objects' (a finer object is a shortcut: without it readers fall back on
        the own object). A replica that does not write reports success."""
        if not self.shard.writes:
            return [True] * len(page_keys)
        ok = self.io.set_from(storage, self.own.keys(page_keys), host_pages)
        stored = [(k, p) for k, p, good in zip(page_keys, host_pages, ok, strict=True) if good]
        for source in self.finer:
            put = functools.partial(self._put, storage, source)
            self._in_calls(self._writes, source, stored, put)
        return ok

    def exists(self, storage: StorageBackend, page_keys: list[bytes]) -> int:
        """Leading pages whose own-range object is stored (a backup skips those)."""
        return storage.batch_exists(self.own.keys(page_keys))

    def get_into(self, storage: StorageBackend, source: Source, page_keys: list[bytes],
                 host_pages: list[int]) -> list[bool]:
        """Reads this rank's heads of each page from ``source``'s objects; per-page success."""
        if source.direct:
            return self.io.get_into(storage, source.keys(page_keys), host_pages)
        pages = list(zip(page_keys, host_pages, strict=True))
        return self._in_calls(self._reads, source, pages, lambda keys, hosts: self._get(storage, source, keys, hosts))

    @staticmethod
    def _in_calls(staging: _Staging, source: Source, pages: list[tuple[bytes, int]],
                  call: Callable[[list[bytes], list[int]], list[bool]]) -> list[bool]:
        """Runs ``call(page keys, host pages)`` on as many pages at a time as ``staging`` holds
        objects of ``source``, under its lock; the per-page results in order."""
        per_call = max(1, STAGING_PAGES // len(source.objects))
        ok: list[bool] = []
        with staging.lock:
            for at in range(0, len(pages), per_call):
                chunk = pages[at : at + per_call]
                ok += call([k for k, _ in chunk], [p for _, p in chunk])
        return ok

    def _get(self, storage: StorageBackend, source: Source, page_keys: list[bytes],
             host_pages: list[int]) -> list[bool]:
        """One backend call into the read staging buffer, then this rank's heads out of it."""
        n = len(source.objects)
        slots = self._reads.slots(storage, source.objects, len(page_keys))
        got = storage.batch_get_into(source.keys(page_keys), [pool.page_span(i) for pool, i in slots])
        ok = [all(got[i * n : (i + 1) * n]) for i in range(len(page_keys))]
        for i, page in enumerate(host_pages):
            if ok[i]:
                for host, staged in self._overlaps(slots[i * n : (i + 1) * n], source.objects, page):
                    host.copy_(staged)
        return ok

    def _put(self, storage: StorageBackend, source: Source, page_keys: list[bytes],
             host_pages: list[int]) -> list[bool]:
        """This rank's heads of each page into the write staging buffer cut as ``source``'s
        objects, then one backend call storing them; per-page success."""
        n = len(source.objects)
        slots = self._writes.slots(storage, source.objects, len(page_keys))
        for i, page in enumerate(host_pages):
            for host, staged in self._overlaps(slots[i * n : (i + 1) * n], source.objects, page):
                staged.copy_(host)
        put = storage.batch_set_from(source.keys(page_keys), [pool.page_span(i) for pool, i in slots])
        return [all(put[i * n : (i + 1) * n]) for i in range(len(page_keys))]

    def _overlaps(self, slots: list[tuple[HostKVPool, int]], objects: tuple[Piece, ...],
                  page: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """For each object (staged at ``slots[j]``), its overlap with this rank's heads and
        layers as (host page ``page`` view, staging view), both [layers, 2, 1, page_size, heads,
        head_dim]; objects that share no layer with this rank yield nothing."""
        heads, layers = self.mine.heads, self.mine.layers
        dst = self.host.run_all_layers(page, 1)
        for j, obj in enumerate(objects):
            h0, h1 = max(heads.start, obj.heads.start), min(heads.end, obj.heads.end)
            l0, l1 = max(layers.start, obj.layers.start), min(layers.end, obj.layers.end)
            if h0 >= h1 or l0 >= l1:
                continue
            staging, at = slots[j]
            src = staging.run_all_layers(at, 1)
            yield (_cut(dst, l0 - layers.start, l1 - l0, h0 - heads.start, h1 - h0),
                   _cut(src, l0 - obj.layers.start, l1 - l0, h0 - obj.heads.start, h1 - h0))


def _cut(view: torch.Tensor, layer: int, layers: int, head: int, heads: int) -> torch.Tensor:
    """``layers`` layers from ``layer`` and ``heads`` heads from ``head`` of a
    [layers, 2, n, page_size, heads, head_dim] view."""
    return view[layer : layer + layers, ..., head : head + heads, :]
