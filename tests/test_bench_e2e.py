"""``tierserve bench`` end to end on a real local cluster (a prefill node with a host tier, a decode
node and the router, as processes on loopback, on a tiny model): the report's fields are present and
consistent with each other and with what was sent. Small sizes: this checks the plumbing, not speed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.pd_nodes import DECODE_ARGS, NODE_ARGS
from helpers.processes import NodeProcess, RouterProcess

from tierserve.bench import (
    BenchOptions,
    MultiTurnConfig,
    Report,
    TokenSpace,
    TraceConfig,
    mooncake_trace,
    multiturn,
    run_bench,
)
from tierserve.bench.records import TIERS
from tierserve.cli.main import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SPACE = TokenSpace(vocab_size=384, min_id=32)  # the tiny test model's vocabulary
MOONCAKE = Path(__file__).resolve().parent / "data" / "traces" / "mooncake_conversation_first_200.jsonl"


@pytest.fixture(scope="module")
def router(long_llama: Path, tmp_path_factory) -> Iterator[RouterProcess]:
    logs = tmp_path_factory.mktemp("bench_e2e")
    model = ["--model", str(long_llama)]
    prefill = NodeProcess("prefill", [*model, *NODE_ARGS, "--enable-hierarchical-cache"], logs / "p.log")
    decode = NodeProcess("decode", [*model, *DECODE_ARGS], logs / "d.log")
    procs: list = [prefill, decode]
    try:
        prefill.wait_ready()
        decode.wait_ready()
        router = RouterProcess([*model, "--prefill", prefill.address, "--decode", decode.address], logs / "r.log")
        procs.append(router)
        yield router.wait_ready()
    finally:
        for proc in reversed(procs):
            proc.stop()


def check_consistent(report: Report, planned: int) -> dict:
    """The contract of the report, request by request and in the summary."""
    s = report.summary()
    assert s["requests"] == {"total": planned, "ok": planned, "failed": 0}, s["errors"]
    for r in report.records:
        assert r.ok and r.status == 200 and r.error is None
        assert r.prompt_tokens == r.sent_prompt_tokens > 0
        assert 0 <= r.cached_tokens <= r.prompt_tokens
        assert set(r.cached_by_tier) == set(TIERS) and sum(r.cached_by_tier.values()) == r.cached_tokens
        assert 0 < r.ttft <= r.e2e and all(x >= 0 for x in r.itl)
    assert s["tokens"]["cached"] == sum(s["tokens"][t] for t in TIERS)
    assert 0 <= s["hit_rate"] <= 1 and s["hit_rate"] == pytest.approx(sum(s["hit_rate_by_tier"].values()))
    # The ideal (an unbounded cache over the same prompts) bounds what the server hit: fresh salts per test.
    assert report.meta["ideal"]["note"] is None and s["ideal_hit_rate"] is not None
    assert s["efficiency"] is not None and 0 <= s["efficiency"] <= 1.0 + 1e-9, (s["hit_rate"], s["ideal_hit_rate"])
    for key in ("ttft_s", "e2e_s"):
        d = s[key]
        assert d["count"] == planned and 0 < d["median"] <= d["p90"] <= d["p99"]
    assert s["request_throughput"] > 0 and s["output_token_throughput"] > 0
    return s


def test_multiturn_bench_against_a_local_cluster(router: RouterProcess, tmp_path: Path) -> None:
    config = MultiTurnConfig(clients=4, rounds=3, context_length=96, question_length=24, output_length=6)
    workload = multiturn(config, "tokens", SPACE, seed=0)
    options = BenchOptions(clients=4, barrier=True, progress=False, extra_body={"cache_salt": "multiturn"})
    report = run_bench(router.url, workload, options)
    s = check_consistent(report, planned=12)
    assert all(r.output_tokens == 6 for r in report.records)  # ignore_eos and max_tokens reach the engine
    by_round = s["hit_rate_by_round"]
    assert by_round[0] == 0 and by_round[2] > 0.5, by_round  # later rounds reuse the whole history but a page
    report.to_json(tmp_path / "mt.json")
    assert Report.from_json(tmp_path / "mt.json").summary()["hit_rate"] == pytest.approx(s["hit_rate"])


def test_trace_replay_through_the_cli(router: RouterProcess, tmp_path: Path, capsys) -> None:
    out = tmp_path / "trace.json"
    args = ["bench", "run", "trace", "--endpoint", router.url, "--trace", str(MOONCAKE), "--max-records", "16",
            "--block-size", "16", "--max-prompt-tokens", "512", "--output-scale", "0.01", "--time-scale", "0.05",
            "--max-concurrency", "3",  # the decode pool (4096 tokens) holds 3 prompts + headroom at once
            "--vocab-size", "384", "--no-progress", "--out", str(out), "--plots-dir", str(tmp_path / "plots"),
            "--extra-body", json.dumps({"cache_salt": "trace"})]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "hit rate" in printed and "efficiency" in printed
    report = Report.from_json(out)
    s = check_consistent(report, planned=16)
    assert s["hit_rate"] > 0  # the trace's first records share their first block (hash id 0)
    expected = mooncake_trace(TraceConfig(MOONCAKE, 16, 0.01, 16, 512), SPACE)
    assert sorted(r.sent_prompt_tokens for r in report.records) == sorted(len(x.first().prompt)
                                                                            for x in expected.sessions)
    assert all((tmp_path / "plots" / f"trace_{name}.png").is_file() for name in ("ttft_cdf", "hit_rate"))
