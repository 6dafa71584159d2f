"""Unit tests of tierserve.bench's client, runner, report and compare, with a stand-in OpenAI
server on httpx's in-process transport (no network): SSE parsing, usage by tier, errors counted,
the concurrency cap, round barriers, JSON round trips and the CLI's compare."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from tierserve.bench.classes import RequestClass
from tierserve.bench.compare import compare, metric_rows
from tierserve.bench.records import TIERS, RequestRecord
from tierserve.bench.report import Report, percentile
from tierserve.bench.runner import BenchOptions, run_bench_async
from tierserve.bench.tokens import TokenSpace
from tierserve.bench.workloads import MultiTurnConfig, SharedPrefixConfig, multiturn, shared_prefix
from tierserve.cli.main import main

pytestmark = pytest.mark.fakes  # a stand-in OpenAI server answers the client

SPACE = TokenSpace(384, 32)


class FakeServer:
    """Streams one text chunk per token; a prompt's cached tokens are its longest prefix seen before
    (whole 16-token pages), reported half on device and half on host. ``delay_s`` (seconds, or a
    function of the body) passes before each token; ``fail_every`` answers every n-th request with a 429."""

    def __init__(self, delay_s: float | Callable[[dict], float] = 0.002, fail_every: int = 0,
                 shed: Callable[[dict], bool] | None = None) -> None:
        self.delay_s, self.fail_every, self.shed = delay_s, fail_every, shed
        self.bodies: list[dict] = []
        self.deadlines: list[str | None] = []  # each request's x-request-deadline-ms
        self.in_flight = self.max_in_flight = 0
        self.seen: list[list[int]] = []

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake"}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        self.deadlines.append(request.headers.get("x-request-deadline-ms"))
        if self.shed is not None and self.shed(body):
            return httpx.Response(429, json={"error": {"message": "deadline", "code": "deadline"}})
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return httpx.Response(429, json={"error": {"message": "overloaded"}})
        return httpx.Response(200, content=self.events(body))

    async def events(self, body: dict) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            prompt = body["prompt"]
            cached = max([_common(prompt, p) for p in self.seen] + [0]) // 16 * 16
            self.seen.append(prompt)
            for i in range(body["max_tokens"]):
                await asyncio.sleep(self.delay_s(body) if callable(self.delay_s) else self.delay_s)
                reason = "length" if i == body["max_tokens"] - 1 else None
                yield _sse({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": reason}]})
            usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                     "prompt_tokens_details": {"cached_tokens": cached},
                     "cached_tokens_by_tier": {"device": cached // 2, "host": cached - cached // 2, "storage": 0}}
            yield _sse({"choices": [], "usage": usage})
        finally:
            self.in_flight -= 1  # before [DONE]: the client stops reading there and never resumes us
        yield b"data: [DONE]\n\n"


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run(server: FakeServer, workload, options: BenchOptions) -> Report:
    return asyncio.run(run_bench_async("http://fake", workload, options, transport=server.transport()))


def conversations(clients: int = 4, rounds: int = 3) -> object:
    config = MultiTurnConfig(clients=clients, rounds=rounds, context_length=40, question_length=8, output_length=4)
    return multiturn(config, "tokens", SPACE, seed=0)


def test_records_and_summary_are_consistent() -> None:
    server = FakeServer()
    report = run(server, conversations(), BenchOptions(clients=2, progress=False))
    assert server.max_in_flight <= 2 and all(b["stream_options"] == {"include_usage": True} for b in server.bodies)
    assert all(b["model"] == "fake" and b["ignore_eos"] and b["stream"] for b in server.bodies)
    assert len(report.records) == 12 and all(r.ok for r in report.records)
    for r in report.records:
        assert r.prompt_tokens == r.sent_prompt_tokens and r.output_tokens == 4 and len(r.itl) == 3
        assert 0 < r.ttft <= r.e2e and r.sent_at >= r.scheduled_at
        assert sum(r.cached_by_tier.values()) == r.cached_tokens
    s = report.summary()
    assert s["requests"] == {"total": 12, "ok": 12, "failed": 0} and s["errors"] == {}
    assert s["tokens"]["cached"] == sum(s["tokens"][t] for t in TIERS)
    assert s["hit_rate"] == pytest.approx(sum(s["hit_rate_by_tier"].values()))
    assert 0 < s["hit_rate"] < 1 and s["hit_rate_by_round"][0] == 0 and s["hit_rate_by_round"][2] > 0.5
    # The fake caches every prompt it saw, in whole pages: all an unbounded cache would hit here too.
    assert s["ideal_hit_rate"] == pytest.approx(s["hit_rate"]) and s["efficiency"] == pytest.approx(1.0)
    assert s["ttft_s"]["count"] == 12 and s["itl_s"]["count"] == 36
    assert s["ttft_s"]["median"] <= s["ttft_s"]["p90"] <= s["ttft_s"]["p99"]
    assert s["request_throughput"] == pytest.approx(12 / report.duration)
    assert "TTFT" in report.table() and "hit rate" in report.table()


def test_classes_send_priorities_and_deadlines_and_goodput_counts_what_met_its_slo(tmp_path: Path) -> None:
    """Half the sessions are class 0 (a 10 s deadline, met), half class 1 (1 ms: the fake's first
    token takes 2 ms, so late), and of those the server sheds every other one."""
    shed_seen = []

    def shed(body: dict) -> bool:
        shed_seen.append(body.get("priority") == 1 and len(shed_seen) % 2 == 0)
        return shed_seen[-1]

    server = FakeServer(shed=shed)
    workload = shared_prefix(SharedPrefixConfig(4, 5, 32, 8, 3), "tokens", SPACE, seed=0)
    classes = (RequestClass(0, 0.5, 10_000), RequestClass(1, 0.5, 1))
    report = run(server, workload, BenchOptions(clients=4, progress=False, classes=classes))
    sent = {(b["priority"], d) for b, d in zip(server.bodies, server.deadlines, strict=True)}
    assert sent == {(0, "10000"), (1, "1")}
    s = report.summary()
    by = s["by_priority"]
    assert by[0]["good"] == by[0]["requests"] > 0 and by[0]["shed"] == by[0]["late"] == 0
    assert by[1]["good"] == 0 and by[1]["shed"] == sum(shed_seen) > 0
    assert by[1]["late"] == by[1]["requests"] - by[1]["shed"] > 0
    assert s["goodput"]["good"] == by[0]["good"]
    assert s["goodput"]["goodput"] == pytest.approx(by[0]["good"] / report.duration)
    assert "goodput" in report.table() and "priority 1 (deadline 1 ms)" in report.table()
    report.to_json(tmp_path / "r.json")
    assert Report.from_json(tmp_path / "r.json").summary()["goodput"] == s["goodput"]


@pytest.mark.parametrize("text", ["0", "a:0.5", "0:0", "0:0.5:0", "0:0.5:1:2"])
def test_bad_classes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--class"):
        RequestClass.parse(text)


def test_barrier_holds_each_round_until_all_clients_finished_the_last() -> None:
    workload = conversations(clients=5, rounds=3)
    slow_client = workload.sessions[0].first().prompt[:8]

    def delay(body: dict) -> float:  # one slow conversation: the others would race ahead of it
        return 0.03 if body["prompt"][:8] == slow_client else 0.001

    for barrier in (True, False):
        server = FakeServer(delay_s=delay)
        run(server, conversations(clients=5, rounds=3), BenchOptions(clients=5, barrier=barrier, progress=False))
        lengths = [len(b["prompt"]) for b in server.bodies]  # grows with the round
        assert len(lengths) == 15 and (lengths == sorted(lengths)) == barrier


def test_errors_are_counted_and_end_their_session() -> None:
    server = FakeServer(fail_every=4)
    report = run(server, conversations(clients=4, rounds=3), BenchOptions(clients=1, progress=False))
    failed = [r for r in report.records if not r.ok]
    assert failed and all(r.status == 429 and "overloaded" in r.error for r in failed)
    s = report.summary()
    assert s["requests"]["failed"] == len(failed) and sum(s["errors"].values()) == len(failed)
    assert len(report.records) < 12  # a failed round ends its conversation
    assert s["ttft_s"]["count"] == s["requests"]["ok"]


def test_timeouts_and_broken_streams_are_errors() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        async def events() -> AsyncIterator[bytes]:
            yield _sse({"choices": [{"index": 0, "text": "x", "finish_reason": None}]})
            await asyncio.sleep(5)
        return httpx.Response(200, content=events())

    async def cut(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse({"choices": [{"index": 0, "text": "x", "finish_reason": None}]}))

    workload = shared_prefix(SharedPrefixConfig(groups=1, prompts_per_group=2), "tokens", SPACE)
    options = BenchOptions(clients=2, timeout_s=0.2, progress=False, model="m")
    for handler, message in ((slow, "timeout"), (cut, "without data: [DONE]")):
        report = asyncio.run(run_bench_async("http://x/v1", workload, options, httpx.MockTransport(handler)))
        assert [r.ok for r in report.records] == [False, False]
        assert all(message in r.error for r in report.records), report.records[0].error


def test_open_loop_respects_the_concurrency_cap() -> None:
    server = FakeServer(delay_s=0.01)
    workload = shared_prefix(SharedPrefixConfig(groups=2, prompts_per_group=6, output_length=3), "tokens", SPACE)
    report = run(server, workload, BenchOptions(mode="poisson", rate=1000, max_concurrency=3, progress=False))
    assert server.max_in_flight == 3 and len(report.ok) == 12


def test_json_round_trip_and_compare(tmp_path: Path, capsys) -> None:
    fast = run(FakeServer(delay_s=0.001), conversations(), BenchOptions(clients=4, progress=False))
    slow = run(FakeServer(delay_s=0.01), conversations(), BenchOptions(clients=4, progress=False))
    fast.to_json(tmp_path / "fast.json")
    slow.to_json(tmp_path / "slow.json")
    again = Report.from_json(tmp_path / "fast.json")
    assert again.summary()["ttft_s"] == fast.summary()["ttft_s"] and again.meta["model"] == "fake"
    assert "api_key" not in again.meta["options"]
    assert again.summary()["efficiency"] == fast.summary()["efficiency"] and again.meta["ideal"]["page_size"] == 16
    rows = {label: ratio for label, _, _, ratio in metric_rows(fast.summary(), slow.summary())}
    assert rows["ITL median"] > 3 and rows["hit rate"] == pytest.approx(1.0)
    assert "TTFT p99" in compare(fast, slow)
    assert main(["bench", "compare", str(tmp_path / "fast.json"), str(tmp_path / "slow.json"),
                 "--plots-dir", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "ITL median (ms)" in out and "fast" in out and "slow" in out
    assert (tmp_path / "plots" / "compare_ttft_cdf.png").stat().st_size > 1000


def test_percentile_matches_linear_interpolation() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5) and percentile(values, 90) == pytest.approx(90.1)
    assert percentile([3.0], 99) == 3.0


def test_record_json_drops_the_answer_text() -> None:
    record = RequestRecord(index=1, tags={"round": 2}, scheduled_at=0.5, ok=True, text="long answer")
    data = record.to_json()
    assert "text" not in data and RequestRecord.from_json(data).tags == {"round": 2}
