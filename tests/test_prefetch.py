"""L3 prefetch: no L3 call on the engine thread, every prefetch progresses however many run, the
``auto`` policy waits only when reading beats computing, and an unhealthy L3 holds no request."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from helpers.hicache_fakes import OPTIONS as HALF_RESERVED
from helpers.hicache_fakes import PS, SEED, MemoryStorage, keys_of

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.factory import hicache_config
from tierserve.cache.hicache import HiCache, HiCacheConfig
from tierserve.cache.host_pool import HostKVPool, HostLayout
from tierserve.cache.options import HiCacheOptions, PrefetchPolicy
from tierserve.cache.prefetch import (
    CHUNK_BYTES,
    CHUNK_PAGES,
    MAX_CHUNK_PAGES,
    PrefetchOptions,
    PrefetchTicket,
    chunk_pages,
    prefetch_timeout,
)
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.cache.storage_tier import PENDING_FLOOR_S, WINDOW

pytestmark = pytest.mark.fakes  # an L3 in a dict (hicache_fakes.MemoryStorage) in place of Mooncake

OPTIONS = PrefetchOptions(threshold_tokens=PS, max_reserved_fraction=1.0)


def _cache(policy: PrefetchPolicy, store: MemoryStorage, host_pages: int = 256) -> HiCache:
    geometry = KVGeometry(1, 1, 2, PS, torch.float32)
    host = HostKVPool(geometry, host_pages, HostLayout.PAGE_FIRST_DIRECT)
    return HiCache(PageAllocator(64), DeviceKVPool(geometry, 64, torch.device("cpu")), host, SEED,
                   HiCacheConfig(prefetch_policy=policy, prefetch=OPTIONS), storage=store)


def _stored(store: MemoryStorage, tokens: list[int]) -> None:
    for key in keys_of(tokens, ""):
        store.objects[key] = torch.tensor(0.0)  # copied into a page span by broadcasting


def _steps_until(cache: HiCache, done, what: str, deadline_s: float = 10.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not done():
        assert time.monotonic() < deadline, what
        cache.on_step()
        time.sleep(0.002)  # poll interval: the L3 worker runs meanwhile


def test_every_prefetch_progresses_however_many_run() -> None:
    store = MemoryStorage()
    prompts = [[i, i, i, i, i, i, i, i, 9] for i in range(2 * WINDOW + 5)]  # 4 pages each, more than a window
    for tokens in prompts:
        _stored(store, tokens[:-1])
    cache = _cache(PrefetchPolicy.WAIT_COMPLETE, store)
    tickets = [cache.prefetch(tokens) for tokens in prompts]
    assert all(isinstance(t, PrefetchTicket) for t in tickets)
    _steps_until(cache, lambda: all(cache.ready(t) for t in tickets), "every prefetch became ready")
    assert [t.agreed_arrived for t in tickets] == [4] * len(tickets), "a prefetch beyond the window fell short"
    for tokens, ticket in zip(prompts, tickets, strict=True):
        hit = cache.match(tokens[:-1], ticket)
        assert hit.by_tier == {"storage": 8}
        for load in hit.loads:
            load.wait(0)  # as attention does, layer by layer
        cache.release(tokens, list(hit.pages), hit.num_tokens, hit)
        cache.on_step()
    cache.wait_background()
    assert not cache.storage.tickets
    cache.close()


def test_l3_is_called_only_on_its_worker() -> None:
    store = MemoryStorage()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    _stored(store, tokens[:-1])
    cache = _cache(PrefetchPolicy.WAIT_COMPLETE, store)
    ticket = cache.prefetch(tokens)
    _steps_until(cache, lambda: cache.ready(ticket), "the prefetch landed")
    hit = cache.match(tokens[:-1], ticket)
    cache.release(tokens, list(hit.pages) + cache.allocator.alloc(1), len(tokens), hit)
    cache.wait_background()
    lanes = {"hicache-l3-backup", "hicache-l3-prefetch"}
    assert store.calls and store.callers <= lanes, f"L3 was called from {sorted(store.callers)}"
    cache.close()


def test_auto_waits_only_when_reading_beats_computing() -> None:
    store = MemoryStorage()
    slow_compute, fast_compute = [1] * 8 + [9], [2] * 8 + [9]
    for tokens in (slow_compute, fast_compute):
        _stored(store, tokens[:-1])
    cache = _cache(PrefetchPolicy.AUTO, store)
    speed = cache.storage.speed
    speed.record_read(1 << 20, 1.0)  # L3 reads 1 MiB/s
    speed.record_prefill(100, 1.0)  # 100 tokens/s: 4 pages (64 bytes) read far faster than computed
    waits = cache.prefetch(slow_compute)
    _steps_until(cache, lambda: waits.decided, "the first prefetch was decided")
    assert waits.wait, "auto did not wait although reading is faster"
    _steps_until(cache, lambda: cache.ready(waits), "it became ready once its pages arrived")
    assert waits.agreed_arrived == 4
    for _ in range(30):
        speed.record_prefill(10**9, 1.0)  # now computing is far faster than reading
    skips = cache.prefetch(fast_compute)
    _steps_until(cache, lambda: skips.decided, "the second prefetch was decided")
    assert not skips.wait and cache.ready(skips), "auto waited although computing is faster"
    stats = cache.stats()
    assert stats["l3_prefetch_wait_decisions_total"] == 1 and stats["l3_prefetch_no_wait_decisions_total"] == 1
    for ticket in (waits, skips):
        cache.cancel(ticket)
    cache.wait_background()
    cache.close()


class SlowStorage(MemoryStorage):
    """L3 whose reads take at least ``READ_S`` per object."""

    READ_S = 0.005

    def batch_get_into(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        time.sleep(self.READ_S * len(keys))
        return super().batch_get_into(keys, spans)


# A head dim that makes a page CHUNK_BYTES / CHUNK_PAGES bytes: a prefetch reads CHUNK_PAGES per call
CALL_SIZED = CHUNK_BYTES // (CHUNK_PAGES * 2 * PS * 4)


def _cp_cache(store: MemoryStorage, rank: int) -> tuple[KVGeometry, HiCache]:
    """CP rank ``rank`` of 2's cache over ``store``, its prefetches waited for whole; pages read
    ``CHUNK_PAGES`` per call."""
    geometry = KVGeometry(1, 1, CALL_SIZED, PS, torch.float32)
    assert chunk_pages(geometry.bytes_per_page) == CHUNK_PAGES
    return geometry, HiCache(PageAllocator(64), DeviceKVPool(geometry, 64, torch.device("cpu")),
                             HostKVPool(geometry, 256, HostLayout.PAGE_FIRST_DIRECT), SEED,
                             HiCacheConfig(prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, prefetch=OPTIONS),
                             storage=store, ownership=PageOwnership(rank, 2))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_cp_rank_measures_only_the_pages_it_read(rank: int) -> None:
    """Under CP a rank reads only the pages it owns; the ``auto`` policy's bandwidth must count
    those only. It counted every page of a chunk: rank 1, which owns no page of the last chunk
    (17 pages: 16, then 1), measured that one at ~120 times the store's speed, rank 0 at ~2 times."""
    store, tokens = SlowStorage(), [*range(2, 2 + 17 * PS), 1]
    _stored(store, tokens[:-1])
    geometry, cache = _cp_cache(store, rank)
    ticket = cache.prefetch(tokens)
    _steps_until(cache, lambda: cache.ready(ticket), "the prefetch arrived")
    assert ticket.agreed_arrived == 17
    store_bps = geometry.bytes_per_page / SlowStorage.READ_S  # an upper bound: each read sleeps that long
    assert 0 < cache.storage.speed.read_bps <= 1.05 * store_bps, f"{cache.storage.speed.read_bps:.0f} B/s measured"
    cache.cancel(ticket)
    cache.close()


