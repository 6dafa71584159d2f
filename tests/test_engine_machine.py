"""The engine with HiCache (L1, L2 and a file L3) driven by a hypothesis state machine: no page is ever
lost or leaked, whatever requests, steps, aborts, finishes, failed copies and flushes come in
whatever order.

A real ``Engine`` on a tiny random model (CPU, float32) with 2-token pages, a 20-page L1 pool, a
30-page L2 pool, 6-token prefill chunks and at most 3 running requests, so chunked prefill, eviction
to L2 and L3, loads back, L3 prefetches, preemption and admission limits all happen; each example
draws the write policy, the prefetch policy, continuous offload and speculative decoding (none, or a
noisy draft whose KV is cached packed with the target's or in a sidecar pool). Prompts are drawn to
share prefixes (an earlier prompt's prefix, extended), with varied ``max_tokens``, ``min_tokens``,
stop token ids, stop strings, ``ignore_eos``, logprobs, prompt logprobs and greedy, seeded or
unseeded sampling. A rule makes the next background L1 -> L2 write or L2 -> L1 load fail. Decode
role rules reserve pages for a prompt (``Engine.reserve``), start or cancel the reservation, and
move the steps' clock so leases expire and quarantined pages come back. Prefill role rules add a
request whose prompt KV a handoff reads (its pages are parked while the handoff is busy) and end
such handoffs: the pages must still hold what was read. L3 rules take the store down and back (every
call raises), overwrite part of one object or lose it, and ask an earlier prompt again once L1 and
L2 were dropped.

Checked after every rule: each device page is free, held by the tree, by one live request or
reservation, by the quarantine, by a parked handoff or by a failed load; each host page is free, the
tree's, an in-flight write's or a prefetch's; both allocators' own ``check`` passes; a loading node
belongs to a load still tracked; every path cached under a salt is a prefix of what a request of
that salt computed (requests draw one of two tenants' salts). After running to idle (polled with a
deadline: a stuck engine fails): no request or reservation is left, no node is pinned, every request
got a finish reason and a consistent number of tokens (and logprobs), greedy outputs (and seeded
ones without a draft) equal the same request run alone on a cache-less engine without a draft, and
(when drawn) a full flush frees every page of both tiers: a page the tree cannot let go of is a leak
too.

Background copies run on the cache's real threads, so an example's outcome (not its draws) may
depend on timing; draws never read state that timing changes (``abort`` picks by number).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
from helpers.engine_cache_faults import Faults
from helpers.engine_machine_world import (
    MAX_NEW,
    PS,
    VOCAB,
    Sender,
    Tracked,
    alone,
    assert_device_pages_owned,
    assert_host_pages_owned,
    assert_paths_computed,
    draft_model,
    reference_engine,
    sampling_params,
    tiny_model,
)
from helpers.hicache_fakes import assert_loads_tracked
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tierserve.cache.loads import HostLoadError
from tierserve.cache.options import DraftLayout, HiCacheOptions, PrefetchPolicy, WritePolicy
from tierserve.core.outputs import FinishReason
from tierserve.core.sampling import SamplingParams
from tierserve.core.scope import CacheScope
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.request import RequestOutput
from tierserve.engine.reservations import CapacityError, ReservationTerms

POOL_TOKENS = 40  # 20 L1 pages: a few requests fill it
MAX_PROMPT = 16
IDLE_DEADLINE_S = 10.0  # a tiny engine that has not gone idle by then is stuck
SALTS = ("", "tenant-b")  # requests of two tenants share prompts, never KV
RESERVED_SALT = "reserved"  # reservations' pages hold no computed KV: never shared with checked requests
TERMS = ReservationTerms(lease_s=5.0, grace_s=8.0, headroom_tokens=4)


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None
        self.l3 = Path(tempfile.mkdtemp(prefix="engine-machine-l3-"))
        self.live: dict[str, Tracked] = {}
        self.done: dict[str, Tracked] = {}
        self.prompts: list[list[int]] = []
        self.ids = 0
        self.faults = Faults()
        self.speculative = False
        self.senders: dict[str, Sender] = {}  # prefill requests' handoffs
        self.streams: dict[str, list[Tracked]] = {}  # every request (and reservation) by salt
        self.failed = 0  # requests that failed because of an injected load failure
        self.now = 0.0  # the steps' clock (leases and quarantines), moved by ``wait``
        self.reserved = 0  # reservations made (decode role), named d0, d1, ...
        reference_engine()  # built first: an engine seeds torch's global generator, which unseeded sampling uses

    @initialize(policy=st.sampled_from(WritePolicy), prefetch=st.sampled_from(PrefetchPolicy),
                offload=st.booleans(), draft=st.sampled_from([None, DraftLayout.PACKED, DraftLayout.SIDECAR]))
    def start(self, policy: WritePolicy, prefetch: PrefetchPolicy, offload: bool, draft: DraftLayout | None) -> None:
        """``offload``: continuous offload of generated pages (a decode node's checkpoints);
        ``draft``: speculative decoding, the draft's KV cached in that layout beside the target's."""
        self.speculative = draft is not None
        spec = {"speculative_draft_model_path": draft_model(draft), "speculative_num_steps": 2,
                "speculative_draft_layout": draft} if draft is not None else {}
        hicache = HiCacheOptions(ratio=1.5, write_policy=policy, write_threshold=2, storage_backend="file",
                                 storage_config={"path": str(self.l3), "prefetch_threshold": PS},
                                 prefetch_policy=prefetch)
        self.engine = Engine(EngineConfig(tiny_model(), dtype="float32", page_size=PS, max_total_tokens=POOL_TOKENS,
                                          chunked_prefill_size=6, max_running_requests=3,
                                          enable_hierarchical_cache=True, hicache=hicache,
                                          offload_generated=offload, **spec))
        self.faults.inject(self.engine.cache)

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.cache.close()
        shutil.rmtree(self.l3, ignore_errors=True)

    # -- rules -----------------------------------------------------------------------------------

    @rule(data=st.data(), n=st.integers(1, 3))
    def add(self, data: st.DataObject, n: int) -> None:
        """Adds ``n`` requests at once (several per step fill the pool: eviction, preemption)."""
        for _ in range(n):
            prompt = data.draw(self._prompt(), label="prompt")
            params = data.draw(sampling_params(), label="params")
            salt = data.draw(st.sampled_from(SALTS), label="salt")
            rid = f"r{self.ids}"
            self.ids += 1
            self.engine.add_request(rid, prompt, params, scope=CacheScope(cache_salt=salt))
            self.prompts.append(prompt)
            self._follow(rid, Tracked(prompt, params, salt=salt))

    def _follow(self, rid: str, tracked: Tracked) -> None:
        self.live[rid] = tracked
        self.streams.setdefault(tracked.salt, []).append(tracked)

    def _prompt(self) -> st.SearchStrategy[list[int]]:
        fresh = st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=MAX_PROMPT)
        if not self.prompts:
            return fresh
        earlier = st.sampled_from(self.prompts).flatmap(
            lambda p: st.tuples(st.integers(len(p) // 2 + 1, len(p)), st.lists(st.integers(2, VOCAB - 1), max_size=6))
            .map(lambda cut_tail: (p[: cut_tail[0]] + cut_tail[1])[:MAX_PROMPT]))
        return st.one_of(fresh, earlier, earlier)

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        for _ in range(n):
            self._step()

    @precondition(lambda self: self.ids > 0)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """Aborts a request by its number, a no-op once it finished: what is still live depends
        on background copies' timing, which draws must not (hypothesis replays them)."""
        rid = f"r{data.draw(st.integers(0, self.ids - 1), label='abort')}"
        if rid not in self.live:
            assert self.engine.abort(rid) is None, "a finished request is still known"
            return
        out = self.engine.abort(rid)
        assert out is not None and out.finished and out.finish_reason is FinishReason.ABORT
        tracked = self.live.pop(rid)
        assert out.completion_tokens == len(tracked.tokens)
        assert self.engine.abort(rid) is None, "an aborted request is still known"

    @rule(data=st.data())
    def add_prefill(self, data: st.DataObject) -> None:
        """A prefill node's request: greedy, one token, its prompt's KV read by a handoff that
        stays busy after the request ended until ``end_handoff`` (or running to idle) ends it."""
        prompt = data.draw(self._prompt(), label="prefill prompt")
        params = SamplingParams(max_tokens=1, temperature=0)
        rid = f"r{self.ids}"
        self.ids += 1
        self.senders[rid] = Sender(self._kv_layers())
        self.engine.add_request(rid, prompt, params, handoff=self.senders[rid])
        self.prompts.append(prompt)
        self._follow(rid, Tracked(prompt, params))

    def _kv_layers(self) -> list[torch.Tensor]:
        pools = [self.engine.pool] + ([self.engine.draft_pool] if self.engine.draft_pool is not None else [])
        return [layer for pool in pools for layer in pool.buffer]

    @precondition(lambda self: bool(self.senders))
    @rule(data=st.data())
    def end_handoff(self, data: st.DataObject) -> None:
        """A handoff's transfer ends (by number: whether its request finished depends on timing)."""
        senders = list(self.senders.values())
        sender = senders[data.draw(st.integers(0, 63), label="handoff") % len(senders)]
        if not sender.ended:
            sender.end()

    @rule(data=st.data(), max_new=st.integers(1, 4))
    def reserve(self, data: st.DataObject, max_new: int) -> None:
        """A decode node's reservation for a prompt another node computes. Its pages hold no real
        KV, so it has a salt of its own (no checked request reuses them) and unchecked outputs."""
        prompt = data.draw(self._prompt(), label="reserved prompt")
        rid = f"d{self.reserved}"
        self.reserved += 1
        try:
            self.engine.reserve(rid, prompt, max_new, CacheScope(cache_salt=RESERVED_SALT), TERMS, self.now)
        except CapacityError:
            return
        self.streams.setdefault(RESERVED_SALT, []).append(Tracked(prompt, SamplingParams(), checked=False))

    @precondition(lambda self: self.reserved > 0)
    @rule(data=st.data(), first=st.integers(2, VOCAB - 1))
    def start_reserved(self, data: st.DataObject, first: int) -> None:
        """The prompt arrived: the reservation (by number, a no-op once ended) starts generating."""
        rid = f"d{data.draw(st.integers(0, self.reserved - 1), label='start')}"
        # drawn before looking: whether it is still active depends on the steps' clock, which
        # run_to_idle moves by as many steps as background copies take (hypothesis replays draws)
        params = SamplingParams(max_tokens=data.draw(st.integers(1, MAX_NEW), label="max_tokens"), temperature=0)
        if rid not in self.engine.reservations.active:
            return
        request = self.engine.reservations.active[rid].request
        self._follow(rid, Tracked(request.prompt_ids, params, checked=False, salt=RESERVED_SALT))
        self._record(self.engine.start_reserved(rid, first, params))

    @precondition(lambda self: self.reserved > 0)
    @rule(data=st.data(), writer_stopped=st.booleans())
    def cancel_reservation(self, data: st.DataObject, writer_stopped: bool) -> None:
        rid = f"d{data.draw(st.integers(0, self.reserved - 1), label='cancel')}"
        known = rid in self.engine.reservations.active
        assert self.engine.cancel_reservation(rid, writer_stopped, self.now) == known

    @rule(seconds=st.sampled_from([1.0, 3.0, 10.0]))
    def wait(self, seconds: float) -> None:
        """Time passes: leases expire and quarantined pages come back at the next step."""
        self.now += seconds

    @rule(to_host=st.booleans())
    def fail_next_copy(self, to_host: bool) -> None:
        """The next background L1 -> L2 write (``to_host``) or L2 -> L1 load fails: requests
        lent the load fail alone, a write's node stays L1-only; no page may leak either way."""
        self.faults.copies.add(to_host)

    @rule(down=st.booleans())
    def l3_outage(self, down: bool) -> None:
        """L3 becomes unreachable or reachable again: the breaker opens on the first failure and
        the cache serves from L1 + L2; no request may fail or change its output for it."""
        self.faults.l3_down = down

    @rule(data=st.data(), corrupt=st.booleans())
    def damage_l3_object(self, data: st.DataObject, corrupt: bool) -> None:
        """One L3 object (by number: which exist depends on background timing) gets 64 bytes
        overwritten, which its trailer's check must catch, or is lost; a prefetch may be reading it
        meanwhile."""
        i = data.draw(st.integers(0, 63), label="object")
        objects = sorted(self.l3.glob("*.kv"))
        if not objects:
            return
        path = objects[i % len(objects)]
        try:
            if not corrupt:
                path.unlink()
                return
            with open(path, "r+b") as f:  # 16 floats of ~3e38: outputs change if it is ever used
                f.seek(path.stat().st_size // 3 // 4 * 4)
                f.write(b"\x7f" * 64)
        except FileNotFoundError:  # a read's integrity check deleted it first
            return

    @precondition(lambda self: bool(self.prompts))
    @rule(data=st.data())
    def ask_again_from_l3(self, data: st.DataObject) -> None:
        """An earlier prompt again once its backups landed and L1 and L2 were dropped: what it
        finds cached comes from L3, through whatever the L3 rules did to it."""
        prompt = data.draw(st.sampled_from(self.prompts), label="earlier prompt")
        params = SamplingParams(max_tokens=data.draw(st.integers(1, MAX_NEW), label="max_tokens"), temperature=0)
        self.engine.cache.wait_background()
        self.engine.cache.flush(True, True)
        rid = f"r{self.ids}"
        self.ids += 1
        self.engine.add_request(rid, prompt, params)
        self._follow(rid, Tracked(prompt, params))

    @rule(device=st.booleans(), host=st.booleans())
    def flush(self, device: bool, host: bool) -> None:
        self.engine.cache.flush(device, host)

    @rule(flush_after=st.booleans())
    def run_to_idle(self, flush_after: bool) -> None:
        deadline = time.monotonic() + IDLE_DEADLINE_S
        while self.engine.has_work() and time.monotonic() < deadline:
            self.now += 1.0  # time passes: leases held while others wait for room expire
            self._step()
            for rid in [r for r, s in self.senders.items() if r not in self.live and not s.ended]:
                self.senders[rid].end()  # its request ended: the transfer ends too
            if not self.engine.last_batch_size:
                time.sleep(0.001)  # only background copies left: let their threads run
        assert not self.engine.has_work(), f"the engine did not go idle: {self._work()}"
        assert not self.live, f"requests never finished: {sorted(self.live)}"
        assert not self.engine.requests and not self.engine.scheduler.running and not self.engine.scheduler.waiting
        assert not self.engine.reservations, "a reservation or quarantine outlived its lease and grace"
        self._check_idle_tree()
        self._check_finished()
        if flush_after:
            self._check_flush_frees_everything()

    # -- helpers ---------------------------------------------------------------------------------

    def _step(self) -> None:
        for out in self.engine.step(self.now):
            self._record(out)
        for rid, exc in self.engine.take_failures():
            assert isinstance(exc, HostLoadError), f"{rid} failed with {exc!r}"
            self.live.pop(rid)
            self.failed += 1

    def _record(self, out: RequestOutput) -> None:
        tracked = self.live[out.request_id]
        tracked.tokens += out.new_token_ids
        tracked.logprobs += len(out.logprobs or [])
        assert out.completion_tokens == len(tracked.tokens)
        if out.finished:
            assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            tracked.reason = out.finish_reason
            self.done[out.request_id] = self.live.pop(out.request_id)

    def _work(self) -> str:
        sched, cache = self.engine.scheduler, self.engine.cache
        return (f"running {[(r.request_id, r.num_computed, r.num_tokens) for r in sched.running]} "
                f"waiting {[(r.request_id, r.num_computed, r.prefetch) for r in sched.waiting]} "
                f"writes {len(cache._writes)} storage busy {cache.storage.busy} free {self.engine.allocator.num_free}")

    def _check_idle_tree(self) -> None:
        cache = self.engine.cache
        for node in cache.tree.nodes():
            assert node.lock == 0, "an idle engine's tree still has a pinned node"
        assert not cache.loads.num_orphans, "an idle engine holds orphaned load pages"
        assert self.engine.stats()["kv_pages_used"] == 0

    def _check_finished(self) -> None:
        for rid, t in self.done.items():
            p = t.params
            assert t.reason is not None and 1 <= len(t.tokens) <= p.max_tokens, rid
            assert t.logprobs == (len(t.tokens) if p.logprobs is not None else 0), rid
            if t.reason is FinishReason.LENGTH:
                assert len(t.tokens) == p.max_tokens, rid
            elif len(t.tokens) < p.min_tokens:
                raise AssertionError(f"{rid} stopped after {len(t.tokens)} < min_tokens {p.min_tokens}")
            # rejection sampling draws other random numbers than plain sampling: only greedy is lossless token for token
            if t.checked and (p.greedy or (p.seed is not None and not self.speculative)):
                assert (t.tokens, t.reason) == alone(t.prompt, p), f"{rid} differs from running alone"
        self.done.clear()

    def _check_flush_frees_everything(self) -> None:
        cache = self.engine.cache
        cache.flush(True, True)
        assert self.engine.allocator.num_used == 0, f"{self.engine.allocator.num_used} L1 pages survive a flush"
        assert cache.host.allocator.num_used == 0, f"{cache.host.allocator.num_used} L2 pages survive a flush"

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def device_pages_have_one_owner(self) -> None:
        if self.engine is not None:
            assert_device_pages_owned(self.engine)

    @invariant()
    def salts_stay_apart(self) -> None:
        if self.engine is not None:
            assert_paths_computed(self.engine.cache.tree, self.streams)

    @invariant()
    def loads_are_tracked(self) -> None:
        if self.engine is not None:
            assert_loads_tracked(self.engine.cache)

    @invariant()
    def host_pages_have_one_owner(self) -> None:
        if self.engine is not None:
            assert_host_pages_owned(self.engine.cache)


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine = pytest.mark.slow(TestEngineMachine)
# ~15-20 s on 2 cores (examples are short: most stop well before 40 steps); hunting: raise max_examples
TestEngineMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
