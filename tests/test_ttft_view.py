"""The router's TTFT prediction over its workers (``router/ttft.py``), in process: a prompt whose
pages the cluster's L3 holds (and no worker's L1 or L2) is predicted at the L3 read rate the node
reports, so sooner than a cold prompt of the same length; with no measured L3 rate they count as
computed. The lanes' own arithmetic is ``tests/test_admission.py``."""

from __future__ import annotations

import pytest
from helpers.clock import ManualClock

from tierserve.api.admission import Lane
from tierserve.proto import tierserve_pb2 as pb
from tierserve.router.disaggregation import Disaggregation
from tierserve.router.policies import CachedPrefix
from tierserve.router.registry import Registry, Worker, WorkerState
from tierserve.router.roles import Role
from tierserve.router.ttft import TTFTView

PAGE, RATE, L3_RATE = 16, 100.0, 1000.0
WARM, COLD = list(range(1, 161)), list(range(1001, 1161))  # 10 pages each; WARM's are in L3


def _view(l3_rate: float) -> TTFTView:
    registry = Registry()
    registry.info = pb.NodeInfo(identity=pb.KVIdentity(page_size=PAGE))
    worker = Worker(Role.PREFILL, "10.0.0.1:1", channel=None, state=WorkerState.HEALTHY)
    worker.reported(pb.LoadReport(l3_read_tokens_per_second=l3_rate))
    registry.workers[(Role.PREFILL, worker.address)] = worker
    view = TTFTView(registry, lambda prompt, salt: lambda w: CachedPrefix(), Disaggregation(0),
                    lambda prompt, salt: lambda held: 10 - held if prompt == WARM else 0)
    clock = ManualClock()
    lane = view.lanes[worker.address] = Lane(clock)
    lane.sent("measure", 0, 100)
    clock.now = 1.0
    lane.first_token("measure")  # RATE tokens/s
    return view


def test_a_prompt_in_l3_only_is_predicted_sooner_than_a_cold_one_of_the_same_length() -> None:
    view = _view(L3_RATE)
    cold, warm = view.predict(COLD, 0, ""), view.predict(WARM, 0, "")
    assert cold == pytest.approx(160 / RATE)
    # all but the last token's page loaded (the last token is always computed): 159 at the L3 rate, 1 computed
    assert warm == pytest.approx(159 / L3_RATE + 1 / RATE) and warm < cold


def test_l3_pages_count_as_computed_until_the_node_measured_a_read() -> None:
    view = _view(0.0)
    assert view.predict(WARM, 0, "") == pytest.approx(view.predict(COLD, 0, "")) == pytest.approx(160 / RATE)


def _pair(spill_priority: int | None = 0) -> tuple[TTFTView, Worker, Worker, ManualClock]:
    """A measured prefill node (``RATE``) and an unmeasured decode node, nothing cached anywhere."""
    registry = Registry()
    registry.info = pb.NodeInfo(identity=pb.KVIdentity(page_size=PAGE))
    prefill = Worker(Role.PREFILL, "10.0.0.1:1", channel=None, state=WorkerState.HEALTHY)
    decode = Worker(Role.DECODE, "10.0.0.2:1", channel=None, state=WorkerState.HEALTHY)
    for worker in (prefill, decode):
        registry.workers[(worker.role, worker.address)] = worker
    view = TTFTView(registry, lambda prompt, salt: lambda w: CachedPrefix(), Disaggregation(0, spill_priority))
    clock = ManualClock()
    view.lanes[prefill.address], view.lanes[decode.address] = Lane(clock), Lane(clock)
    view.lanes[prefill.address].sent("measure", 0, 100)
    clock.now = 1.0
    view.lanes[prefill.address].first_token("measure")
    return view, prefill, decode, clock


def test_a_prompt_spills_to_the_decode_node_only_behind_as_important_work_on_the_prefill_node() -> None:
    view, prefill, decode, _ = _pair()
    assert not view.spills(decode, prefill, COLD, 0, "")  # nothing ahead: the prefill node is as soon
    view.lanes[prefill.address].sent("less-important", 5, 1000)
    assert not view.spills(decode, prefill, COLD, 0, "")  # priority 0 goes first there: still as soon
    assert view.spills(decode, prefill, COLD, 5, "")  # but priority 5 waits behind it (decode: prefill's rate)
    view.lanes[prefill.address].sent("important", 0, 160)  # the prompt's own length: predicted 2x the decode node's
    assert view.spills(decode, prefill, COLD, 0, "")
    view.lanes[prefill.address].first_token("important")
    view.lanes[prefill.address].sent("shorter", 0, 40)  # 1.25x: within the margin
    assert not view.spills(decode, prefill, COLD, 0, "")


def test_a_decode_node_computing_as_important_a_prompt_takes_no_more() -> None:
    view, prefill, decode, _ = _pair()
    view.lanes[prefill.address].sent("ahead", 0, 1000)
    view.lanes[decode.address].sent("less-important", 5, 100)
    assert view.spills(decode, prefill, COLD, 0, "")
    view.lanes[decode.address].sent("spilled", 0, 160)
    assert not view.spills(decode, prefill, COLD, 0, "")


def test_the_decode_nodes_own_rate_decides_once_measured() -> None:
    view, prefill, decode, clock = _pair()
    view.lanes[prefill.address].sent("ahead", 0, 160)  # 2x the prompt at the prefill node's rate
    assert view.spills(decode, prefill, COLD, 0, "")
    lane = view.lanes[decode.address]
    lane.sent("measure", 0, 100)
    clock.now = 3.0
    lane.first_token("measure")  # 50 tokens/s: the prompt takes it 3.2 s, the prefill node 3.2 s
    assert not view.spills(decode, prefill, COLD, 0, "")


def test_an_unmeasured_prefill_node_sends_nothing_to_the_decode_node() -> None:
    view, prefill, decode, _ = _pair()
    view.lanes[prefill.address] = Lane(ManualClock())
    view.lanes[prefill.address].sent("ahead", 0, 10_000)
    assert not view.spills(decode, prefill, COLD, 0, "")


@pytest.mark.parametrize(("spill_priority", "priority", "spilled"), [(0, 0, True), (None, 0, False), (0, 5, False)])
def test_admission_predicts_the_decode_node_a_prompt_would_spill_to(spill_priority: int | None, priority: int,
                                                                     spilled: bool) -> None:
    """The deadline check (``predict``) agrees with the routing (``spills``): a prompt that would spill is
    predicted at the decode node's prefill of it, not behind the prefill node's backlog."""
    views = [_pair(spill_priority)[:2], _pair(None)[:2]]
    for view, prefill in views:
        view.lanes[prefill.address].sent("ahead", 0, 2000)
    remote = views[1][0].predict(COLD, priority, "")
    assert remote >= (2000 + 160) / RATE
    assert views[0][0].predict(COLD, priority, "") == pytest.approx(160 / RATE if spilled else remote)