class ReadSizes(MemoryStorage):
    """Records how many objects each read call asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[int] = []

    def batch_get_into(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        self.reads.append(len(keys))
        return super().batch_get_into(keys, spans)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_cp_rank_reads_its_pages_in_calls_as_full_as_a_whole_node(rank: int) -> None:
    """A CP rank reads only the pages it owns, ``CHUNK_PAGES`` of them per call (issue 28): cut into
    chunks of ``CHUNK_PAGES`` pages of the prompt, a CP=2 rank made as many calls for its half as a
    CP=1 node for the whole prompt, each half as full (128 per 32K-token prompt on each rank),
    and a call costs about as much whatever its size (benchmarks/RESULTS.md)."""
    store, tokens = ReadSizes(), [*range(2, 2 + 4 * CHUNK_PAGES * PS), 1]
    _stored(store, tokens[:-1])
    _, cache = _cp_cache(store, rank)
    ticket = cache.prefetch(tokens)
    _steps_until(cache, lambda: cache.ready(ticket), "the prefetch arrived")
    assert ticket.agreed_arrived == 4 * CHUNK_PAGES
    assert store.reads == [CHUNK_PAGES, CHUNK_PAGES]  # its 2 * CHUNK_PAGES pages in two full calls
    cache.cancel(ticket)
    cache.close()


def test_a_call_carries_about_chunk_bytes_of_small_pages_and_at_least_chunk_pages_of_large_ones() -> None:
    """A call costs about 1 ms besides its bytes: small pages (the tiny models' 8 KiB) go in calls of
    about ``CHUNK_BYTES``, up to ``MAX_CHUNK_PAGES`` (a 32K-token prompt's TTFT from L3 fell from 0.21
    to 0.14 s, benchmarks/RESULTS.md); large pages keep ``CHUNK_PAGES`` per call. Here a non-CP cache of
    64-byte pages reads 300 pages in two calls where it made 19."""
    assert chunk_pages(8 << 10) == MAX_CHUNK_PAGES == 256
    assert chunk_pages(32 << 10) == CHUNK_BYTES // (32 << 10) == 64
    assert chunk_pages(737 << 10) == chunk_pages(5 << 20) == CHUNK_PAGES
    store, tokens = ReadSizes(), [*range(2, 2 + 300 * PS), 1]
    _stored(store, tokens[:-1])
    cache = _cache(PrefetchPolicy.WAIT_COMPLETE, store, host_pages=512)
    ticket = cache.prefetch(tokens)
    _steps_until(cache, lambda: cache.ready(ticket), "the prefetch arrived")
    assert ticket.agreed_arrived == 300
    assert store.reads == [MAX_CHUNK_PAGES, 300 - MAX_CHUNK_PAGES]
    cache.cancel(ticket)
    cache.close()


def test_an_unhealthy_l3_holds_no_request() -> None:
    store = MemoryStorage()
    tokens = [3] * 8 + [9]
    _stored(store, tokens[:-1])
    store.down = True
    cache = _cache(PrefetchPolicy.WAIT_COMPLETE, store)
    ticket = cache.prefetch(tokens)
    _steps_until(cache, lambda: cache.ready(ticket), "the request stopped waiting for a failed L3", 2.0)
    cache.on_step()  # every rank now knows the breaker is open
    assert not cache.storage.agreed_healthy and cache.prefetch([4] * 8 + [9]) is None  # no more prefetches
    cache.cancel(ticket)
    cache.wait_background()
    cache.close()


class Hangs(MemoryStorage):
    """One kind of call hangs until ``release`` is set (a store that hangs instead of failing:
    no error opens the breaker): ``put`` (a flood of backups) or ``exists`` (prefetch probes)."""

    def __init__(self, call: str) -> None:
        super().__init__()
        self.call, self.release = call, threading.Event()

    def batch_set_from(self, keys: list[bytes], spans: list[torch.Tensor]) -> list[bool]:
        self.release.wait(30 if self.call == "put" else 0)
        return super().batch_set_from(keys, spans)

    def batch_exists(self, keys: list[bytes]) -> int:
        self.release.wait(30 if self.call == "exists" else 0)
        return super().batch_exists(keys)


def test_a_prefetch_never_waits_behind_backups() -> None:
    store = Hangs("put")
    wanted = [5] * 8 + [9]
    _stored(store, wanted[:-1])
    cache = _cache(PrefetchPolicy.WAIT_COMPLETE, store)
    try:
        computed = [6] * 8 + [9]
        hit = cache.match(computed[:-1])
        cache.release(computed, cache.allocator.alloc(5), len(computed), hit)  # written to L2, then backed up
        _steps_until(cache, lambda: cache.storage._backups, "a backup started")
        ticket = cache.prefetch(wanted)
        _steps_until(cache, lambda: cache.ready(ticket), "the prefetch landed while the backup hung", 5.0)
        assert ticket.agreed_arrived == 4
        cache.cancel(ticket)
    finally:
        store.release.set()
    cache.wait_background()
    cache.close()


def test_no_policy_waits_past_the_hard_bound_on_a_hung_store() -> None:
    store = Hangs("exists")
    tokens = [7] * 8 + [9]
    _stored(store, tokens[:-1])
    geometry = KVGeometry(1, 1, 2, PS, torch.float32)
    cache = HiCache(PageAllocator(64), DeviceKVPool(geometry, 64, torch.device("cpu")),
                    HostKVPool(geometry, 64, HostLayout.PAGE_FIRST_DIRECT), SEED,
                    HiCacheConfig(prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
                                  prefetch=PrefetchOptions(threshold_tokens=PS, timeout_max=0.5)), storage=store)
    try:
        ticket = cache.prefetch(tokens)
        started = ticket.created  # the bound counts from here (a clock read after it made this flaky)
        _steps_until(cache, lambda: cache.ready(ticket), "wait_complete gave up on a hung store", 5.0)
        assert 0.5 <= time.monotonic() - started < 3.0 and cache.storage.agreed_healthy
        cache.cancel(ticket)
    finally:
        store.release.set()
    cache.wait_background()
    cache.close()


def test_the_timeout_formula_and_its_overrides() -> None:
    """``min(timeout_max, timeout_base + timeout_per_ki_token * tokens / 1024)`` seconds, with
    SGLang's defaults (2 s, 0.1 s per 1,024 tokens, at most 30 s) or the extra config's values."""
    defaults = PrefetchOptions()
    values = [prefetch_timeout(defaults, n) for n in (0, 1024, 10240, 287_744, 10**6)]
    assert values == pytest.approx([2.0, 2.1, 3.0, 30.0, 30.0])
    extra = {"prefetch_timeout_base": 0.5, "prefetch_timeout_per_ki_token": 1, "prefetch_timeout_max": 4}
    own = hicache_config(HiCacheOptions(storage_config=extra)).prefetch
    assert (own.timeout_base, own.timeout_per_ki_token, own.timeout_max) == (0.5, 1.0, 4.0)
    assert [prefetch_timeout(own, n) for n in (0, 512, 2048, 4096)] == pytest.approx([0.5, 1.0, 2.5, 4.0])


def test_timeout_waits_for_a_hung_store_as_long_as_the_formula_says() -> None:
    """A ticket's timeout counts only the tokens it would read from L3 (those beyond L1 + L2);
    the ``timeout`` policy holds the request that long, and no longer, for a store that hangs."""
    store = Hangs("exists")
    tokens = [8] * 8 + [9]  # 4 pages of 2 tokens, none local
    _stored(store, tokens[:-1])
    options = PrefetchOptions(threshold_tokens=PS, timeout_base=0.3, timeout_per_ki_token=0.1 * 1024, timeout_max=10)
    geometry = KVGeometry(1, 1, 2, PS, torch.float32)
    cache = HiCache(PageAllocator(64), DeviceKVPool(geometry, 64, torch.device("cpu")),
                    HostKVPool(geometry, 64, HostLayout.PAGE_FIRST_DIRECT), SEED,
                    HiCacheConfig(prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch=options), storage=store)
    try:
        ticket = cache.prefetch(tokens)
        assert ticket.timeout == prefetch_timeout(options, 8) == pytest.approx(0.3 + 0.1 * 8)
        _steps_until(cache, lambda: cache.ready(ticket), "timeout gave up on a hung store", 5.0)
        waited = time.monotonic() - ticket.created
        assert ticket.timeout <= waited < ticket.timeout + 1.0, waited
        assert ticket.agreed_overdue == 1 and cache.storage.agreed_healthy
        cache.cancel(ticket)
    finally:
        store.release.set()
    cache.wait_background()
    cache.close()


def test_the_engine_is_woken_when_a_probe_and_then_its_read_end() -> None:
    """A request waiting on L3 is admitted at the step after its probe or read ends: the L3 lane
    calls the engine's waker (``EngineLoop.wake``) instead of leaving it to its next poll (issue 17)."""
    store = MemoryStorage()
    tokens = [3] * (2 * PS) + [9]
    _stored(store, tokens[:-1])
    cache = _cache(PrefetchPolicy.WAIT_COMPLETE, store)
    woken = threading.Semaphore(0)
    cache.set_waker(woken.release)
    ticket = cache.prefetch(tokens)
    assert woken.acquire(timeout=10), "no wake after the probe"
    cache.on_step()  # agrees on the probe and starts the read
    assert woken.acquire(timeout=10), "no wake after the read"
    _steps_until(cache, lambda: cache.ready(ticket), "the prefetch is ready")
    assert ticket.agreed_arrived == 2


def _serve(cache: HiCache, tokens: list[int]) -> Any:
    """One request through the engine's calls, its prefetch allowed to land; returns its hit."""
    ticket = cache.prefetch(tokens)
    deadline = time.monotonic() + 10
    while ticket is not None and not (ticket.decided and (not ticket.host_pages or ticket.agreed_done)):
        assert time.monotonic() < deadline, "a prefetch did not land"
        ticket.done.wait(0.01)  # the L3 worker probes and reads meanwhile
        cache.on_step()
    hit = cache.match(tokens[:-1], ticket)
    for load in hit.loads:
        load.wait(cache.device.geometry.num_layers - 1)
    pages = cache.allocator.alloc(-(-len(tokens) // PS) - len(hit.pages))
    cache.release(tokens, list(hit.pages) + pages, len(tokens), hit)
    return hit


def test_prefetch_keeps_the_l2_prefix_it_extends() -> None:
    geometry = KVGeometry(1, 1, 2, PS, torch.float32)
    host = HostKVPool(geometry, 4, HostLayout.PAGE_FIRST_DIRECT)  # cap: 2 pages for prefetches
    cache = HiCache(PageAllocator(16), DeviceKVPool(geometry, 16, torch.device("cpu")), host, SEED,
                    HiCacheConfig(prefetch=HALF_RESERVED), storage=MemoryStorage())
    a, a_longer, b = [0, 0, 0, 0, 9], [0, 0, 0, 0, 1, 1, 9], [2, 2, 2, 2, 9]
    try:
        _serve(cache, a)
        _serve(cache, a_longer)
        cache.wait_background()  # L3: a's 2 pages and the 1 page after them
        cache.evict(10**6)
        host.allocator.free(cache.tree.evict_host(1))  # L2: a's 2 pages
        _serve(cache, b)
        cache.wait_background()
        cache.evict(10**6)  # L2 full: a's pages (least recently used) and b's
        assert cache.tree.cached_pages(a_longer) == 2
        hit = _serve(cache, a_longer)  # 2 pages in L2, the third in L3
        assert hit.num_tokens == 3 * PS, f"the request found {hit.num_tokens // PS} of 3 pages"
    finally:
        cache.close()


def test_a_prefetch_waits_for_pages_another_node_is_still_writing() -> None:
    """The store holds 2 of a prompt's 4 pages; the other 2 land a moment later (another node's
    backup in flight). Told they are pending, the prefetch asks again and reads all 4; not told,
    it reads the 2 it found (the control)."""
    store = MemoryStorage()
    told, untold = [5] * 8 + [9], [6] * 8 + [9]
    for tokens in (told, untold):
        _stored(store, tokens[:4])
    cache = _cache(PrefetchPolicy.WAIT_COMPLETE, store)
    waits, control = cache.prefetch(told, l3_pending=4), cache.prefetch(untold)
    _steps_until(cache, lambda: control.decided, "the control's probe was decided")
    landing = threading.Timer(0.2, lambda: [_stored(store, tokens[:-1]) for tokens in (told, untold)])
    landing.start()
    _steps_until(cache, lambda: cache.ready(waits) and cache.ready(control), "both prefetches became ready")
    landing.join()
    assert (waits.agreed_arrived, control.agreed_arrived) == (4, 2)
    assert cache.stats()["l3_prefetch_backup_waits_total"] == 1
    for ticket in (waits, control):
        cache.cancel(ticket)
    cache.wait_background()
    cache.close()


def test_pending_pages_that_never_land_are_awaited_as_long_as_writing_them_takes() -> None:
    """With a write speed measured here, pending pages are awaited for twice the time writing them
    takes plus a floor, not the ticket's timeout; then the request goes on with what the store has."""
    store = MemoryStorage()
    tokens = [4] * 8 + [9]
    _stored(store, tokens[:2])
    cache = _cache(PrefetchPolicy.WAIT_COMPLETE, store)
    cache.storage.speed.record_write(1 << 30, 1.0)  # 1 GiB/s: 4 pages are written at once
    ticket = cache.prefetch(tokens, l3_pending=4)
    bound = ticket.pending_until - ticket.created
    assert bound == pytest.approx(PENDING_FLOOR_S, abs=0.01) and bound < ticket.timeout
    _steps_until(cache, lambda: cache.ready(ticket), "the prefetch gave up waiting")
    assert ticket.agreed_arrived == 1 and ticket.awaited and time.monotonic() >= ticket.pending_until
    cache.cancel(ticket)
    cache.wait_background()
    cache.close()


def test_pending_pages_are_never_awaited_longer_than_computing_them_would_take() -> None:
    store = MemoryStorage()
    tokens = [3] * 8 + [9]
    cache = _cache(PrefetchPolicy.WAIT_COMPLETE, store)
    cache.storage.speed.record_write(1, 1.0)  # a store so slow that the write bound is the ticket's timeout
    cache.storage.speed.record_prefill(80, 1.0)  # 80 tokens/s: the 4 pending pages (8 tokens) in 0.1 s
    ticket = cache.prefetch(tokens, l3_pending=4)
    assert ticket.pending_until - ticket.created == pytest.approx(0.1, abs=0.01)
    _steps_until(cache, lambda: cache.ready(ticket), "the prefetch gave up waiting")
    cache.cancel(ticket)
    cache.wait_background()
    cache.close()
