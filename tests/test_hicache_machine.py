"""HiCache over L1, L2 and L3 driven by a hypothesis state machine, against a reference model.

The machine mirrors the engine's call order (``engine.scheduler``): ``prefetch`` when a request
arrives, ``on_step`` then ``ready`` then ``match`` (of all but the last token) when it is admitted,
``release`` when it finishes, ``cancel`` when it is aborted while waiting, ``evict`` for room. Its
other rules evict and flush L1 and L2, run background work, settle (``wait_background``), take L3
down and bring it back, and lose single L3 objects.

Reference model: the set of (salt, token prefix) pages that requests computed and released. Every
page of KV written by a request holds a value derived from its page key, so every check on data is
exact: whatever a tier holds under a key, and whatever a match returns, is that key's value.

Background work runs on step-by-step executors by default (the machine decides when each queued
L1 <-> L2 copy or L3 call runs, so examples replay exactly and shrink); ``ThreadedL3Machine`` runs
the same rules on the cache's own worker threads.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.hicache_fakes import (
    DEVICE_PAGES,
    HOST_PAGES,
    MAX_TOKENS,
    OPTIONS,
    PARTIAL,
    PS,
    SEED,
    FaultyLoader,
    Held,
    MemoryStorage,
    StepExecutor,
    keys_of,
    pick,
    value,
)
from helpers.hicache_invariants import L3Invariants
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.device_pool import DeviceKVPool, KVGeometry
from tierserve.cache.hicache import HiCache, HiCacheConfig
from tierserve.cache.host_pool import HostKVPool, HostLayout
from tierserve.cache.prefetch import PrefetchTicket
from tierserve.cache.radix_tree import path_to_root, subtree
from tierserve.core.scope import CacheScope

pytestmark = pytest.mark.fakes  # an L3 in a dict and executors stepped by hand (hicache_fakes)


class L3Machine(L3Invariants, RuleBasedStateMachine):
    threaded = False

    def __init__(self) -> None:
        super().__init__()
        geometry = KVGeometry(2, 1, 2, PS, torch.float32)
        self.alloc = PageAllocator(DEVICE_PAGES)
        self.device = DeviceKVPool(geometry, DEVICE_PAGES, torch.device("cpu"))
        self.host = HostKVPool(geometry, HOST_PAGES, HostLayout.PAGE_FIRST_DIRECT)
        self.store = MemoryStorage()
        self.cache = HiCache(self.alloc, self.device, self.host, SEED, HiCacheConfig(prefetch=OPTIONS))
        if not self.threaded:
            self.cache._worker.shutdown()
            self.cache._loader.shutdown()
            self.cache._worker = self.cache._loader = self.io = StepExecutor()  # one queue the test runs
        self.loader = self.cache._loader = FaultyLoader(self.cache._loader)
        self.cache.l3.attach(self.store)
        if not self.threaded:
            self.cache.storage._worker.shutdown()
            self.cache.storage._reader.shutdown()
            self.cache.storage._worker = self.cache.storage._reader = self.l3 = StepExecutor()  # one queue
        self.held: list[Held] = []
        self.waiting: list[tuple[list[int], str, PrefetchTicket | None]] = []
        # the reference model: every (salt, full-page prefix) a request computed and released
        self.computed: set[tuple[str, tuple[int, ...]]] = set()
        self.computed_keys: set[bytes] = set()
        self.history: list[tuple[list[int], str]] = []
        self.lossless = True  # L3 never failed nor lost an object: every backup must have landed

    def teardown(self) -> None:
        self.cache.close()

    # -- helpers ---------------------------------------------------------------------------------

    def _fill_device(self, page: int, v: float) -> None:
        self.device.buffer[:, :, page * PS : (page + 1) * PS] = v

    def _device_values(self) -> tuple[list[float], list[float]]:
        pages = self.device.buffer.unflatten(2, (DEVICE_PAGES, PS)).transpose(0, 2).flatten(1)
        return pages.amin(1).tolist(), pages.amax(1).tolist()

    def _host_values(self) -> tuple[list[float], list[float]]:
        pages = self.host.buffer.flatten(1)
        return pages.amin(1).tolist(), pages.amax(1).tolist()

    def _loads_ok(self, hit) -> bool:
        """Waits, as a step's attention does, until ``hit``'s loads stopped copying; False if one
        failed (the step raises ``HostLoadError`` and the engine fails the request)."""
        for load in hit.loads:
            if self.threaded:
                load.join()
            while not load.finished():
                assert self.io.queue, "a load was never queued"
                self.io.run(1)
        return not any(load.failed for load in hit.loads)

    def _loader_runs(self, n: int) -> None:
        """Between two matches of one step the loader thread copies on (threaded: on its own)."""
        if not self.threaded:
            self.io.run(n)

    def _drain(self) -> None:
        """Runs every queued copy and L3 call, and applies them, until nothing is left."""
        if self.threaded:
            self.cache.wait_background(timeout=10)
            return
        while self.io.queue or self.l3.queue or self.cache._writes or self.cache.storage._backups:
            self.io.run(len(self.io.queue))
            self.cache.on_step()
            self.l3.run(len(self.l3.queue))
            self.cache.on_step()
        self.cache.wait_background(timeout=1)  # nothing left to wait for: returns at once

    def _prefetch(self, tokens: list[int], salt: str) -> PrefetchTicket | None:
        """``HiCache.prefetch``: a ticket, and no L3 call on the engine thread (the L3 worker asks)."""
        tier = self.cache.storage
        local = self.cache.tree.cached_pages(tokens, salt)
        healthy, calls = tier.agreed_healthy, self.store.calls
        ticket = self.cache.prefetch(tokens, CacheScope(cache_salt=salt))
        # unthreaded, the L3 worker runs only when the test says so; threaded, see MemoryStorage.callers
        assert self.threaded or self.store.calls == calls, "the engine thread called L3"
        if ticket is None:
            return None
        assert healthy, "a prefetch started although L3 was agreed down"
        assert ticket.start == local and (len(tokens) // PS - local) * PS >= OPTIONS.threshold_tokens
        assert ticket.keys == keys_of(tokens, salt)[local : len(tokens) // PS], "a prefetch asks for the wrong keys"
        assert not ticket.decided and not ticket.host_pages
        return ticket

    def _land(self, ticket: PrefetchTicket) -> None:
        """Lets a ticket be probed, decided and read, and every rank agree on it."""
        for _ in range(60):
            if ticket.decided and (not ticket.host_pages or ticket.agreed_done):
                return
            if self.threaded:
                ticket.done.wait(0.05)  # the workers run on their own
            else:
                self.l3.run(len(self.l3.queue))
            self.cache.on_step()
        raise AssertionError("a prefetch did not land")

    def _take_pages(self, missing: int) -> list[int] | None:
        """``Scheduler._take_pages``: evicts L1 for what is missing, then takes the pages."""
        if self.alloc.num_free < missing:
            self.cache.evict(missing - self.alloc.num_free)
        pages = self.alloc.alloc(missing)
        while pages is None and self.cache.evict(missing) > 0:
            pages = self.alloc.alloc(missing)
        return pages

    def _admit(self, tokens: list[int], salt: str, ticket: PrefetchTicket | None) -> Any:
        """``Scheduler._match`` and ``_take_pages``: match all but the last token, take pages for
        the rest, "compute" them (write their values); no pages: give the hit back."""
        prompt = tokens[:-1]
        hit = self.cache.match(prompt, ticket, CacheScope(cache_salt=salt))
        n = hit.num_tokens // PS
        assert hit.num_tokens == n * PS and len(hit.pages) == n and n <= len(prompt) // PS
        assert n == 0 or (salt, tuple(prompt[: n * PS])) in self.computed, "a match returned pages never computed"
        assert sum(hit.by_tier.values()) == hit.num_tokens
        pages = self._take_pages(-(-len(tokens) // PS) - n)
        if pages is None:
            self.cache.release(tokens, list(hit.pages), hit.num_tokens, hit)
            return hit
        keys = keys_of(tokens, salt)
        for j, page in enumerate(pages, start=n):
            self._fill_device(page, value(keys[j]) if j < len(keys) else PARTIAL)
        self.held.append(Held(tokens, salt, list(hit.pages) + pages, hit))
        return hit

    # -- requests --------------------------------------------------------------------------------

    def _draw(self, data) -> tuple[list[int], str]:
        """A prompt, mostly a cut of an earlier (often recent) one plus new tokens (a multi-turn
        conversation, mostly under its cache salt: a cut under another salt must not hit)."""
        base: list[int] = []
        salts = ["", "", "t"]
        if self.history and data.draw(st.integers(0, 3)):
            recent = data.draw(st.booleans())  # mostly a recent one: the same conversation goes on
            base, salt = data.draw(st.sampled_from(self.history[-3:] if recent else self.history))
            base = base[: data.draw(st.integers(0, len(base)))]
            salts = [salt, salt, salt, "", "t"]
        tokens = (base + data.draw(st.lists(st.integers(0, 2), min_size=0 if base else 1, max_size=8)))[:MAX_TOKENS]
        salt = data.draw(st.sampled_from(salts))
        self.history.append((tokens, salt))
        return tokens, salt

    @rule(data=st.data())
    def arrive(self, data) -> None:
        """``Scheduler.add``: the prefetch starts when the request arrives."""
        tokens, salt = self._draw(data)
        self.waiting.append((tokens, salt, self._prefetch(tokens, salt)))

    @rule(data=st.data())
    def schedule(self, data) -> None:
        """``Scheduler.schedule``: one step boundary, then up to ``budget`` waiting requests are
        matched in arrival order (those still prefetching passed over) with no step between, while
        the loader copies on; one that finds no pages gives its hit back and waits (its prefetch
        used up). Draws do not depend on how many were ready (threaded: timing)."""
        budget = data.draw(st.integers(1, 3))
        runs = data.draw(st.lists(st.integers(0, 2), min_size=3, max_size=3))
        self.cache.on_step()
        for entry in list(self.waiting):
            tokens, salt, ticket = entry
            if budget == 0:
                return
            if not self.cache.ready(ticket):
                continue
            held, i = len(self.held), next(i for i, e in enumerate(self.waiting) if e is entry)
            self._admit(tokens, salt, ticket)
            if len(self.held) == held:
                self.waiting[i] = (tokens, salt, None)
                return
            del self.waiting[i]
            budget -= 1
            self._loader_runs(runs[budget])

    @rule(data=st.data())
    def abort_waiting(self, data) -> None:
        if (i := pick(data, self.waiting)) is None:
            return
        _, _, ticket = self.waiting.pop(i)
        self.cache.cancel(ticket)

    @rule(data=st.data())
    def finish(self, data) -> None:
        if (i := pick(data, self.held)) is not None:
            self._finish(self.held.pop(i))

    def _fail(self, held: Held) -> None:
        """``Engine._fail_request``: a request whose hit's load failed is released having computed
        nothing past its hit (the step that would have raised first)."""
        self.cache.release(held.tokens, held.pages, held.hit.num_tokens, held.hit)

    def _finish(self, held: Held) -> None:
        if not self._loads_ok(held.hit):
            self._fail(held)
            return
        keys = keys_of(held.tokens, held.salt)
        low, high = self._device_values()
        for j, page in enumerate(held.hit.pages):
            assert low[page] == high[page] == value(keys[j]), f"hit page {j} does not hold its key's KV"
        self.cache.release(held.tokens, held.pages, len(held.tokens), held.hit)
        for j in range(1, len(keys) + 1):
            self.computed.add((held.salt, tuple(held.tokens[: j * PS])))
        self.computed_keys.update(keys)

    @rule(data=st.data())
    def checkpoint(self, data) -> None:
        """Continuous offload: a running request's full pages join the tree; it keeps them, pinned.
        No precondition on ``held``: with worker threads its size depends on timing, and hypothesis
        replays a rule choice only if preconditions do not (``pick`` draws alike either way)."""
        if (i := pick(data, self.held)) is None:
            return
        held = self.held[i]
        if not self._loads_ok(held.hit):  # the step that generated a token waited on them
            self._fail(self.held.pop(i))
            return
        hit = self.cache.checkpoint(held.tokens, held.pages, len(held.tokens), held.hit)
        if hit is None:
            return
        assert hit.num_tokens == len(held.tokens) // PS * PS and len(hit.pages) > len(held.hit.pages)
        held.pages[: len(hit.pages)], held.hit = hit.pages, hit
        keys = keys_of(held.tokens, held.salt)[: len(hit.pages)]
        for j in range(1, len(keys) + 1):
            self.computed.add((held.salt, tuple(held.tokens[: j * PS])))
        self.computed_keys.update(keys)

    @rule(data=st.data())
    def serve(self, data) -> None:
        """A few requests arriving together (a conversation's turns, a shared system prompt): their
        prefetches land, one step matches them all in order (every page that arrived is in its
        match) while the loader copies on, and they finish, with no step between. It may come after
        a settle, a flush that left L3 the only copy, or one of L1 only (L2 holds the prefixes, so
        the first match loads them and the next ones split what is loading)."""
        before = data.draw(st.sampled_from(["nothing", "settle", "flush", "flush_l1", "flush_l1"]))
        if before != "nothing":
            self.settle()
        if before == "flush":
            self.flush(settle_first=False)
        if before == "flush_l1":
            self.cache.evict(10**6)
        requests = [self._draw(data) for _ in range(data.draw(st.integers(1, 4)))]
        runs = data.draw(st.lists(st.integers(0, 2), min_size=len(requests), max_size=len(requests)))
        tickets = [self._prefetch(tokens, salt) for tokens, salt in requests]
        for ticket in tickets:
            if ticket is not None:
                self._land(ticket)
                if ticket.host_pages:
                    assert ticket.agreed_arrived == len(ticket.keys), "a prefetch of pages L3 has fell short"
        order = data.draw(st.permutations(range(len(requests))))  # not of those admitted: timing
        batch = []
        for (tokens, salt), ticket, run in zip(requests, tickets, runs, strict=True):
            batch.append(self._serve_one(tokens, salt, ticket))
            self._loader_runs(run)
        for held in (batch[i] for i in order if batch[i] is not None):
            self._finish(held)

    def _serve_one(self, tokens: list[int], salt: str, ticket: PrefetchTicket | None) -> Held | None:
        """Admits one request of ``serve``; its pages a prefetch brought in are kept, unless the
        prefix it extends left the tree meanwhile (an earlier admission's eviction)."""
        held, local = len(self.held), self.cache.tree.cached_pages(tokens[:-1], salt)
        self._admit(tokens, salt, ticket)
        if ticket is not None and local >= ticket.start:
            arrived = min(ticket.agreed_arrived, (len(tokens) - 1) // PS - ticket.start)
            assert self.cache.tree.cached_pages(tokens[:-1], salt) >= ticket.start + arrived, \
                "pages a prefetch brought in were not kept"
        return self.held.pop() if len(self.held) > held else None

    # -- tiers -----------------------------------------------------------------------------------

    @rule(n=st.integers(1, 12))
    def evict_device(self, n: int) -> None:
        """Eviction keeps every page a running request holds; only a failed load takes pages out
        of the tree under its requests (which fail: the engine never runs them again)."""
        failed = [h for h in self.held if any(load.failed for load in h.hit.loads)]
        pinned = {p for h in self.held if h not in failed for p in h.hit.pages}
        self.cache.evict(n)
        assert pinned <= set(self.cache.tree.device_pages()), "a pinned page was evicted"
        kept = set(self.cache.tree.device_pages()) | set(self.cache.loads._orphans)
        assert {p for h in failed for p in h.hit.pages} <= kept, "a failed request's page was evicted"

    @rule(n=st.integers(1, 8))
    def evict_host(self, n: int) -> None:
        self.host.allocator.free(self.cache.tree.evict_host(n))

    @rule(settle_first=st.booleans())
    def flush(self, settle_first: bool) -> None:
        """Evicts all of L1 and L2 that may go (after settling, L3 is left the only copy)."""
        if settle_first:
            self.settle()
        self.cache.evict(10**6)
        self.host.allocator.free(self.cache.tree.evict_host(10**6))
        for node in self.cache.tree.nodes():
            if node.device is not None:
                # a load keeps its nodes until a step agreed it done (``loading`` is cleared then,
                # on the engine thread), not from when its copy finished; ``loads_are_tracked``
                # checks that no node stays ``loading`` after that
                kept = any(m.loading is not None for m in subtree(node))
                assert node.lock or kept, "flush left an evictable L1 node"
            elif not node.children:
                assert node.lock, "flush left an evictable L2 node"

    @rule(l3=st.booleans(), n=st.integers(1, 4))
    def run_background(self, l3: bool, n: int) -> None:
        """Some queued copies or L3 calls run (threaded: the workers run on their own)."""
        if not self.threaded:
            (self.l3 if l3 else self.io).run(n)

    @rule(layer=st.integers(0, 1))
    def host_copy_fault(self, layer: int) -> None:
        """The next L2 -> L1 load fails while copying ``layer`` (a host-to-device copy error)."""
        self.loader.armed = layer

    @rule()
    def step(self) -> None:
        self.cache.on_step()

    @rule()
    def settle(self) -> None:
        self._drain()
        assert not self.cache._writes and not self.cache.storage._backups
        if self.lossless:  # every L2 page was backed up (or came from L3)
            for node in self.cache.tree.nodes():
                if node.host is not None:
                    assert self.store.present(node.keys) == node.num_pages, "an L2 page never reached L3"

    @rule(down=st.booleans())
    def l3_health(self, down: bool) -> None:
        """L3 goes down, or is back (and the circuit breaker's retry interval passed)."""
        self.store.down = down
        if down:
            self.lossless = False
        else:
            self.cache.storage._down_until = 0.0

    @rule(data=st.data())
    def lose_l3_object(self, data) -> None:
        """L3 drops a page (quota, another node's clear): prefetches must stop at the hole."""
        with self.store._lock:
            keys = sorted(self.store.objects)
            if (i := pick(data, keys)) is not None:
                del self.store.objects[keys[i]]
                self.lossless = False

    @rule(data=st.data())
    def probe(self, data) -> None:
        """A plain tree match: one contiguous prefix, L1 part then L2 part, of computed pages."""
        tokens, salt = self._draw(data)
        tree = self.cache.tree
        m = tree.match(tokens, salt)
        assert m.num_pages == tree.cached_pages(tokens, salt)
        assert m.num_pages == 0 or (salt, tuple(tokens[: m.num_pages * PS])) in self.computed
        device_path = list(path_to_root(m.device_node))[::-1]
        assert [p for n in device_path for p in n.device] == m.device_pages
        assert [p for n in m.host_nodes for p in n.host] == m.host_pages
        assert all(n.device is None for n in m.host_nodes)
        below = list(path_to_root(m.last_node))[: len(m.host_nodes)][::-1]
        assert below == m.host_nodes and (not below or below[0].parent is m.device_node)


TestL3Machine = L3Machine.TestCase
# long examples: the bugs in loads need a prefix computed, copied to L2, dropped from L1, then loaded
# and split by a match of the same step; 80 x 120 steps found a reverted c4fa60b in 8 of 12 seeds
TestL3Machine.settings = settings(max_examples=80, stateful_step_count=120, deadline=None)


class ThreadedL3Machine(L3Machine):
    """The same rules with the cache's own worker threads doing the copies and L3 calls."""

    threaded = True


TestThreadedL3Machine = ThreadedL3Machine.TestCase
# random examples (seeds 1-8 and 900 more pass); print_blob: with worker threads a failure may not replay
# alike while shrinking, and the blob (@reproduce_failure) retries the example first seen
TestThreadedL3Machine.settings = settings(max_examples=20, stateful_step_count=50, deadline=None, print_blob=True)

