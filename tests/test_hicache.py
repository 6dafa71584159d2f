"""HiCache L1 + L2 in the engine: host hits give the same outputs as no cache, for every layout,
I/O backend and write policy, and every page is accounted for afterwards."""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path

import pytest
import torch
from helpers.engine_runs import run_one

from tierserve.cache import hicache as hicache_module
from tierserve.cache.allocator import PageAllocator
from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.hicache import HiCache, HiCacheConfig
from tierserve.cache.host_pool import HostKVPool
from tierserve.cache.loads import HostLoadError
from tierserve.cache.options import HiCacheOptions, HostLayout, IOBackend, PrefetchPolicy, WritePolicy
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _prompts() -> tuple[list[int], list[list[int]]]:
    gen = torch.Generator().manual_seed(11)
    target = torch.randint(2, 384, (64,), generator=gen).tolist()
    fillers = [torch.randint(2, 384, (60,), generator=gen).tolist() for _ in range(3)]
    return target, fillers


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> list[int]:
    plain = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=4, max_total_tokens=512,
                                disable_radix_cache=True))
    return plain.generate([_prompts()[0]], PARAMS)[0]


def _engine(model: Path, **options) -> Engine:
    # L1 holds 96 tokens: the fillers push the target's pages out of it
    return Engine(EngineConfig(model, dtype="float32", page_size=4, max_total_tokens=96,
                               enable_hierarchical_cache=True, hicache=HiCacheOptions(ratio=4.0, **options)))


def _run(engine: Engine, prompt: list[int]) -> tuple[list[int], dict[str, int]]:
    return run_one(engine, prompt, PARAMS)


def _settle(engine: Engine) -> None:
    """Lets background L1 -> L2 copies land (they are applied at step boundaries)."""
    engine.cache.wait_background()


def _check_accounting(engine: Engine) -> None:
    cache = engine.cache
    _settle(engine)
    assert engine.stats()["kv_pages_used"] == 0
    assert cache.host.allocator.num_used == len(cache.tree.host_pages())
    cache.evict(engine.allocator.num_pages)
    assert engine.allocator.num_used == 0
    engine.allocator.check()
    cache.host.allocator.check()


@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("backend", list(IOBackend))
def test_host_hit_gives_identical_output(tiny_llama: Path, expected: list[int], layout, backend) -> None:
    engine = _engine(tiny_llama, mem_layout=layout, io_backend=backend)
    target, fillers = _prompts()
    assert _run(engine, target)[0] == expected
    for filler in fillers:
        _settle(engine)
        _run(engine, filler)
    _settle(engine)
    tokens, tiers = _run(engine, target)
    assert tokens == expected
    assert tiers.get("host", 0) >= 32, tiers  # most of the prompt came back from host memory
    stats = engine.stats()
    assert stats["cache_l2_load_pages_total"] >= 8 and stats["cache_l2_write_pages_total"] > 0
    assert stats["cache_device_evicted_pages_total"] > 0 and stats["cache_host_pages_used"] > 0
    _check_accounting(engine)


def test_write_back_copies_only_on_eviction(tiny_llama: Path, expected: list[int]) -> None:
    engine = _engine(tiny_llama, write_policy=WritePolicy.WRITE_BACK)
    target, fillers = _prompts()
    _run(engine, target)
    assert engine.cache.host.allocator.num_used == 0  # nothing copied yet
    for filler in fillers:
        _run(engine, filler)
    assert engine.cache.host.allocator.num_used > 0  # evicted nodes went to L2
    tokens, tiers = _run(engine, target)
    assert tokens == expected and tiers.get("host", 0) > 0
    _check_accounting(engine)


def test_selective_write_through_waits_for_hits(tiny_llama: Path, expected: list[int]) -> None:
    engine = _engine(tiny_llama, write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE, write_threshold=2)
    target, _ = _prompts()
    _run(engine, target)
    _settle(engine)
    assert engine.cache.host.allocator.num_used == 0
    for _ in range(2):
        assert _run(engine, target)[0] == expected
    _settle(engine)
    assert engine.cache.host.allocator.num_used > 0
    _check_accounting(engine)


