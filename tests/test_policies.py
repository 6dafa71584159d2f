"""The router's ``random`` and ``power_of_two`` policies (``src/tierserve/router/policies.py``):
what each picks, over many seeded picks; the load they balance on is the nodes' own once their
sessions report it (every router's requests); every ``PolicyKind`` names its policy; and a
decode node's CP size in the router's choice (``PDBackend._pick``: the pages its ranks hold
together, the threshold of its own prefills)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from helpers.clock import ManualClock

from tierserve.api.admission import Lane
from tierserve.core.scope import NO_SCOPE
from tierserve.proto import tierserve_pb2 as pb
from tierserve.router.backend import PDBackend, RouterOptions, _Request
from tierserve.router.disaggregation import Disaggregation, ServedPath
from tierserve.router.policies import (
    CacheAware,
    CachedPrefix,
    PolicyKind,
    PowerOfTwo,
    Random,
    RoundRobin,
    make_policy,
)
from tierserve.router.registry import Registry, Worker, WorkerState
from tierserve.router.roles import Role

PICKS = 900
PAGE = 16


def _workers(*loads: int) -> list[Worker]:
    return [Worker(Role.PREFILL, f"10.0.0.{i}:1", channel=None, state=WorkerState.HEALTHY, load=load)
            for i, load in enumerate(loads)]


def _nothing_cached(worker: Worker) -> CachedPrefix:
    return CachedPrefix()


def _counts(policy, workers: list[Worker]) -> list[int]:
    picks = Counter(policy.pick(workers, _nothing_cached).address for _ in range(PICKS))
    return [picks[w.address] for w in workers]


def test_random_spreads_evenly_whatever_the_load() -> None:
    workers = _workers(0, 50, 100)
    counts = _counts(Random(random.Random(1)), workers)
    assert sum(counts) == PICKS and all(250 <= c <= 350 for c in counts), counts  # 300 each expected
    assert _counts(Random(random.Random(1)), workers) == counts, "seeded: the same picks"
    assert Random(random.Random(2)).pick(workers[1:2], _nothing_cached) is workers[1]


def test_power_of_two_takes_the_less_loaded_of_two_random_workers() -> None:
    assert _counts(PowerOfTwo(random.Random(3)), _workers(0, 5)) == [PICKS, 0], "of two, always the lighter"
    light, middle, heavy = _counts(PowerOfTwo(random.Random(4)), _workers(0, 5, 10))
    assert heavy == 0, "the most loaded never wins a pair"
    assert 540 <= light <= 660 and light + middle == PICKS, (light, middle)  # 2/3 of the pairs hold the lightest
    even = _counts(PowerOfTwo(random.Random(5)), _workers(2, 2, 2))
    assert all(250 <= c <= 350 for c in even), even  # equal loads: no herding onto one worker
    assert PowerOfTwo(random.Random(6)).pick(_workers(7), _nothing_cached).address == "10.0.0.0:1"


def test_policies_balance_on_what_the_nodes_report_not_on_this_routers_own_requests() -> None:
    """Two routers: this one sent nothing to worker 0, but the node reports another router's 6
    requests there (running, waiting, reserved), so both policies send this router's work to worker 1."""
    workers = _workers(0, 2)
    workers[0].reported(pb.LoadReport(running=3, waiting=1, reservations=2))
    workers[1].reported(pb.LoadReport(running=2))
    assert [w.pressure for w in workers] == [6, 2]
    assert _counts(PowerOfTwo(random.Random(7)), workers) == [0, PICKS]
    assert CacheAware().pick(workers, _nothing_cached) is workers[1]
    workers[1].begin()  # sent since the last report: not in it yet, so counted on top
    workers[1].begin()
    assert workers[1].pressure == 4
    workers[1].reported(None)  # the session broke: back to this router's own count
    assert workers[1].pressure == workers[1].load == 4


def test_a_stale_report_does_not_count_this_routers_ended_requests() -> None:
    """The node reports a change up to 50 ms late: this router's requests that ended since its
    last report leave the pressure at once (a stale count sent a conversation's next turn to the
    node without its prefix), and the pressure never falls below this router's own count."""
    holder, other = _workers(0, 0)
    for _ in range(3):
        holder.begin()
    holder.reported(pb.LoadReport(running=3))  # then all three end before the next report
    for _ in range(3):
        holder.end()
    other.reported(pb.LoadReport())
    assert (holder.pressure, other.pressure) == (0, 0)
    cached = {holder: CachedPrefix(device=3, host=0), other: CachedPrefix(device=0, host=0)}
    assert CacheAware().pick([holder, other], lambda w: cached[w]) is holder
    other.begin()
    other.reported(pb.LoadReport())  # a report that does not count it yet (a PD request past its prefill)
    assert other.pressure == other.load == 1


@pytest.mark.parametrize("kind, cls", [(PolicyKind.ROUND_ROBIN, RoundRobin), (PolicyKind.RANDOM, Random),
                                       (PolicyKind.POWER_OF_TWO, PowerOfTwo), (PolicyKind.CACHE_AWARE, CacheAware)])
