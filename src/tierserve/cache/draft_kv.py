"""A speculative draft's KV in the sidecar layout: its own device and host pools beside the
target's, whose copies take their page indexes from the target's (docs/speculative.md, draft KV in the cache).

Device page p of the draft pool belongs with device page p of the target pool, host page h of the
draft's host pool with host page h of the target's, so every L1 <-> L2 copy of target pages moves
the same draft pages, and a layer-wise load numbers the draft's layers after the target's: its
completion events cover the draft copies. In L3 a page's draft rows are their own object under
``draft_key`` of the page key. (The packed layout needs none of this: the draft's layers are
more layers of the target's pools, so every copy and object holds both.)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from tierserve.cache.device_pool import DeviceKVPool
from tierserve.cache.host_pool import HostKVPool
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.cache.sharded.shard_io import ShardIO
from tierserve.cache.sharded.shards import HeadRange, KVShard, Source, object_key
from tierserve.cache.staging import page_io
from tierserve.cache.storage import StorageBackend


@dataclass(frozen=True)
class DraftShard:
    """A rank's share of the sidecar draft's rows: its KV ``heads`` (None: all of them), which its L3
    objects are named by, and whether it ``writes`` them (not where another rank holds the same rows:
    a replicated EAGLE head's)."""

    heads: HeadRange | None = None
    writes: bool = True


@dataclass(frozen=True)
class SidecarKV:
    """The draft's pools: ``device`` has the target pool's page count, ``host`` the target host
    pool's (and its layout); ``shard``: this rank's share of the draft's rows."""

    device: DeviceKVPool
    host: HostKVPool
    shard: DraftShard = DraftShard()

    @classmethod
    def beside(cls, draft: DeviceKVPool, target_host: HostKVPool, pin_memory: bool,
               shard: DraftShard | None = None) -> SidecarKV:
        host = HostKVPool(draft.geometry, target_host.num_pages, target_host.layout, pin_memory)
        return cls(draft, host, shard or DraftShard())


def load_layers(target: DeviceKVPool, sidecar: SidecarKV | None) -> int:
    """Layers of a layer-wise load: the target's, then the sidecar draft's."""
    return target.geometry.num_layers + (sidecar.device.geometry.num_layers if sidecar else 0)


def planes(target: DeviceKVPool, host: HostKVPool, sidecar: SidecarKV | None, layers: range | None = None
           ) -> list[tuple[DeviceKVPool, HostKVPool, range | None]]:
    """The (device pool, host pool, layers) copies that move ``layers`` of a page in load numbering
    (``load_layers``; all of both when None): the target's, and the sidecar draft's same pages."""
    n = target.geometry.num_layers
    out = []
    if layers is None or layers.start < n:
        out.append((target, host, layers))
    if sidecar is not None and (layers is None or layers.start >= n):
        out.append((sidecar.device, sidecar.host, None if layers is None else range(layers.start - n, layers.stop - n)))
    return out


def draft_key(page_key: bytes, heads: HeadRange | None = None) -> bytes:
    """The L3 key of a page's draft rows in the sidecar layout: of the draft's ``heads`` (a tensor
    rank's; None or all of them: the whole page's key), so the ranks of a TP node store their own
    heads under their own names. They are named as the target's shares of a page are
    (``object_key``), from the draft's own page key, so a node of another TP size reads them as it
    reads the target's (``ShardIO``)."""
    key = hashlib.sha256(b"draft:" + page_key).digest()
    return key if heads is None else object_key(key, heads)


class SidecarIO:
    """The L3 side of a sidecar: wraps the target's ``ShardIO`` so that every page is stored, found
    and read only together with its draft object (a page is present when both are). ``shard``: the
    draft's rows ``host`` holds (default: all, written here). The draft's objects go through a
    ``ShardIO`` of their own over the draft's page keys (``draft_key``): a rank stores its draft
    heads' object and reads its heads from whatever objects a node of another TP size stored.
    ``ownership``: a CP rank's (host page ids are logical, ``cache/sharded/cp_host.py``): it stores
    and reads the draft objects of the pages it owns only, at their local slots, as the target's
    ``OwnedShardIO`` does (another rank's page counts as read here: its owner reports on it)."""

    def __init__(self, target, host: HostKVPool, storage: StorageBackend, shard: DraftShard | None = None,
                 ownership: PageOwnership | None = None) -> None:
        self.target, self.shard = target, shard or DraftShard()
        heads = self.shard.heads or HeadRange(0, host.geometry.num_kv_heads, host.geometry.num_kv_heads)
        self.draft = ShardIO(host, page_io(host), KVShard(heads, writes=self.shard.writes))
        self.own = target.own
        self.ownership = ownership or PageOwnership()
        storage.attach_host_buffer(self.draft.buffer)

    @staticmethod
    def _keys(page_keys: list[bytes]) -> list[bytes]:
        return [draft_key(k) for k in page_keys]

    @property
    def buffer(self) -> torch.Tensor:
        return self.target.buffer

    def probe(self, storage: StorageBackend, page_keys: list[bytes]) -> tuple[int, Source]:
        n, source = self.target.probe(storage, page_keys)
        return min(n, self.draft.probe(storage, self._keys(page_keys[:n]))[0]), source

    def exists(self, storage: StorageBackend, page_keys: list[bytes]) -> int:
        n = self.target.exists(storage, page_keys)
        return min(n, self.draft.exists(storage, self._keys(page_keys[:n])))

    def set_from(self, storage: StorageBackend, page_keys: list[bytes], host_pages: list[int]) -> list[bool]:
        """Per page this rank stores (under CP, those it owns, as the target's result lists them);
        a rank whose draft rows another writes reports the target's result (``ShardIO.set_from``)."""
        ok = self.target.set_from(storage, page_keys, host_pages)
        mine = self._mine(host_pages)
        drafts = self.draft.set_from(storage, self._keys([page_keys[i] for i in mine]), self._local(host_pages, mine)) \
            if mine else []
        return [a and b for a, b in zip(ok, drafts, strict=True)]

    def get_into(self, storage: StorageBackend, source: Source, page_keys: list[bytes],
                 host_pages: list[int]) -> list[bool]:
        ok = self.target.get_into(storage, source, page_keys, host_pages)
        mine = self._mine(host_pages)
        got = self._read_drafts(storage, self._keys([page_keys[i] for i in mine]), self._local(host_pages, mine))
        drafts = [True] * len(page_keys)
        for i, read in zip(mine, got, strict=True):
            drafts[i] = read
        return [a and b for a, b in zip(ok, drafts, strict=True)]

    def _read_drafts(self, storage: StorageBackend, keys: list[bytes], hosts: list[int]) -> list[bool]:
        """This rank's draft heads of each page, from the objects that hold the most leading pages
        (``ShardIO.probe``: its own range's when all are there); per-page success."""
        n, source = self.draft.probe(storage, keys) if keys else (0, self.draft.own)
        got = self.draft.get_into(storage, source, keys[:n], hosts[:n]) if n else []
        return [*got, *[False] * (len(keys) - n)]

    def _mine(self, host_pages: list[int]) -> list[int]:
        return [i for i, p in enumerate(host_pages) if self.ownership.owns(p)]

    def _local(self, host_pages: list[int], mine: list[int]) -> list[int]:
        return [self.ownership.local(host_pages[i]) for i in mine]
