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
