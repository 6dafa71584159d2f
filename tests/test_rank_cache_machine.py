"""Two ranks' HiCaches driven in lock-step by a hypothesis state machine, for a CP=2 node and a
TP=2 node (``docs/cp.md``, one rotation per path; ``docs/ranks.md``, one logical cache).

Both ranks get the same calls in the engine's order (``prefetch`` at arrival; ``on_step``, ``ready``,
``match`` and page allocation at admission; ``release`` at the end), with L2 and an L3 both share.
What differs between the ranks is what differs between processes: each rank's L1 <-> L2 copies and
L3 calls run when the machine says so (one rank's copies land later than the other's), and a read
or write may fail on one rank only (an L2 -> L1 load, an L1 -> L2 write, an L3 read cut short).
Every decision those feed is taken on the value the ranks agreed (``on_step``'s ``agreement.min``,
a real minimum over both ranks' values), and a request whose load failed on either rank fails on
both, as ``Engine._fail_restores`` decides. After every rule: both ranks hold the same tree
(shape, logical page ids, tiers, loading and writing marks), and under CP every path of it is one
rotation, in L1 and L2 alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from helpers.hicache_fakes import MAX_TOKENS, PS, pick
from helpers.rank_cache_pairs import Layout, RankCache, RankPair, rotation_breaks, tree_view
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tierserve.cache.base import PrefixHit
from tierserve.cache.prefetch import PrefetchTicket
from tierserve.core.scope import CacheScope

pytestmark = [pytest.mark.fakes, pytest.mark.slow]  # an L3 in a dict, hand-stepped executors, ranks as threads


@dataclass
class Running:
    """A request admitted on both ranks: its pages and hit on each."""

    tokens: list[int]
    salt: str
    pages: list[list[int]]
    hits: list[PrefixHit]


class RankPairMachine(RuleBasedStateMachine):
    layout = Layout.CP

    def __init__(self) -> None:
        super().__init__()
        self.pair = RankPair(self.layout)
        self.waiting: list[tuple[list[int], str, list[PrefetchTicket | None]]] = []
        self.running: list[Running] = []
        self.history: list[tuple[list[int], str]] = []

    def teardown(self) -> None:
        self.pair.close()

    # -- the engine's calls, on both ranks --------------------------------------------------------

    def _step(self) -> None:
        """``Scheduler.schedule``'s step boundary: one agreement, both ranks side by side. Where a
        load failed on some rank, every rank's step drops it and first waits for its own copies
        of that load and those below it (``Loads._drop`` joins them; the loader thread runs on
        meanwhile): here each rank's queued copies run first, as its loader would."""
        if any(x.failed for r in self.pair.ranks for x in r.cache.loads.running):
            self.pair.each(_finish_loads)
        self.pair.both(lambda r: r.cache.on_step())

    def _draw(self, data) -> tuple[list[int], str]:
        """A prompt, mostly a cut of an earlier one plus new tokens (turns of a conversation)."""
        base: list[int] = []
        salts = ["", "", "t"]
        if self.history and data.draw(st.integers(0, 3)):
            base, salt = data.draw(st.sampled_from(self.history[-4:]))
            base = base[: data.draw(st.integers(0, len(base)))]
            salts = [salt, salt, salt, "t"]
        tokens = (base + data.draw(st.lists(st.integers(0, 2), min_size=0 if base else 1, max_size=8)))[:MAX_TOKENS]
        salt = data.draw(st.sampled_from(salts))
        self.history.append((tokens, salt))
        return tokens, salt

    @rule(data=st.data())
    def arrive(self, data) -> None:
        tokens, salt = self._draw(data)
        tickets = self.pair.each(lambda r: r.cache.prefetch(tokens, CacheScope(cache_salt=salt)))
        assert (tickets[0] is None) == (tickets[1] is None), "one rank started a prefetch, the other did not"
        self.waiting.append((tokens, salt, tickets))

    @rule(data=st.data())
    def schedule(self, data) -> None:
        """A step boundary, then up to ``budget`` ready requests matched in arrival order with no
        step between, while each rank's copies run on by its own drawn amount."""
        budget = data.draw(st.integers(1, 3))
        self._step()
        for entry in list(self.waiting):
            if budget == 0:
                return
            tokens, salt, tickets = entry
            ready = [r.cache.ready(t) for r, t in zip(self.pair.ranks, tickets, strict=True)]
            assert ready[0] == ready[1], "the ranks disagree on whether a request may run"
            if not ready[0]:
                continue
            i = next(i for i, e in enumerate(self.waiting) if e is entry)
            if not self._admit(tokens, salt, tickets):
                self.waiting[i] = (tokens, salt, [None, None])
                return
            del self.waiting[i]
            budget -= 1
            for rank, n in zip(self.pair.ranks, data.draw(st.lists(st.integers(0, 3), min_size=2, max_size=2)),
                               strict=True):
                rank.io.run(n)

    def _admit(self, tokens: list[int], salt: str, tickets: list[PrefetchTicket | None]) -> bool:
        """``Scheduler._match`` and ``_take_pages`` on both ranks (all but the last token matched)."""
        hits = [r.cache.match(tokens[:-1], tickets[i], CacheScope(cache_salt=salt))
                for i, r in enumerate(self.pair.ranks)]
        assert hits[0].num_tokens == hits[1].num_tokens and hits[0].pages == hits[1].pages, "the ranks' hits differ"
        missing = -(-len(tokens) // PS) - len(hits[0].pages)
        pages = [_take_pages(r, hit.pages, missing) for r, hit in zip(self.pair.ranks, hits, strict=True)]
        assert pages[0] == pages[1], "the ranks took other pages"
        if pages[0] is None:
            for r, hit in zip(self.pair.ranks, hits, strict=True):
                r.cache.release(tokens, list(hit.pages), hit.num_tokens, hit)
            return False
        self.running.append(Running(tokens, salt, [list(h.pages) + p for h, p in zip(hits, pages, strict=True)], hits))
        return True

    @rule(data=st.data())
    def serve(self, data) -> None:
        """A few requests arriving together (often the same prompt twice: two users, one system
        prompt): their prefetches land on both ranks, then they are admitted in order, each
        computing its own rotation where nothing is cached; those admitted may finish before the
        next is admitted (which then finds their pages beside what its prefetch read), in some
        order, with L1 flushed or the copies settled between finishes or not (so a prefix one of
        them stored may be host-only when the next releases its own copy of it)."""
        requests = [self._draw(data) for _ in range(data.draw(st.integers(1, 3)))]
        if data.draw(st.booleans()):
            requests.append(requests[0])
        tickets = [self.pair.each(lambda r, t=tokens, s=salt: r.cache.prefetch(t, CacheScope(cache_salt=s)))
                   for tokens, salt in requests]
        for pair_tickets in tickets:
            self._land(pair_tickets)
        self._step()
        running = len(self.running)
        for (tokens, salt), pair_tickets in zip(requests, tickets, strict=True):
            self._admit(tokens, salt, pair_tickets)  # no pages: it gives its hit back (and goes away)
            if len(self.running) > running and data.draw(st.booleans()):
                self._finish_from(running, data)
                self._step()
        self._finish_from(running, data)

    def _finish_from(self, start: int, data) -> None:
        """Finishes the running requests from ``start`` on, in a drawn order, with L1 flushed or
        the copies settled between finishes or not."""
        batch = self.running[start:]
        del self.running[start:]
        for request in [batch[i] for i in data.draw(st.permutations(range(len(batch))))]:
            between = data.draw(st.sampled_from(["nothing", "settle", "flush"]))
            if between == "settle":
                self.settle()
            elif between == "flush":
                self.flush(host=False)
            self._finish(request)

    def _land(self, tickets: list[PrefetchTicket | None]) -> None:
        """Runs both ranks' L3 calls and steps until the ranks agreed the prefetch decided and read."""
        for _ in range(50):
            if tickets[0] is None or (tickets[0].decided and (not tickets[0].host_pages or tickets[0].agreed_done)):
                return
            self.pair.each(lambda r: r.l3.run(len(r.l3.queue)))
            self._step()
        raise AssertionError("a prefetch did not land")

    @rule(data=st.data())
    def abort_waiting(self, data) -> None:
        if (i := pick(data, self.waiting)) is None:
            return
        _, _, tickets = self.waiting.pop(i)
        for r, ticket in zip(self.pair.ranks, tickets, strict=True):
            r.cache.cancel(ticket)

    @rule(data=st.data())
    def finish(self, data) -> None:
        """The request's forward ran and it finished: each rank first waits for its hit's loads
        (its own copies run until they stopped); if one failed on any rank, the request fails on
        every rank, having computed nothing past its hit (``Engine._fail_restores``)."""
        if (i := pick(data, self.running)) is None:
            return
        self._finish(self.running.pop(i))

    def _finish(self, request: Running) -> None:
        failed = min(_loads_ok(r, hit) for r, hit in zip(self.pair.ranks, request.hits, strict=True)) == 0
        for r, pages, hit in zip(self.pair.ranks, request.pages, request.hits, strict=True):
            computed = hit.num_tokens if failed else len(request.tokens)
            r.cache.release(request.tokens, pages, computed, hit)

    # -- background work, lagging and failing on one rank ----------------------------------------

    @rule(rank=st.integers(0, 1), l3=st.booleans(), n=st.integers(1, 4))
    def run_copies(self, rank: int, l3: bool, n: int) -> None:
        """Some of one rank's queued copies (or L3 calls) run: the other rank's lag behind."""
        r = self.pair.ranks[rank]
        (r.l3 if l3 else r.io).run(n)

    @rule()
    def step(self) -> None:
        self._step()

    @rule(rank=st.integers(0, 1), layer=st.integers(0, 1))
    def fail_load(self, rank: int, layer: int) -> None:
        """The next L2 -> L1 load fails on this rank only, while copying ``layer``."""
        self.pair.ranks[rank].loader.armed = layer

    @rule(rank=st.integers(0, 1))
    def fail_write(self, rank: int) -> None:
        """The next L1 -> L2 write fails on this rank only."""
        self.pair.ranks[rank].writer.armed = True

    @rule(rank=st.integers(0, 1), n=st.integers(0, 3))
    def cut_l3_read(self, rank: int, n: int) -> None:
        """This rank's next L3 read gets only its first ``n`` objects."""
        self.pair.ranks[rank].store.short_read = n

    @rule(n=st.integers(1, 8))
    def evict_device(self, n: int) -> None:
        self.pair.each(lambda r: r.cache.evict(n))

    @rule(n=st.integers(1, 8))
    def evict_host(self, n: int) -> None:
        self.pair.each(lambda r: r.cache.host.allocator.free(r.cache.tree.evict_host(n)))

    @rule(host=st.booleans())
    def flush(self, host: bool) -> None:
        """All of L1 that may go (host-only nodes are left), and of L2 too (L3 is left)."""
        self.settle()
        self.evict_device(10**6)
        if host:
            self.evict_host(10**6)

    @rule()
    def settle(self) -> None:
        """Every queued copy and L3 call runs and is applied, until nothing is left."""
        for _ in range(100):
            if not any(r.io.queue or r.l3.queue or r.cache.copies_in_flight for r in self.pair.ranks):
                return
            self.pair.each(lambda r: (r.io.run(len(r.io.queue)), r.l3.run(len(r.l3.queue))))
            self._step()
        raise AssertionError("background work never ended")

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def ranks_hold_the_same_tree(self) -> None:
        first, second = (tree_view(r.cache) for r in self.pair.ranks)
        assert first == second, "the ranks' trees differ"
        assert [r.alloc.num_free for r in self.pair.ranks] == [self.pair.ranks[0].alloc.num_free] * 2
        assert len({r.cache.host.allocator.num_free for r in self.pair.ranks}) == 1

    @invariant()
    def every_path_is_one_rotation(self) -> None:
        for r in self.pair.ranks:
            breaks = rotation_breaks(r.cache)
            assert not breaks, "; ".join(breaks)

    @invariant()
    def pages_are_accounted(self) -> None:
        for r in self.pair.ranks:
            r.alloc.check()
            r.cache.host.allocator.check()


def _take_pages(r: RankCache, previous: list[int], missing: int) -> list[int] | None:
    """``Scheduler._take_pages``: evicts for what is missing, then continues the rotation."""
    if r.alloc.num_free < missing:
        r.cache.evict(missing - r.alloc.num_free)
    pages = r.alloc.alloc_after(previous, missing)
    while pages is None and r.cache.evict(missing) > 0:
        pages = r.alloc.alloc_after(previous, missing)
    return pages


def _finish_loads(r: RankCache) -> None:
    """Runs this rank's queued copies until none of its loads still copies."""
    while not all(x.finished() for x in r.cache.loads.running):
        assert r.io.queue, "a load was never queued"
        r.io.run(1)


def _loads_ok(r: RankCache, hit: PrefixHit) -> int:
    """Runs this rank's copies until ``hit``'s loads stopped (the forward waits for them); 1 if
    none failed here."""
    for load in hit.loads:
        while not load.finished():
            assert r.io.queue, "a load was never queued"
            r.io.run(1)
    return int(not any(load.failed for load in hit.loads))


TestCPPairMachine = RankPairMachine.TestCase
TestCPPairMachine.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)


class TPPairMachine(RankPairMachine):
    layout = Layout.TP


TestTPPairMachine = TPPairMachine.TestCase
TestTPPairMachine.settings = settings(max_examples=50, stateful_step_count=60, deadline=None)
