"""A fan-out (``n`` > 1) request through the router. Its choices are one prefill, one handoff and
n decodes (docs/pd.md, n choices; issue 29 item 2): greedy choices equal the requests sent one by
one, seeded ones differ, a stream interleaves them, a failed leader leaves its siblings to their own
pairs, a client gone ends them all, nothing leaks. One whose siblings are rejected at admission
leaves no reservation behind (issue 13 item 1), and the metrics count one HTTP error, not one error
per choice (item 9)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import metrics
from helpers.injected_faults import handoff_env
from helpers.pd_nodes import DECODE_ARGS, GRACE_S, NODE_ARGS, PAGE, load, metric
from helpers.polling import wait_for
from helpers.processes import NodeProcess, RouterProcess, free_port
from helpers.tiny_models import add_word_tokenizer, make_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SLOTS = 8  # the router runs this many choices at once and queues none: the rest of an n=16 get 429


ADMIN = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A tiny llama with a 2048-token context and a word tokenizer, so choices have texts to compare."""
    return add_word_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("fanout_llama"), max_position=2048))


@pytest.fixture(scope="module")
def nodes(model: Path, tmp_path_factory) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    """A prefill and a decode node, each with its /metrics."""
    logs = tmp_path_factory.mktemp("fanout")
    prefill = NodeProcess("prefill", ["--model", str(model), *NODE_ARGS, "--metrics-port", str(free_port())],
                          logs / "p.log")
    decode = NodeProcess("decode", ["--model", str(model), *DECODE_ARGS, "--metrics-port", str(free_port())],
                         logs / "d.log")
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop(), decode.stop()


@pytest.fixture(scope="module")
def cluster(model: Path, nodes, tmp_path_factory) -> Iterator[tuple[RouterProcess, NodeProcess]]:
    prefill, decode = nodes
    router = RouterProcess(["--model", str(model), "--prefill", prefill.address, "--decode", decode.address,
                            "--max-running-requests", str(SLOTS), "--max-queued-requests", "0",
                            "--admin-api-key", "k"], tmp_path_factory.mktemp("router") / "r.log").wait_ready()
    try:
        yield router, decode
    finally:
        router.stop()


def fan_out(router: RouterProcess, n: int) -> httpx.Response:
    body = {"prompt": [2 + i % 300 for i in range(300)], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": n}
    return httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)


async def _no_reservations(address: str) -> bool:
    report = await load(address)
    return report.reservations == 0 and report.kv_pages_used == 0


def test_a_fan_out_rejected_with_429_leaves_no_reservation_on_the_decode_node(cluster) -> None:
    router, decode = cluster
    for _ in range(3):  # the race (a choice cancelled while its Reserve is in flight) is hit most times
        r = fan_out(router, 2 * SLOTS)
        assert r.status_code == 429, r.text
        # The lease would keep an orphan for 600 s (the router's prefill timeout) plus the grace.
        wait_for(lambda: _no_reservations(decode.address), "the decode node holds no reservation", 10)


def test_a_fan_out_rejected_with_429_counts_one_http_error_and_no_request(cluster) -> None:
    router, _ = cluster
    errors, aborts = metric(router, "tierserve_requests_total", finish_reason="error"), \
        metric(router, "tierserve_requests_total", finish_reason="abort")
    rejected = metric(router, "tierserve_http_errors_total", status="429", code="overloaded")
    assert fan_out(router, 2 * SLOTS).status_code == 429
    assert metric(router, "tierserve_http_errors_total", status="429", code="overloaded") == rejected + 1
    assert metric(router, "tierserve_requests_total", finish_reason="error") == errors  # no choice ran
    assert metric(router, "tierserve_requests_total", finish_reason="abort") == aborts
    finished = metric(router, "tierserve_requests_total", finish_reason="length")
    assert fan_out(router, 3).status_code == 200
    assert metric(router, "tierserve_requests_total", finish_reason="length") == finished + 3  # one per choice


def _prompt(seed: int, length: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 384) for _ in range(length)]


def _complete(router: RouterProcess, prompt: list[int], **fields) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True} | fields
    return httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)


def _texts(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]


def _node(node: NodeProcess, name: str, **labels: str) -> float:
    """A sample of a node's /metrics (0 while absent)."""
    port = node.proc.args[node.proc.args.index("--metrics-port") + 1]
    return metrics.value(metrics.scrape(f"http://127.0.0.1:{port}"), name, **labels)


def _counts(router: RouterProcess, prefill: NodeProcess, decode: NodeProcess) -> tuple[float, float, float, int]:
    """(prompt tokens the prefill node computed, its handoffs done, prompt tokens the decode node
    computed, sibling choices the router forked)."""
    state = httpx.get(f"{router.url}/debug/state", headers=ADMIN).json()
    return (_node(prefill, "tierserve_prefill_tokens_computed_total"),
            _node(prefill, "tierserve_handoffs_total", outcome="ok"),
            _node(decode, "tierserve_prefill_tokens_computed_total"), state["forks"])


