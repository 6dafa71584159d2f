"""HiCache under context parallelism (``docs/cp.md``: the host tier
and L3): every tier copy of a page runs on its owner rank only.

Host page ids are logical like device page ids, with the same rule (``PageOwnership``: owner
``page % size``, slot ``page // size`` in the owner's pool), so each rank's host pool holds only its
own pages and the same per-rank host budget holds ``size`` times the tokens. A page's copy in
another tier is always given a page of the same owner (``alloc_like``): an L1 -> L2 write, an L2 ->
L1 restore and an L3 backup or read of a page all run on that one rank, from its slot in one pool
to its slot in the other (the slots differ; the ids give them). Every rank still runs the same
bookkeeping on the same logical ids, and the per-step agreement makes a page count only once
every rank reported its part done: for a page, the part of its owner.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierserve.cache.host_pool import HostKVPool
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.cache.sharded.shard_io import ShardIO
from tierserve.cache.sharded.shards import KVShard, Source
from tierserve.cache.staging import PageIO
from tierserve.cache.storage import StorageBackend


def owned_pairs(own: PageOwnership, device_ids: Sequence[int], host_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """The local slots (device, host) of the page pairs this rank owns. A pair's two pages have the
    same owner by construction (``alloc_like``); a pair that does not is a bookkeeping bug."""
    pairs = [(d, h) for d, h in zip(device_ids, host_ids, strict=True) if own.owns(d)]
    if any(not own.owns(h) for _, h in pairs):
        raise ValueError("a device page and its host copy have different owner ranks")
    return [own.local(d) for d, _ in pairs], [own.local(h) for _, h in pairs]


def rank_host_stats(host: HostKVPool, own: PageOwnership) -> dict[str, float]:
    """What this rank's own host pool holds (under CP its share of the logical pages)."""
    used = host.allocator.num_used_by(own.rank) if own.size > 1 else host.allocator.num_used
    return {"host_rank_pages_used": used, "host_rank_pages_total": host.num_pages}


class OwnedShardIO(ShardIO):
    """A CP rank's L3 side: it stores and reads only the pages whose host page it owns, each as the
    whole page's object under the page key (a page is whole on its owner, so a CP=1 node and a CP=N
    node name and lay out every object alike). Host pages are logical ids."""

    def __init__(self, host: HostKVPool, io: PageIO, shard: KVShard, own: PageOwnership) -> None:
        super().__init__(host, io, shard)
        self.ownership = own

    def set_from(self, storage: StorageBackend, page_keys: list[bytes], host_pages: list[int]) -> list[bool]:
        """Stores this rank's pages; the result covers those only (the other ranks store theirs)."""
        mine = self._mine(host_pages)
        if not mine:  # no store call for nothing
            return []
        return super().set_from(storage, [page_keys[i] for i in mine], self._local(host_pages, mine))

    def get_into(self, storage: StorageBackend, source: Source, page_keys: list[bytes],
                 host_pages: list[int]) -> list[bool]:
        """Reads this rank's pages; another rank's page counts as read here (its owner reports on
        it, and the agreement takes the minimum), so ``arrived`` stops at this rank's first miss."""
        mine = self._mine(host_pages)
        got = super().get_into(storage, source, [page_keys[i] for i in mine], self._local(host_pages, mine)) \
            if mine else []
        out = [True] * len(page_keys)
        for i, ok in zip(mine, got, strict=True):
            out[i] = ok
        return out

    def _mine(self, host_pages: list[int]) -> list[int]:
        return [i for i, p in enumerate(host_pages) if self.ownership.owns(p)]

    def _local(self, host_pages: list[int], mine: list[int]) -> list[int]:
        return [self.ownership.local(host_pages[i]) for i in mine]


def rank_io(host: HostKVPool, io: PageIO, shard: KVShard, own: PageOwnership) -> ShardIO:
    """The L3 side of a rank's host pool: per owner under CP, the plain one otherwise."""
    return ShardIO(host, io, shard) if own.size == 1 else OwnedShardIO(host, io, shard, own)