def test_cache_metrics_are_exported(tiny_llama: Path) -> None:
    from prometheus_client import generate_latest

    from tierserve.api.engine_metrics import EngineCollector
    from tierserve.api.metrics import ApiMetrics

    engine = _engine(tiny_llama)
    target, fillers = _prompts()
    for prompt in [target, *fillers, target]:
        _settle(engine)
        _run(engine, prompt)
    text = generate_latest(ApiMetrics(EngineCollector(engine)).registry).decode()
    for name in ("tierserve_cache_l2_load_pages_total", "tierserve_cache_l2_write_bytes_total",
                 "tierserve_cache_device_evicted_pages_total", "tierserve_cache_host_pages_used"):
        line = next(x for x in text.splitlines() if x.startswith(name + " "))
        assert float(line.split()[1]) > 0, line


# -- a failed L2 -> L1 load -------------------------------------------------------------------------


def _failing_loads(monkeypatch) -> None:
    """Makes every L2 -> L1 copy fail at layer 1 (after layer 0 landed); L1 -> L2 copies still work."""
    real = hicache_module.copy_pages

    def copy_pages(device, host, device_ids, host_ids, to_host, backend, layers=None) -> None:
        if not to_host and layers is not None and 1 in layers:
            raise OSError("injected copy failure")
        real(device, host, device_ids, host_ids, to_host, backend, layers)

    monkeypatch.setattr(hicache_module, "copy_pages", copy_pages)


def test_a_failed_host_load_leaves_no_garbage_in_the_tree(monkeypatch) -> None:
    geometry = KVGeometry(num_layers=3, num_kv_heads=1, head_dim=2, page_size=2, dtype=torch.float32)
    alloc, host = PageAllocator(16), HostKVPool(geometry, 16, HostLayout.PAGE_FIRST_DIRECT)
    device = DeviceKVPool(geometry, 16, torch.device("cpu"))
    cache = HiCache(alloc, device, host, b"s" * 32, HiCacheConfig())
    tokens = list(range(12))  # 6 pages, computed by a request, written through to L2, evicted from L1
    computed, pages = cache.match(tokens), alloc.alloc(6)
    for i, p in enumerate(pages):
        device.buffer[:, :, p * 2 : (p + 1) * 2] = i + 1
    cache.release(tokens, pages, len(tokens), computed)
    cache.wait_background()
    cache.evict(16)
    assert not cache.tree.device_pages() and len(cache.tree.host_pages()) == 6

    _failing_loads(monkeypatch)
    first, second = cache.match(tokens), cache.match(tokens)  # the second is lent the loading pages
    assert len(first.pages) == 6 and second.pages == first.pages and second.loads == first.loads
    with pytest.raises(HostLoadError):
        first.loads[0].wait(1)
    assert not first.loads[0].done()  # never usable: every later wait fails too
    cache.release(tokens, second.pages, second.num_tokens, second)  # aborted before the step boundary
    assert alloc.num_used == 6
    cache.on_step()  # the failure is agreed: the device copy leaves the tree, the host copy stays
    assert not set(first.pages) & set(cache.tree.device_pages())
    found = cache.tree.match(tokens)
    assert not found.device_pages and len(found.host_pages) == 6
    assert alloc.num_used == 6  # still lent to the first request
    extra = alloc.alloc(1)  # its page for the next token
    cache.release(tokens, first.pages + extra, first.num_tokens, first)
    assert alloc.num_used == 0 and not cache.tree.device_pages()
    alloc.check()
    host.allocator.check()
    assert host.allocator.num_used == len(cache.tree.host_pages()) == 6
    assert cache.stats()["l2_load_failures_total"] == 1

    monkeypatch.undo()  # the next match loads the host copy again, correctly
    again = cache.match(tokens)
    for layer in range(3):
        again.loads[-1].wait(layer)
    for i, p in enumerate(again.pages):
        assert (device.buffer[:, :, p * 2 : (p + 1) * 2] == i + 1).all()
    cache.release(tokens, again.pages, again.num_tokens, again)
    cache.close()


