"""HiCache under context parallelism, in one process: a page's copy in another tier gets a page of
the same owner, a rank copies only the pairs it owns (local slots), and its L3 side stores and reads
only its own pages under the page key, reporting the others' as read (their owners report them)."""

from __future__ import annotations

import pytest
import torch

from tierserve.cache.device_pool import KVGeometry
from tierserve.cache.host_pool import HostKVPool
from tierserve.cache.options import HostLayout
from tierserve.cache.sharded.cp_host import OwnedShardIO, owned_pairs
from tierserve.cache.sharded.cp_pages import PageOwnership, ShardedPageAllocator, alloc_like, until_fits
from tierserve.cache.sharded.shards import KVShard
from tierserve.cache.staging import page_io
from tierserve.cache.storage.file import FileStorage


def test_copies_get_pages_of_the_same_owners() -> None:
    own = PageOwnership(0, 2)
    device, host = ShardedPageAllocator(own, 4), ShardedPageAllocator(own, 2)
    pages = device.alloc_after([3], 3)  # owners 0, 1, 0
    copies = alloc_like(host, pages)
    assert [own.owner(p) for p in copies] == [own.owner(p) for p in pages] == [0, 1, 0]
    assert alloc_like(host, pages) is None  # owner 0 has no two free pages left: nothing taken
    assert host.num_used_by(0) == 2 and host.num_used_by(1) == 1


def test_until_fits_evicts_until_the_owners_have_room_or_nothing_goes() -> None:
    own = PageOwnership(0, 2)
    host = ShardedPageAllocator(own, 2)
    held = host.alloc_owners([0, 0])
    evictions = [[held[0]]]

    def evict() -> int:
        went = evictions.pop() if evictions else []
        host.free(went)
        return len(went)

    assert until_fits(lambda: host.alloc_owners([0]), evict) == [held[0]]
    assert until_fits(lambda: host.alloc_owners([0]), evict) is None


def test_a_rank_copies_only_the_pairs_it_owns_at_their_local_slots() -> None:
    own = PageOwnership(1, 2)
    assert owned_pairs(own, [0, 1, 2, 3, 5], [4, 7, 6, 1, 9]) == ([0, 1, 2], [3, 0, 4])
    with pytest.raises(ValueError):
        owned_pairs(own, [1], [2])


def test_l3_objects_are_whole_pages_under_the_page_key_written_and_read_by_the_owner(tmp_path) -> None:
    geometry = KVGeometry(2, 2, 4, 4, torch.float32)
    keys = [bytes([i]) * 32 for i in range(4)]
    store = FileStorage(tmp_path)
    for rank in (0, 1):
        io, host = _rank_io(rank, geometry)
        host.buffer.fill_(rank + 1)
        assert io.set_from(store, keys, [0, 1, 2, 3]) == [True, True]  # its own two pages
    assert store.batch_exists(keys) == 4  # the page keys themselves: what a CP=1 node writes and reads
    whole = HostKVPool(geometry, 4, HostLayout.PAGE_FIRST_DIRECT)
    assert store.batch_get_into(keys, [whole.page_span(p) for p in range(4)]) == [True] * 4
    assert [int(whole.page_span(p).flatten()[0]) for p in range(4)] == [1, 2, 1, 2]
    io, host = _rank_io(1, geometry)
    assert io.get_into(store, io.own, [*keys, b"x" * 32], [0, 1, 2, 3, 5]) == [True, True, True, True, False]
    assert float(host.buffer.sum()) == 2 * 2 * whole.page_span(0).numel()  # two pages of 2s, nothing else


def _rank_io(rank: int, geometry: KVGeometry) -> tuple[OwnedShardIO, HostKVPool]:
    own = PageOwnership(rank, 2)
    host = HostKVPool(geometry, 3, HostLayout.PAGE_FIRST_DIRECT, ownership=own)
    io = OwnedShardIO(host, page_io(host), KVShard.whole(geometry.num_kv_heads), own)
    return io, host