def test_each_kind_makes_its_policy(kind: PolicyKind, cls: type) -> None:
    assert type(make_policy(kind)) is cls


THRESHOLD_24 = RouterOptions(disaggregation_threshold=24)


def _cp_cluster(decode_cp: tuple[int, ...], capacity_per_rank: int, options: RouterOptions = THRESHOLD_24
                ) -> PDBackend:
    """A router's backend over one prefill worker and decode workers of the given CP sizes, each
    rank's pool holding ``capacity_per_rank`` tokens (no node runs: the workers' ``Info`` is set)."""
    registry = Registry()
    registry.info = pb.NodeInfo(identity=pb.KVIdentity(page_size=PAGE))
    nodes = [(Role.PREFILL, 1), *((Role.DECODE, cp) for cp in decode_cp)]
    for i, (role, cp) in enumerate(nodes):
        info = pb.NodeInfo(role=pb.ROLE_DECODE, cp_size=cp, kv_capacity_tokens=cp * capacity_per_rank)
        registry.workers[(role, f"10.0.1.{i}:1")] = Worker(role, f"10.0.1.{i}:1", channel=None,
                                                           state=WorkerState.HEALTHY, info=info)
    return PDBackend(registry, CacheAware(), CacheAware(), options, 1 << 20, lookup=lambda tokens, salt: _held)


def _held(worker: Worker) -> CachedPrefix:
    """Every decode worker holds the same 60 leading pages of the prompts below (``CacheAware``'s
    tie goes to the higher address)."""
    return CachedPrefix(device=60) if worker.role is Role.DECODE else CachedPrefix()


def _route(backend: PDBackend, prompt_tokens: int, max_tokens: int = 8, resumed: int = 0) -> dict[str, object]:
    request = _Request("r", list(range(prompt_tokens)), pb.SamplingOptions(max_tokens=max_tokens), NO_SCOPE, False,
                       resumed=resumed)
    backend._pick(request)
    return backend.routes[-1]


def test_a_long_request_goes_to_the_decode_node_whose_cp_ranks_hold_it() -> None:
    """A prompt that fits a CP=2 decode node's pages (both ranks' pools) but not a CP=1 node's goes
    to the CP=2 node, whatever the policy preferred (here the CP=1 node: equal loads and prefixes,
    the higher address); one that fits both still goes by the policy; one that fits none goes by the
    policy too (that node refuses it with its reason). Before, the CP=1 node took it and refused it (a 400)."""
    backend = _cp_cluster((2, 1), capacity_per_rank=1024)
    cp2, cp1 = "10.0.1.1:1", "10.0.1.2:1"
    assert _route(backend, 1500)["decode"] == cp2
    assert _route(backend, 1000)["decode"] == cp1
    assert _route(backend, 4000)["decode"] == cp1
    assert [w.fits(2048) for w in backend.registry.available(Role.DECODE)] == [True, False]
    assert Worker(Role.DECODE, "x", channel=None).fits(1 << 30), "a node that sent no capacity: unknown, not refused"


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_a_cp_decode_node_prefills_cp_times_the_threshold_itself(cp: int) -> None:
    """The decode node holds 60 of the prompt's pages; the uncached rest is computed on it while
    under ``threshold x cp`` tokens (its CP ranks divide that prefill's work), else by a prefill node."""
    backend = _cp_cluster((cp,), capacity_per_rank=1 << 16)
    held = 60 * PAGE
    assert _route(backend, held + 24 * cp - 1)["path"] == ServedPath.DECODE_ONLY.value
    assert _route(backend, held + 24 * cp)["path"] == ServedPath.PREFILL_DECODE.value
    assert Disaggregation(24).limit(cp) == 24 * cp and Disaggregation(0).limit(cp) == 0


def test_a_migrated_request_never_spills_to_its_decode_node() -> None:
    """With the prefill node backed up (``--disaggregation-spill-priority 0``) a fresh request is
    prefilled on the decode node; a migrated one still goes through the prefill node, since only the
    PD path's ``Generate`` carries the text it continues (``resumed_tokens``)."""
    backend = _cp_cluster((1,), 1 << 16, RouterOptions(disaggregation_threshold=24, disaggregation_spill_priority=0))
    clock = ManualClock()
    lane = backend.ttft.lanes["10.0.1.0:1"] = Lane(clock)  # the prefill node: 100 tokens/s, 10,000 ahead
    lane.sent("measure", 0, 100)
    clock.now = 1.0
    lane.first_token("measure")
    lane.sent("ahead", 0, 10_000)
    prompt = 60 * PAGE + 200  # the decode node holds 60 pages: 200 tokens to compute there
    assert _route(backend, prompt)["path"] == ServedPath.DECODE_ONLY.value and backend.spilled == 1
    assert _route(backend, prompt, resumed=4)["path"] == ServedPath.PREFILL_DECODE.value and backend.spilled == 1