def test_only_the_request_whose_host_load_fails_fails_and_the_next_one_is_right(tiny_llama: Path, expected: list[int],
                                                                         monkeypatch) -> None:
    engine = _engine(tiny_llama)
    target, fillers = _prompts()
    _run(engine, target)
    for filler in fillers:
        _settle(engine)
        _run(engine, filler)
    _settle(engine)
    _failing_loads(monkeypatch)
    engine.add_request("doomed", target, PARAMS)
    engine.add_request("bystander", list(range(100, 117)), PARAMS)  # nothing cached: must not fail with it
    outputs, failures = [], []
    while engine.has_work():
        outputs += engine.step()
        failures += engine.take_failures()
    assert [(rid, type(exc)) for rid, exc in failures] == [("doomed", HostLoadError)]
    assert any(out.request_id == "bystander" and out.finished for out in outputs)
    assert "doomed" not in engine.requests
    monkeypatch.undo()
    tokens, tiers = _run(engine, target)
    assert tokens == expected and tiers.get("host", 0) >= 32, tiers  # loaded again from the host copy
    assert engine.cache.stats()["l2_load_failures_total"] == 1
    _check_accounting(engine)


def test_a_failed_l2_write_of_a_node_split_meanwhile_frees_every_part(monkeypatch) -> None:
    geometry = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=2, page_size=2, dtype=torch.float32)
    alloc, host = PageAllocator(32), HostKVPool(geometry, 32, HostLayout.PAGE_FIRST_DIRECT)
    cache = HiCache(alloc, DeviceKVPool(geometry, 32, torch.device("cpu")), host, b"s" * 32, HiCacheConfig())

    def failing_copy(device, host, device_ids, host_ids, to_host, backend, layers=None) -> None:
        raise OSError("injected L1 -> L2 failure")

    monkeypatch.setattr(hicache_module, "copy_pages", failing_copy)
    tokens = list(range(12))  # 6 pages: inserted and written through (the copy will fail)
    hit, pages = cache.match(tokens), alloc.alloc(6)
    cache.release(tokens, pages, len(tokens), hit)
    other = tokens[:4] + [99] * 8  # shares 2 pages: splits the node while its write is in flight
    hit, pages = cache.match(other), alloc.alloc(4)
    cache.release(other, hit.pages + pages, len(other), hit)
    cache.wait_background()
    assert all(not n.writing for n in cache.tree.nodes()), "a part of the split node still looks in flight"
    assert host.allocator.num_used == 0 and all(n.lock == 0 for n in cache.tree.nodes())
    monkeypatch.undo()  # the next release may write them again
    hit = cache.match(tokens)
    cache.release(tokens, list(hit.pages) + alloc.alloc(1), len(tokens), hit)
    cache.wait_background()
    assert len(cache.tree.host_pages()) >= 6
    cache.close()


def _host_only_prefix(cache: HiCache, alloc: PageAllocator, tokens: list[int]) -> None:
    """Computes ``tokens`` (whole pages), lets the L2 copy land and evicts L1: only L2 holds them."""
    hit, pages = cache.match(tokens), alloc.alloc(len(tokens) // 2)
    cache.release(tokens, pages, len(tokens), hit)
    cache.wait_background()
    cache.evict(alloc.num_pages)


def _small_cache() -> tuple[HiCache, PageAllocator]:
    """A HiCache of 32 L1 and 32 L2 pages of 2 tokens (tiny KV), and its L1 allocator."""
    geometry = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=2, page_size=2, dtype=torch.float32)
    alloc, host = PageAllocator(32), HostKVPool(geometry, 32, HostLayout.PAGE_FIRST_DIRECT)
    return HiCache(alloc, DeviceKVPool(geometry, 32, torch.device("cpu")), host, b"s" * 32, HiCacheConfig()), alloc


def test_a_node_split_while_loading_is_evictable_once_the_load_landed() -> None:
    """A match inside a loading node splits it: both parts stop being ``loading`` when the load
    is agreed done (the upper part once stayed ``loading`` for good: its L1 pages never went)."""
    cache, alloc = _small_cache()
    tokens, other = list(range(8)), [0, 1, 2, 3, 99]
    _host_only_prefix(cache, alloc, tokens)
    whole = cache.match(tokens)  # one node of 4 pages starts loading
    whole.loads[-1].wait(1)
    part = cache.match(other)  # before the step that agrees the load done: splits the node
    assert len(part.pages) == 2 and len([n for n in cache.tree.nodes() if n.loading is not None]) == 2
    cache.release(tokens, whole.pages, whole.num_tokens, whole)
    cache.release(other, part.pages, part.num_tokens, part)
    assert cache.evict(alloc.num_pages) == 0  # loading until a step agreed the load done on every rank
    cache.wait_background()  # steps: the load is agreed done
    assert [n.tokens for n in cache.tree.nodes() if n.loading is not None] == []
    assert cache.evict(alloc.num_pages) == 4 and alloc.num_used == 0
    cache.close()


