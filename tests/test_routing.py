"""Cache-aware routing with real processes: two prefill nodes publish KV events, the router
indexes them, and a conversation's follow-up turns go to the node that holds its prefix; the
cluster's hit rate beats round-robin on the same workload."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.pd_nodes import DECODE_ARGS, NODE_ARGS
from helpers.processes import NodeProcess, RouterProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CONVERSATIONS, TURNS = 3, 3  # odd: round-robin cannot line turns up with nodes by chance


@pytest.fixture(scope="module")
def nodes(long_llama: Path, tmp_path_factory) -> Iterator[tuple[list[NodeProcess], NodeProcess]]:
    logs = tmp_path_factory.mktemp("routing")
    events = ["--kv-events-port", "0"]
    prefills = [NodeProcess("prefill", ["--model", str(long_llama), *NODE_ARGS, *events], logs / f"p{i}.log")
                for i in range(2)]
    decode = NodeProcess("decode", ["--model", str(long_llama), *DECODE_ARGS], logs / "d.log")
    try:
        for proc in (*prefills, decode):
            proc.wait_ready()
        yield prefills, decode
    finally:
        for proc in (*prefills, decode):
            proc.stop()


def run_workload(router: RouterProcess, salt: str) -> list[dict]:
    """Turn by turn, every conversation sends its whole history plus a new question."""
    rng = random.Random(5)
    histories = [[rng.randrange(2, 384) for _ in range(150)] for _ in range(CONVERSATIONS)]
    records = []
    for turn in range(TURNS):
        for c, history in enumerate(histories):
            body = {"prompt": history, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "cache_salt": salt}
            r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            route = httpx.get(f"{router.url}/debug/state").json()["routes"][-1]
            records.append({"conversation": c, "turn": turn, "prompt": usage["prompt_tokens"],
                            "cached": usage["prompt_tokens_details"]["cached_tokens"], "prefill": route["prefill"]})
            answer = [rng.randrange(2, 384) for _ in range(12)]  # stands in for the answer text: new tokens
            history += answer + [rng.randrange(2, 384) for _ in range(30)]
    return records


def hit_rate(records: list[dict]) -> float:
    return sum(r["cached"] for r in records) / sum(r["prompt"] for r in records)


def start_router(model: Path, prefills: list[NodeProcess], decode: NodeProcess, policy: str, log: Path
                 ) -> RouterProcess:
    workers = [a for p in prefills for a in ("--prefill", p.address)]
    return RouterProcess(["--model", str(model), *workers, "--decode", decode.address, "--prefill-policy", policy,
                          "--health-check-interval", "0.3"], log).wait_ready()


def test_follow_up_turns_go_to_the_node_holding_their_prefix(long_llama: Path, nodes, tmp_path: Path) -> None:
    prefills, decode = nodes
    results = {}
    for policy in ("round_robin", "cache_aware"):
        router = start_router(long_llama, prefills, decode, policy, tmp_path / f"{policy}.log")
        try:
            results[policy] = run_workload(router, salt=policy)  # a salt each: the runs share no cache
        finally:
            router.stop()
    aware = results["cache_aware"]
    first_node = {r["conversation"]: r["prefill"] for r in aware if r["turn"] == 0}
    assert len(set(first_node.values())) == 2, "new conversations spread over both nodes"
    for r in aware:
        assert r["prefill"] == first_node[r["conversation"]], r
        if r["turn"]:
            assert r["cached"] >= r["prompt"] - 42 - 16, r  # all but the new question and a partial page
    rr, ca = hit_rate(results["round_robin"]), hit_rate(aware)
    print(f"hit rate: round_robin {rr:.2f}, cache_aware {ca:.2f}")
    assert ca > rr
