"""Admission by predicted TTFT in the HTTP layer (``api/admission.py``), in process: the lane's
rate and prediction on a fake clock, the deadline's sources (header, API key default) and the 429
with Retry-After, ``--admission fcfs``, and the shed / late / on-time counters. The router's
end-to-end behaviour is ``tests/test_priority_router.py``."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers.clock import ManualClock
from helpers.idle_backend import IdleBackend
from helpers.metrics import value

from tierserve.api import openai as oa
from tierserve.api.admission import (
    DEMAND_WINDOW_S,
    MAX_RETRY_AFTER_S,
    AdmissionPolicy,
    Lane,
    check_deadline,
    parse_deadline,
)
from tierserve.api.app import create_app
from tierserve.api.engine_backend import create_engine_app
from tierserve.api.metrics import ApiMetrics
from tierserve.api.tenants import TenantKeys
from tierserve.core.outputs import FinishReason, RequestOutput
from tierserve.core.sampling import SamplingParams
from tierserve.core.scope import CacheScope
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.loop import EngineLoop

# a scripted backend in place of an engine, but for the last test (a real tiny engine)


def test_a_lane_measures_the_rate_between_first_tokens_and_counts_only_work_as_important() -> None:
    clock = ManualClock()
    lane = Lane(clock)
    assert lane.predict(0, 100) is None  # not measured yet
    lane.sent("a", 0, 100)
    lane.sent("b", 5, 300)
    clock.now = 1.0
    lane.first_token("a")  # 100 tokens in 1 s
    assert lane.rate == pytest.approx(100)
    clock.now = 4.0
    lane.first_token("b", computed=200)  # the node found 100 cached: 200 in 3 s
    assert lane.rate == pytest.approx((100 * 0.9 + 200) / (1 * 0.9 + 3))
    rate = lane.rate
    lane.sent("low", 5, 1000)
    lane.sent("high", 0, 50)
    assert lane.predict(0, 10) == pytest.approx((50 + 10) / rate)  # the low request is not ahead of a high one
    high_demand = (100 + 50) / DEMAND_WINDOW_S  # tokens/s of priority 0 sent in the window: they keep going first
    assert lane.predict(5, 10) == pytest.approx((1050 + 10) / (rate - high_demand))
    lane.dropped("low")
    assert lane.predict(5, 10) == pytest.approx((50 + 10) / (rate - high_demand)) and lane.rate == rate
    clock.now += DEMAND_WINDOW_S + 1
    lane.sent("flood", 0, int(rate * DEMAND_WINDOW_S) + 1)  # more important work alone takes the whole rate
    assert lane.predict(5, 10) == math.inf and lane.predict(0, 10) < math.inf


def test_a_lane_counts_the_nodes_reported_backlog_corrected_by_its_own_sends_and_first_tokens_since() -> None:
    """Another router's work on the node is in its report: it is ahead of this router's requests too."""
    clock = ManualClock()
    lane = Lane(clock)
    lane.sent("m", 0, 100)
    clock.now = 1.0
    lane.first_token("m")  # 100 tokens/s
    lane.sent("own", 0, 50)
    assert lane.predict(0, 10) == pytest.approx((50 + 10) / 100)  # no report: its own work only
    report = object()
    lane.observe(report, {0: 400, 5: 1000})  # counts "own" and 350 tokens of another router's, and low work
    assert lane.work_ahead(0) == 400 and lane.work_ahead(5) == 1400
    assert lane.predict(0, 10) == pytest.approx((400 + 10) / 100)
    lane.sent("later", 0, 30)  # sent after the report: not in it
    assert lane.work_ahead(0) == 430
    clock.now = 2.0
    lane.first_token("own")  # the report still counts it
    lane.first_token("later")  # the report never counted it
    assert lane.work_ahead(0) == 350
    lane.observe(report, {0: 400})  # the same report again: no change
    assert lane.work_ahead(0) == 350
    lane.sent("mine", 0, 500)
    lane.observe(object(), {0: 20})  # a newer report that does not count it yet: never less than its own
    assert lane.work_ahead(0) == 500
    lane.observe(None, None)  # the session broke: its own work only
    assert lane.work_ahead(5) == 500


def test_deadline_sources_and_the_429() -> None:
    assert parse_deadline(None, None) is None and parse_deadline(None, 500) == 500
    assert parse_deadline(" 250 ", 500) == 250
    for bad in ("-1", "0", "1.5", "x", "", str(2**32)):
        with pytest.raises(oa.APIError) as exc:
            parse_deadline(bad, None)
        assert exc.value.status == 400 and exc.value.param == "x-request-deadline-ms"
    check_deadline(None, 1)  # no prediction: admitted
    check_deadline(0.5, None)  # no deadline: admitted
    check_deadline(0.5, 500)
    with pytest.raises(oa.APIError) as exc:
        check_deadline(math.inf, 1000)
    assert exc.value.headers["Retry-After"] == str(MAX_RETRY_AFTER_S)
    with pytest.raises(oa.APIError) as exc:
        check_deadline(3.2, 1000)
    assert exc.value.status == 429 and exc.value.code == "deadline" and exc.value.headers["Retry-After"] == "3"


class PredictingBackend(IdleBackend):
    """Predicts ``predicted`` seconds for every request; records the params it ran; a first token
    after ``delay_s``."""

    max_model_len = 64

    def __init__(self, predicted: float | None, delay_s: float = 0.0) -> None:
        self.predicted, self.delay_s = predicted, delay_s
        self.ran: list[SamplingParams] = []
        self.asked: list[int] = []

    def predict_ttft(self, prompt_ids: list[int], params: SamplingParams, scope: CacheScope) -> float | None:
        self.asked.append(params.priority)
        return self.predicted

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, scope: CacheScope,
                       *, buffered: bool = False, sibling: object = None) -> AsyncIterator[RequestOutput]:
        self.ran.append(params)
        await asyncio.sleep(self.delay_s)
        yield RequestOutput(request_id, [7], "x", True, FinishReason.LENGTH, len(prompt_ids), 1)


async def _post(backend: PredictingBackend, headers: dict, body: dict,
                admission: AdmissionPolicy = AdmissionPolicy.TTFT, keys: TenantKeys | None = None,
                ) -> tuple[httpx.Response, str]:
    app = create_app(backend, None, "m", ApiMetrics(), keys, admission=admission)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        reply = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1, **body},
                                  headers=headers)
        return reply, (await client.get("/metrics")).text


def test_a_deadline_the_prediction_misses_is_shed_before_the_backend_runs_it() -> None:
    backend = PredictingBackend(predicted=2.5)
    reply, metrics = asyncio.run(_post(backend, {"x-request-deadline-ms": "1000"}, {"priority": 4}))
    assert reply.status_code == 429 and reply.headers["retry-after"] == "2"
    assert reply.json()["error"] == {"message": reply.json()["error"]["message"], "type": "rate_limit_error",
                                     "param": None, "code": "deadline"}
    assert backend.ran == [] and backend.asked == [4]
    assert value(metrics, "tierserve_requests_shed_total", reason="deadline", priority="4") == 1


def test_a_met_deadline_runs_with_its_priority_and_deadline_and_counts_on_time() -> None:
    backend = PredictingBackend(predicted=0.2)
    reply, metrics = asyncio.run(_post(backend, {"x-request-deadline-ms": "1000"}, {"priority": -3}))
    assert reply.status_code == 200
    assert [(p.priority, p.deadline_ms) for p in backend.ran] == [(-3, 1000)]
    assert value(metrics, "tierserve_requests_on_time_total", priority="-3") == 1
    assert value(metrics, "tierserve_requests_late_total", priority="-3") == 0


def test_fcfs_admission_runs_it_anyway_and_counts_it_late() -> None:
    backend = PredictingBackend(predicted=9.0, delay_s=0.05)
    reply, metrics = asyncio.run(_post(backend, {"x-request-deadline-ms": "10"}, {}, AdmissionPolicy.FCFS))
    assert reply.status_code == 200 and backend.asked == []
    assert value(metrics, "tierserve_requests_late_total", priority="0") == 1


def test_an_api_keys_deadline_applies_unless_the_header_gives_one(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": {"k1": {"tenant": "acme", "deadline_ms": 700}}}))
    keys = TenantKeys.load(path)
    auth = {"Authorization": "Bearer k1"}
    backend = PredictingBackend(predicted=0.01)
    asyncio.run(_post(backend, auth, {}, keys=keys))
    asyncio.run(_post(backend, auth | {"x-request-deadline-ms": "50"}, {}, keys=keys))
    assert [p.deadline_ms for p in backend.ran] == [700, 50]
    path.write_text(json.dumps({"keys": {"k1": {"tenant": "acme", "deadline_ms": 0}}}))
    with pytest.raises(ValueError, match="not an API key file"):
        TenantKeys.load(path)


def test_no_deadline_asks_no_prediction() -> None:
    backend = PredictingBackend(predicted=100.0)
    reply, _ = asyncio.run(_post(backend, {}, {"priority": 1}))
    assert reply.status_code == 200 and backend.asked == [] and backend.ran[0].deadline_ms is None


def test_serve_predicts_from_its_engines_measured_rate_and_sheds_an_impossible_deadline(tiny_llama: Path) -> None:
    """``serve``'s API over a real engine: the first request measures the engine's rate, then a
    1 ms deadline on a 300-token prompt is answered 429 at once and never reaches the engine."""
    engine = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=16, max_total_tokens=1024))
    loop = EngineLoop(engine).start()
    try:
        with TestClient(create_engine_app(loop, None, "tiny")) as client:
            body = {"prompt": list(range(2, 302)), "max_tokens": 2, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
            computed = engine.prefill_tokens_computed
            shed = client.post("/v1/completions", json=body | {"prompt": list(range(3, 303))},
                               headers={"x-request-deadline-ms": "1"})
            ok = client.post("/v1/completions", json=body, headers={"x-request-deadline-ms": "600000"})
            metrics = client.get("/metrics").text
    finally:
        loop.stop()
    assert shed.status_code == 429 and shed.json()["error"]["code"] == "deadline"
    assert ok.status_code == 200 and engine.prefill_tokens_computed == computed + 300 % 16  # its partial page
    assert value(metrics, "tierserve_requests_shed_total", reason="deadline", priority="0") == 1
    assert value(metrics, "tierserve_requests_on_time_total", priority="0") == 1