def test_loads_are_not_queued_behind_writes_and_complete_layer_by_layer(monkeypatch) -> None:
    """A load is on a request's critical path: it runs while an L1 -> L2 write is stuck, and
    layer 0 is usable while later layers are still copying (attention of layer 0 overlaps them)."""
    geometry = KVGeometry(num_layers=3, num_kv_heads=1, head_dim=2, page_size=2, dtype=torch.float32)
    alloc, host = PageAllocator(32), HostKVPool(geometry, 32, HostLayout.PAGE_FIRST_DIRECT)
    cache = HiCache(alloc, DeviceKVPool(geometry, 32, torch.device("cpu")), host, b"s" * 32, HiCacheConfig())
    loaded = list(range(8))
    _host_only_prefix(cache, alloc, loaded)
    real, write_stuck, later_layers = hicache_module.copy_pages, threading.Event(), threading.Event()

    def copy_pages(device, host, device_ids, host_ids, to_host, backend, layers=None) -> None:
        if to_host:
            write_stuck.wait(30)  # a slow L1 -> L2 write
        elif layers is not None and 0 not in layers:
            later_layers.wait(30)  # layers after 0 are slow to copy
        real(device, host, device_ids, host_ids, to_host, backend, layers)

    monkeypatch.setattr(hicache_module, "copy_pages", copy_pages)
    other = [100 + t for t in range(8)]
    hit, pages = cache.match(other), alloc.alloc(4)
    cache.release(other, pages, len(other), hit)  # queues its write-through, which is now stuck
    load = cache.match(loaded)
    try:
        assert load.loads, "the prefix should load from L2"
        waiter = threading.Thread(target=load.loads[-1].wait, args=(0,))
        waiter.start()
        waiter.join(timeout=10)
        assert not waiter.is_alive(), "layer 0 of the load waited behind an L1 -> L2 write"
        assert not load.loads[-1].finished(), "layer 0 came only after every layer was copied"
    finally:
        later_layers.set()
        write_stuck.set()
    load.loads[-1].wait(2)
    cache.release(loaded, load.pages, load.num_tokens, load)
    cache.wait_background()
    cache.close()


def _record_host_copies(monkeypatch) -> list[str]:
    """The threads that run L1 -> L2 copies, from now on."""
    threads: list[str] = []
    real = hicache_module.copy_pages

    def copy_pages(device, host, device_ids, host_ids, to_host, backend, layers=None) -> None:
        if to_host:
            threads.append(threading.current_thread().name)
        real(device, host, device_ids, host_ids, to_host, backend, layers)

    monkeypatch.setattr(hicache_module, "copy_pages", copy_pages)
    return threads


def _step_with_copies_landing(engine: Engine) -> None:
    """One step, then the copies it started finish (they apply at the next step): a copy faster
    than a step, whatever the load on the machine running the test."""
    engine.step()
    futures.wait([w.future for w in engine.cache._writes], timeout=10)


