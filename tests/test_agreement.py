"""Two ranks whose L3 views differ agree (one all_reduce(min) per step) and end with the same tree."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.hashing import page_keys
from tierserve.cache.hicache import HiCache, HiCacheConfig
from tierserve.cache.host_pool import HostKVPool, HostLayout
from tierserve.cache.options import PrefetchPolicy
from tierserve.cache.prefetch import PrefetchOptions
from tierserve.cache.sharded.agreement import CollectiveMin, SingleRank, leading_true
from tierserve.cache.storage.file import FileStorage

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float32)
SEED = b"n" * 32
PROMPT = list(range(100, 148))  # 12 pages
L3_PAGES = {0: 10, 1: 6}  # what each rank's store holds of the prompt


def test_leading_true_and_single_rank() -> None:
    assert leading_true([True, True, False, True]) == 2
    assert SingleRank().min([3, 1]) == [3, 1]


def _rank(rank: int, tmp: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    store = FileStorage(Path(tmp) / f"l3-{rank}")
    keys = page_keys(SEED, PROMPT, GEOMETRY.page_size)[: L3_PAGES[rank]]
    page_floats = GEOMETRY.bytes_per_page // 4
    store.batch_set_from(keys, [torch.full((page_floats,), float(i)) for i in range(len(keys))])
    allocator = PageAllocator(32)
    device = DeviceKVPool(GEOMETRY, 32, torch.device("cpu"))
    host = HostKVPool(GEOMETRY, 32, HostLayout.PAGE_FIRST_DIRECT)
    config = HiCacheConfig(prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, prefetch=PrefetchOptions(threshold_tokens=4))
    cache = HiCache(allocator, device, host, SEED, config, storage=store, agreement=CollectiveMin())
    ticket = cache.prefetch(PROMPT)
    steps = 0
    while not cache.ready(ticket):  # decided on agreed values: both ranks leave the loop together
        cache.on_step()
        steps += 1
        assert steps < 10_000
    hit = cache.match(PROMPT[:-1], ticket)
    nodes = sorted((n.tokens, n.keys[0].hex(), n.host is not None) for n in cache.tree.nodes())
    Path(out).write_text(json.dumps({"hit": hit.num_tokens, "tiers": hit.by_tier, "nodes": nodes}))
    cache.release(PROMPT[:-1], hit.pages, hit.num_tokens, hit)
    cache.close()
    torch.distributed.destroy_process_group()


@pytest.mark.integration
def test_ranks_with_different_l3_views_build_the_same_tree(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path), str(outs[r]))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    results = [json.loads(o.read_text()) for o in outs]
    assert results[0] == results[1]
    assert results[0]["hit"] == 6 * GEOMETRY.page_size  # the minimum of the two views
    assert results[0]["tiers"] == {"storage": 24}
