"""One rotation per path under HiCache at CP (``docs/cp.md``, refusing mixed rotations): a release
that would give a host-only node device pages of another rotation refuses them, a later restore
then keeps the path one rotation, and an L3 prefetch never hangs pages of another rotation under a
path. One CP rank (0 of 2) in one process; its own view is the agreed one."""

from __future__ import annotations

import torch
from helpers.hicache_fakes import MemoryStorage
from helpers.polling import wait_for

from tierserve.cache.base import PrefixHit
from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.hashing import page_keys
from tierserve.cache.hicache import HiCache, HiCacheConfig
from tierserve.cache.host_pool import HostKVPool, HostLayout
from tierserve.cache.options import PrefetchPolicy
from tierserve.cache.prefetch import PrefetchOptions
from tierserve.cache.radix_tree import Node, path_to_root
from tierserve.cache.sharded.cp_pages import PageOwnership, ShardedPageAllocator

PS = 2
SEED = b"r" * 32
OWN = PageOwnership(0, 2)
GEOMETRY = KVGeometry(1, 1, 2, PS, torch.float32)


def _cache(storage: MemoryStorage | None = None) -> HiCache:
    config = HiCacheConfig(prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, prefetch=PrefetchOptions(threshold_tokens=PS))
    return HiCache(ShardedPageAllocator(OWN, 8), DeviceKVPool(GEOMETRY, 8, torch.device("cpu")),
                   HostKVPool(GEOMETRY, 8, HostLayout.PAGE_FIRST_DIRECT, ownership=OWN), SEED, config,
                   storage=storage, ownership=OWN)


def _owners(pages: list[int] | None) -> list[int] | None:
    return None if pages is None else [OWN.owner(p) for p in pages]


def _path_owners(node: Node) -> list[int]:
    """The owners along ``node``'s path, root first (a page's copies share their owner)."""
    return [o for n in reversed(list(path_to_root(node))) for o in _owners(n.device or n.host)]


def _one_rotation(cache: HiCache) -> None:
    for node in cache.tree.nodes():
        if node.device is not None and node.host is not None:
            assert _owners(node.device) == _owners(node.host), "a node's L1 and L2 copies have other owners"
        owners = _path_owners(node)
        assert owners == [(owners[0] + j) % OWN.size for j in range(len(owners))], f"a path owned {owners}"


def _release(cache: HiCache, tokens: list[int], pages: list[int], hit: PrefixHit | None = None) -> None:
    cache.release(tokens, pages, len(tokens), hit or PrefixHit())
    cache.wait_background()


def test_a_release_refuses_to_give_a_host_only_node_another_rotation_and_restores_keep_it() -> None:
    cache = _cache()
    prompt = [5, 6, 7, 8]  # two full pages
    first = cache.allocator.alloc_after([], 2)  # owners 0, 1
    second = cache.allocator.alloc_after([], 2)  # the same prompt computed at once: owners 1, 0
    assert _owners(first) == [0, 1] and _owners(second) == [1, 0]
    _release(cache, [*prompt, 9], [*first, cache.allocator.alloc_after(first, 1)[0]])  # written through to L2
    cache.evict(10)
    (node,) = cache.tree.nodes()
    assert node.device is None and _owners(node.host) == [0, 1]
    _release(cache, [*prompt, 9], [*second, cache.allocator.alloc_after(second, 1)[0]])
    assert node.device is None, "a host-only node took device pages of another rotation"
    assert cache.stats()["cp_refused_pages_total"] == 2
    _one_rotation(cache)
    hit = cache.match([*prompt, 1, 2, 3])  # restores the node from L2, with its owners
    for load in hit.loads:
        load.join()
    assert _owners(hit.pages) == [0, 1]
    more = cache.allocator.alloc_after(hit.pages, 2)
    _release(cache, [*prompt, 1, 2, 3], [*hit.pages, *more], hit)
    cache.evict(10)
    hit = cache.match([*prompt, 1, 2, 3])  # restores the whole path: one rotation, not [0, 1, 1]
    for load in hit.loads:
        load.join()
    assert _owners(hit.pages) == [0, 1, 0]
    _one_rotation(cache)
    cache.release([*prompt, 1, 2, 3], hit.pages, len(hit.pages) * PS, hit)
    cache.allocator.check()
    cache.host.allocator.check()
    cache.close()


def test_a_prefetch_does_not_hang_l3_pages_under_a_path_of_another_rotation() -> None:
    store = MemoryStorage()
    prompt = [3, 4, 5, 6, 7, 8, 9, 10]  # four full pages, all in L3
    cache = _cache(store)
    store.batch_set_from(page_keys(SEED, prompt, PS), [torch.zeros_like(cache.host.page_span(0))] * 4)
    ticket = cache.prefetch([*prompt, 1])
    wait_for(lambda: cache.on_step() or cache.ready(ticket), "the prefetch landed", 10.0, 0.002)
    assert ticket.agreed_arrived == 4 and _owners(ticket.host_pages) == [0, 1, 0, 1]
    # meanwhile the prompt's first two pages were computed by a request of rotation 1, 0
    cache.allocator.alloc_after([], 1)
    computed = cache.allocator.alloc_after([], 2)
    assert _owners(computed) == [1, 0]
    cache.release(prompt[:4], computed, 4, PrefixHit())
    hit = cache.match(prompt, ticket)  # L3's pages 2, 3 are owned 0, 1: after owner 0 they break the rotation
    for load in hit.loads:
        load.join()
    _one_rotation(cache)
    assert _owners(hit.pages) == [1, 0]
    cache.release(prompt, hit.pages, len(hit.pages) * PS, hit)
    cache.wait_background()
    assert cache.stats()["l3_prefetch_refused_pages_total"] == 2
    cache.host.allocator.check()
    cache.close()


def test_storable_checks_owners_where_the_path_is_host_only() -> None:
    own = PageOwnership(0, 2)
    assert own.storable([0, 1], [1, 0, 2], on_device=2) == 3  # device pages: the tree keeps its own
    assert own.storable([0, 1], [1, 0, 2], on_device=0) == 0  # host-only: owners 1, 0 against 0, 1
    assert own.storable([0, 1, 2], [2, 1, 0, 3], on_device=1) == 4  # owners agree where host-only
    assert own.storable([0, 1], [4, 2], on_device=1) == 1  # owners 0, 0: the host-only page is 1's