def test_write_back_copies_ahead_of_eviction_in_the_background(tiny_llama: Path, monkeypatch) -> None:
    """While requests run, write-back copies the least recently used L1 pages to L2 on its
    worker once free pages run low, so eviction finds them clean: no copy on the engine thread."""
    copies = _record_host_copies(monkeypatch)
    engine = _engine(tiny_llama, write_policy=WritePolicy.WRITE_BACK)
    gen = torch.Generator().manual_seed(5)
    engine.add_request("long", torch.randint(2, 384, (8,), generator=gen).tolist(),
                       SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for i in range(8):  # short requests one after another while the long one decodes
        engine.add_request(f"r{i}", torch.randint(2, 384, (12,), generator=gen).tolist(),
                           SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        while f"r{i}" in engine.requests:
            _step_with_copies_landing(engine)
    while engine.has_work():
        _step_with_copies_landing(engine)
    stats, threads = engine.stats(), set(copies)
    assert stats["cache_device_evicted_pages_total"] > 0, "the workload should evict written-back pages"
    assert threads == {"hicache-write"}, f"L1 -> L2 copies ran on {sorted(threads)}"
    assert stats.get("cache_l2_write_back_sync_pages_total", 0) == 0
    _check_accounting(engine)  # (its flush of everything copies what is still dirty, on this thread)


def test_write_back_pages_reach_l3_even_when_copied_at_eviction(tiny_llama: Path, expected: list[int],
                                                               tmp_path: Path) -> None:
    """Back to back requests leave write-back no time to copy ahead: the victims are copied at
    eviction (counted), and still go on to L3, where another engine finds them."""
    l3 = {"path": str(tmp_path / "l3"), "prefetch_threshold": 16}
    engine = _engine(tiny_llama, write_policy=WritePolicy.WRITE_BACK, storage_backend="file", storage_config=l3)
    target, fillers = _prompts()
    assert _run(engine, target)[0] == expected
    for filler in fillers:
        _run(engine, filler)
    _settle(engine)
    stats = engine.stats()
    assert stats["cache_l2_write_back_sync_pages_total"] > 0 and stats["cache_l3_backup_pages_total"] > 0
    fresh = _engine(tiny_llama, write_policy=WritePolicy.WRITE_BACK, storage_backend="file", storage_config=l3,
                    prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    tokens, tiers = _run(fresh, target)
    assert tokens == expected and tiers.get("storage", 0) >= 32, tiers
    engine.cache.close()
    fresh.cache.close()


def test_flush_waits_for_the_backups_it_starts(tiny_llama: Path, tmp_path: Path) -> None:
    """Write-back with L3: flushing L1 copies each dirty victim to L2 and backs it up to L3, which
    pins the victim and its parents until the backup lands. The flush waits for those backups and
    evicts on, so an idle engine's flush of both tiers leaves no page in either (found by
    tests/test_engine_machine.py: the parent stayed in L1, the victim in L2)."""
    engine = _engine(tiny_llama, write_policy=WritePolicy.WRITE_BACK, storage_backend="file",
                     storage_config={"path": str(tmp_path / "l3")})
    target, fillers = _prompts()
    _run(engine, target[:16])
    _run(engine, target[:8] + fillers[0][:8])  # a parent page run and two dirty children
    assert engine.cache.host.allocator.num_used == 0  # nothing copied yet
    assert engine.cache.flush(True, True)[0] > 0
    assert engine.allocator.num_used == 0, f"{engine.allocator.num_used} L1 pages survived the flush"
    assert engine.cache.host.allocator.num_used == 0, f"{engine.cache.host.allocator.num_used} L2 pages survived"
    assert engine.stats()["cache_l3_backup_pages_total"] > 0
    engine.allocator.check()
    engine.cache.host.allocator.check()
    engine.cache.close()


def test_a_checkpoint_never_swaps_in_pages_another_request_is_still_loading() -> None:
    """A running request checkpoints a prompt that meanwhile became L2-only and that another
    request's match is loading back into L1: the checkpoint must not trade the request's own pages
    (which hold its KV) for the tree's, whose copy has not landed; once it landed and a step agreed
    it, the checkpoint goes ahead."""
    cache, alloc = _small_cache()
    tokens = list(range(8))
    running_hit, own = cache.match(tokens[:-1]), alloc.alloc(4)  # it computed every page itself
    _host_only_prefix(cache, alloc, tokens)
    gate, copy = threading.Event(), cache._copy
    cache._copy = lambda *a, **k: (gate.wait(10), copy(*a, **k))[1]
    other = cache.match(tokens)
    assert other.loads and other.pages != own
    load = other.loads[-1]
    try:
        assert cache.checkpoint(tokens, own, 8, running_hit) is None
    finally:
        gate.set()
    load.wait(1)  # its last layer landed
    cache.on_step()  # every rank agreed the load landed
    lent = cache.checkpoint(tokens, own, 8, running_hit)
    assert lent is not None and lent.pages == other.pages and not lent.loads
    cache.close()
