"""Several routers in front of the same nodes, with real processes (docs/router.md, several
routers): two routers under one multi-turn load hit the cache as one router does and keep the
two decode nodes evenly loaded (they balance on the load the nodes report); a router started
after the load warmed the caches routes its first requests to the holders; a router killed with
kill -9 mid-load leaks nothing (its reservations freed within seconds, its streams cancelled on
the nodes) while the other goes on untouched."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from helpers.injected_faults import handoff_env
from helpers.metrics import scrape, value
from helpers.pd_nodes import DECODE_ARGS, NODE_ARGS, PAGE
from helpers.polling import wait_for
from helpers.processes import NodeProcess, RouterProcess

from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# 12 conversations: ~4 requests on each decode node at once, so "within 20% of even" is ~0.8 of a request.
# With 6 (~2 per node) one request's odd share alone was 22% (CI: mean loads 1.61 and 2.5); 3 turns keep the
# request count (36) near what it was.
CONVERSATIONS, TURNS, QUESTION, ANSWER = 12, 3, 30, 12
MAX_TOKENS = 48  # long enough that the conversations' requests overlap on the decode nodes
# A conversation's first prompt: 25 pages, so the holder's cached prefix outweighs a few requests more on
# it (cache_aware's load cost) and the hit rate does not swing with the moment's load.
HISTORY = 400
Nodes = tuple[list[NodeProcess], list[NodeProcess]]
# The slow prefill node's handoffs wait this long before their first batch: A is killed meanwhile.
# Below the decode nodes' grace, so a late batch lands in quarantined pages, as a real one would.
LAG_S, GRACE_S = 8.0, 12.0


@pytest.fixture(scope="module")
def nodes(long_llama: Path, tmp_path_factory) -> Iterator[Nodes]:
    """Two prefill nodes publishing KV events and two decode nodes, each with a metrics port."""
    logs = tmp_path_factory.mktemp("routers")
    prefills = [_node("prefill", long_llama, logs / f"p{i}.log", "--kv-events-port", "0") for i in range(2)]
    decodes = [_node("decode", long_llama, logs / f"d{i}.log", "--reservation-grace", str(GRACE_S)) for i in range(2)]
    try:
        for proc in (*prefills, *decodes):
            proc.wait_ready()
        yield prefills, decodes
    finally:
        for proc in (*prefills, *decodes):
            proc.stop()


def _node(role: str, model: Path, log: Path, *extra: str, env: dict[str, str] | None = None) -> NodeProcess:
    from tierserve.launch import free_port

    metrics = free_port()
    args = [*(DECODE_ARGS if role == "decode" else NODE_ARGS), "--metrics-port", str(metrics), *extra]
    proc = NodeProcess(role, ["--model", str(model), *args], log, env=env)
    proc.metrics_url = f"http://127.0.0.1:{metrics}/metrics"  # type: ignore[attr-defined]
    return proc


def _router(model: Path, prefills: list[NodeProcess], decodes: list[NodeProcess], log: Path) -> RouterProcess:
    workers = [a for p in prefills for a in ("--prefill", p.address)] + \
              [a for d in decodes for a in ("--decode", d.address)]
    return RouterProcess(["--model", str(model), *workers, "--health-check-interval", "0.3"], log)


class Conversation:
    """A multi-turn conversation: each turn sends the whole history plus a new question."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.history = rng, [rng.randrange(2, 384) for _ in range(HISTORY)]

    def turn(self, url: str, salt: str) -> dict:
        body = {"prompt": self.history, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "cache_salt": salt}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        self.history = self.history + [self.rng.randrange(2, 384) for _ in range(ANSWER + QUESTION)]
        return {"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def run_load(urls: list[str], conversations: list[Conversation], salt: str, turns: int) -> list[dict]:
    """Every conversation on its own thread, turn after turn; conversation i through ``urls[i % len]``."""
    def run(i: int) -> list[dict]:
        return [conversations[i].turn(urls[i % len(urls)], salt) for _ in range(turns)]

    with ThreadPoolExecutor(len(conversations)) as pool:
        return [r for rs in pool.map(run, range(len(conversations))) for r in rs]


def hit_rate(records: list[dict]) -> float:
    return sum(r["cached"] for r in records) / sum(r["prompt"] for r in records)


def decode_counts(routers: list[RouterProcess], since: list[int]) -> Counter:
    """Decode nodes picked by ``routers`` since their route logs had ``since`` entries."""
    counts: Counter = Counter()
    for router, start in zip(routers, since, strict=True):
        counts.update(r["decode"] for r in routes(router)[start:])
    return counts


class LoadSampler:
    """Samples each decode node's load (requests running, waiting and reserved, as its ``Load``
    RPC says) every ``interval_s`` on a thread, while a load runs."""

    def __init__(self, nodes: list[NodeProcess], interval_s: float = 0.02) -> None:
        self.nodes, self.interval_s = nodes, interval_s
        self.samples: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        channels = [grpc.insecure_channel(n.address) for n in self.nodes]
        stubs = [pb_grpc.NodeServiceStub(c) for c in channels]
        try:
            while not self._stop.wait(self.interval_s):  # sampling period
                reports = [stub.Load(pb.LoadRequest(), timeout=10) for stub in stubs]
                self.samples.append([r.running + r.waiting + r.reservations for r in reports])
        finally:
            for channel in channels:
                channel.close()

    def means(self) -> list[float]:
        busy = [s for s in self.samples if sum(s)]
        return [sum(s[i] for s in busy) / len(busy) for i in range(len(self.nodes))]


def routes(router: RouterProcess) -> list[dict]:
    return httpx.get(f"{router.url}/debug/state", timeout=10).json()["routes"]


def test_two_routers_hit_the_cache_as_one_and_balance_the_decode_nodes(long_llama: Path, nodes: Nodes,
                                                                      tmp_path: Path) -> None:
    prefills, decodes = nodes
    routers = [_router(long_llama, prefills, decodes, tmp_path / f"r{i}.log") for i in range(2)]
    try:
        for router in routers:
            router.wait_ready()
        one = run_load([routers[0].url], [Conversation(random.Random(i)) for i in range(CONVERSATIONS)], "one",
                       TURNS)
        since = [len(routes(r)) for r in routers]
        with LoadSampler(decodes) as sampler:
            two = run_load([r.url for r in routers], [Conversation(random.Random(i)) for i in range(CONVERSATIONS)],
                           "two", TURNS)
        counts = decode_counts(routers, since)
        states = [httpx.get(f"{r.url}/debug/state", timeout=10).json()["workers"] for r in routers]
    finally:
        for router in routers:
            router.stop()
    means = sampler.means()
    print(f"hit rate: one router {hit_rate(one):.3f}, two routers {hit_rate(two):.3f}; decode picks {counts}; "
          f"mean decode node load {[round(m, 2) for m in means]} over {len(sampler.samples)} samples")
    assert abs(hit_rate(two) - hit_rate(one)) <= 0.05
    assert hit_rate(one) > 0.5, "follow-up turns hit their prefix"
    assert sum(counts.values()) == CONVERSATIONS * TURNS and len(counts) == 2
    assert len(sampler.samples) >= 20, "enough samples to judge the balance"
    even = sum(means) / 2  # each node's mean load (requests on it while any ran) within 20% of even
    assert all(abs(m - even) <= 0.2 * even for m in means), means
    for workers in states:  # each router balanced on what the nodes reported, not on its own counts
        assert all(w["node_load"] is not None for w in workers), workers


def test_a_router_started_late_routes_its_first_requests_to_the_holders(long_llama: Path, nodes: Nodes,
                                                                        tmp_path: Path) -> None:
    prefills, decodes = nodes
    early = _router(long_llama, prefills, decodes, tmp_path / "early.log").wait_ready()
    conversations = [Conversation(random.Random(100 + i)) for i in range(4)]
    holders: list[str] = []
    try:
        for c in conversations:  # one by one: each route is the last one
            c.turn(early.url, "late")
            holders.append(routes(early)[-1]["prefill"])
    finally:
        early.stop()
    assert len(set(holders)) == 2, "the conversations spread over both prefill nodes"
    late = _router(long_llama, prefills, decodes, tmp_path / "late.log").wait_ready()
    try:
        records = [c.turn(late.url, "late") for c in conversations]
        picked = [r["prefill"] for r in routes(late)]  # in the conversations' order
    finally:
        late.stop()
    for record in records:  # all but the new question, the answer and a partial page came from the cache
        assert record["cached"] >= record["prompt"] - ANSWER - QUESTION - PAGE, record
    assert picked == holders


def test_a_router_killed_mid_load_leaks_nothing(long_llama: Path, nodes: Nodes, tmp_path: Path) -> None:
    """Router A sends through a prefill node whose handoffs lag (its reservations on the decode
    nodes wait) and through a plain one (its streams run on the decode nodes); router B through
    the plain one only. A is killed with kill -9: within 5 s the decode nodes hold no reservation
    and run none of A's streams, A's clients see a connection error, B's requests (a steady load
    before, during and after the kill) all succeed."""
    prefills, decodes = nodes
    slow = _node("prefill", long_llama, tmp_path / "slow.log",
                 env=handoff_env(tmp_path / "faults.json", delay_s=LAG_S)).wait_ready()
    a = _router(long_llama, [slow, prefills[0]], decodes, tmp_path / "a.log")
    b = _router(long_llama, [prefills[0]], decodes, tmp_path / "b.log")
    try:
        a.wait_ready()
        b.wait_ready()
        _kill_mid_load(a, b, decodes, slow.address)
    finally:
        for proc in (a, b, slow):
            proc.stop()


def _kill_mid_load(a: RouterProcess, b: RouterProcess, decodes: list[NodeProcess], slow: str) -> None:
    lost_before = sum(_metric(d, "tierserve_router_lost_requests_total") for d in decodes)
    a_errors: list[BaseException] = []
    a_threads = [threading.Thread(target=_stream_until_cut, args=(a.url, i, a_errors)) for i in range(6)]
    stop_b = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        b_loads = [pool.submit(_complete_until, b.url, i, stop_b) for i in range(3)]
        wait_for(lambda: routes(b), "B's load running", 30)
        for thread in a_threads:
            thread.start()
        wait_for(lambda: len(routes(a)) >= 6, "A's requests on the nodes", 60, interval_s=0.02)
        lagging = sum(r["prefill"] == slow for r in routes(a))  # their reservations wait for the lagging handoff
        a.proc.kill()
        killed = time.monotonic()
        wait_for(lambda: _sum(decodes, "tierserve_reservations") == 0, "A's reservations freed", 5)
        freed_s = time.monotonic() - killed
        for thread in a_threads:
            thread.join(30)
        stop_b.set()
        outcomes = [o for f in b_loads for o in f.result()]
    assert len(outcomes) >= 3 and all(o == (200, 40) for o in outcomes), outcomes
    assert len(a_errors) == 6 and all(isinstance(e, httpx.TransportError) for e in a_errors), a_errors
    wait_for(lambda: _sum(decodes, "tierserve_num_requests_running") == 0, "A's streams cancelled", 5)
    lost = sum(_metric(d, "tierserve_router_lost_requests_total") for d in decodes) - lost_before
    print(f"A's reservations freed {freed_s:.2f} s after kill -9; {lost:.0f} of its requests freed on the nodes")
    assert 1 <= lagging <= lost
    wait_for(lambda: _sum(decodes, "tierserve_reservation_pages_quarantined") == 0,
             "the quarantined pages back after the grace", 15)


def _stream_until_cut(url: str, i: int, errors: list[BaseException]) -> None:
    """A long streaming completion through router A; records how it ended (A dies meanwhile)."""
    body = {"prompt": [2 + (i * 7 + j) % 380 for j in range(40)], "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                pass
    except BaseException as exc:  # the test asserts which
        errors.append(exc)


def _complete_until(url: str, i: int, stop: threading.Event) -> list[tuple[int, int]]:
    """Completions through router B, one after another until ``stop``: (status, tokens) of each."""
    outcomes = []
    while not stop.is_set():
        body = {"prompt": [3 + (i * 11 + len(outcomes) * 5 + j) % 380 for j in range(40)], "max_tokens": 40,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        outcomes.append((r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0))
    return outcomes


def _metric(node: NodeProcess, name: str) -> float:
    return value(scrape(node.metrics_url), name)  # type: ignore[attr-defined]


def _sum(nodes: list[NodeProcess], name: str) -> float:
    return sum(_metric(n, name) for n in nodes)