def _one_by_one(router: RouterProcess, prompt: list[int], n: int, tag: str, **fields) -> list[str]:
    """The ``n`` choices sent as requests of their own, each under its own salt (nothing shared);
    with a seed, choice ``i`` gets ``seed + i`` as ``make_jobs`` gives it."""
    seed = fields.pop("seed", None)
    return [_texts(_complete(router, prompt, cache_salt=f"{tag}{i}", **fields,
                             **({"seed": seed + i} if seed is not None else {})))[0] for i in range(n)]


def test_n_greedy_choices_are_one_prefill_one_handoff_and_n_decodes(cluster, nodes) -> None:
    router, _ = cluster
    prefill, decode = nodes
    prompt = _prompt(1)
    before = _counts(router, prefill, decode)
    response = _complete(router, prompt, n=4, cache_salt="greedy")
    texts = _texts(response)
    full = (len(prompt) - 1) // PAGE * PAGE  # each fork computes the last partial page and the last token
    want = (before[0] + len(prompt), before[1] + 1, before[2] + 3 * (len(prompt) - full), before[3] + 3)
    wait_for(lambda: _counts(router, prefill, decode) == want, f"one prefill, one handoff, 3 forks: {want}", 10)
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 4 * 8
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # choice 0's report, as on serve: a fresh prompt
    assert texts == _one_by_one(router, prompt, 4, "greedy-one") and len(set(texts)) == 1 and texts[0]
    again = _complete(router, prompt, n=4, cache_salt="greedy")  # the prompt is cached now: reported once
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == full
    assert _texts(again) == texts


def test_n_seeded_choices_differ_and_each_equals_its_seed_sent_alone(cluster) -> None:
    router, _ = cluster
    prompt, fields = _prompt(2), {"temperature": 1.0, "seed": 7, "max_tokens": 12}
    texts = _texts(_complete(router, prompt, n=4, cache_salt="seeded", **fields))
    assert len(set(texts)) > 1, texts
    assert texts == _one_by_one(router, prompt, 4, "seeded-one", **fields)


def test_a_stream_of_n_forked_choices_interleaves_them(cluster) -> None:
    router, _ = cluster
    prompt = _prompt(3)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "n": 3, "stream": True,
            "cache_salt": "stream"}
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    ends: dict[int, int] = {0: 0, 1: 0, 2: 0}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            assert ends[choice["index"]] == 0, "nothing after a choice's finish reason"
            texts[choice["index"]] += choice["text"]
            ends[choice["index"]] += choice["finish_reason"] is not None
    assert ends == {0: 1, 1: 1, 2: 1}
    assert list(texts.values()) == _one_by_one(router, prompt, 3, "stream-one")


async def _decode_idle(address: str) -> bool:
    report = await load(address)
    return report.reservations == 0 and report.kv_pages_used == 0 and report.running == 0


def test_a_client_gone_mid_stream_ends_every_choice(cluster, nodes) -> None:
    router, decode = cluster
    body = {"prompt": _prompt(4), "max_tokens": 400, "temperature": 0, "ignore_eos": True, "n": 4, "stream": True}
    forks = _counts(router, *nodes)[3]
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # a choice streams: then the client goes
    assert _counts(router, *nodes)[3] == forks + 3
    wait_for(lambda: _decode_idle(decode.address), "the decode node runs and holds nothing", 15)


def test_a_leader_whose_handoff_fails_leaves_its_siblings_to_their_own_pairs(model: Path, nodes,
                                                                            tmp_path: Path) -> None:
    """Every fourth handoff of this prefill node fails (the 4th: choice 0's, after three warm-ups):
    the siblings go their own way, choice 0 is retried, every choice completes, nothing leaks."""
    _, decode = nodes
    faulty = NodeProcess("prefill", ["--model", str(model), *NODE_ARGS], tmp_path / "p.log",
                         env=handoff_env(tmp_path / "faults.json", rate=0.25))
    router = None
    try:
        faulty.wait_ready()
        router = RouterProcess(["--model", str(model), "--prefill", faulty.address, "--decode", decode.address,
                                "--admin-api-key", "k"], tmp_path / "r.log").wait_ready()
        for i in range(3):
            _texts(_complete(router, _prompt(10 + i, 40), max_tokens=2))
        prompt = _prompt(5)
        texts = _texts(_complete(router, prompt, n=4))
        assert texts == _one_by_one(router, prompt, 4, "fault-one")
        state = httpx.get(f"{router.url}/debug/state", headers=ADMIN).json()
        assert state["forks"] == 0 and state["retries"] >= 1  # no sibling waited for the failed leader
        wait_for(lambda: _decode_idle(decode.address), "the decode node frees every page", GRACE_S + 15)
        wait_for(lambda: _pages_back(faulty.address), "the prefill node frees every page", 15)
    finally:
        for proc in (router, faulty):
            if proc is not None:
                proc.stop()


async def _pages_back(address: str) -> bool:
    report = await load(address)
    return report.kv_pages_used == 0 and report.kv_pages_parked == 0

