"""Conditional disaggregation (issue 17 item 4): the router sends a request whose prompt the decode
node mostly holds (a short follow-up on a history it generated) to that decode node alone, and a
long uncached prompt through a prefill node, or to the prefill node alone when one token is asked
(item 5); greedy output is the single engine's on every path, the path shows in ``/debug/state``
and ``/metrics``, and nothing stays allocated."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.pd_nodes import DECODE_ARGS, MAX_NEW, NODE_ARGS, PAGE, idle, metric, reference
from helpers.polling import wait_for
from helpers.processes import NodeProcess, RouterProcess, router_over_pair

from tierserve.router.disaggregation import Disaggregation, ServedPath, uncached_tokens
from tierserve.router.policies import CachedPrefix

THRESHOLD = 40  # tokens, the router's --disaggregation-threshold here


def test_the_estimate_counts_what_the_decode_node_lacks() -> None:
    assert uncached_tokens(100, CachedPrefix(), PAGE) == 100
    assert uncached_tokens(100, CachedPrefix(device=3, host=2), PAGE) == 100 - 5 * PAGE
    assert uncached_tokens(32, CachedPrefix(device=2), PAGE) == 1  # the last token is always computed
    rule = Disaggregation(THRESHOLD)
    assert rule.path(THRESHOLD - 1, CachedPrefix(), PAGE, 8) is ServedPath.DECODE_ONLY
    assert rule.path(THRESHOLD, CachedPrefix(), PAGE, 8) is ServedPath.PREFILL_DECODE
    assert rule.path(THRESHOLD + 3 * PAGE, CachedPrefix(host=3), PAGE, 8) is ServedPath.PREFILL_DECODE
    assert rule.path(THRESHOLD + 3 * PAGE - 1, CachedPrefix(device=1, host=2), PAGE, 8) is ServedPath.DECODE_ONLY
    assert Disaggregation(0).path(1, CachedPrefix(), PAGE, 8) is ServedPath.PREFILL_DECODE
    # one token asked: nothing to decode, the prefill node answers alone (unless the decode node holds the prompt)
    assert rule.path(THRESHOLD, CachedPrefix(), PAGE, 1) is ServedPath.PREFILL_ONLY
    assert rule.path(THRESHOLD, CachedPrefix(device=1), PAGE, 1) is ServedPath.DECODE_ONLY


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory) -> Iterator[tuple[RouterProcess, NodeProcess, NodeProcess]]:
    """A prefill node, a decode node publishing KV events, and a router over them."""
    with router_over_pair(tiny_llama, NODE_ARGS, [*DECODE_ARGS, "--kv-events-port", "0"],
                          ["--health-check-interval", "0.5", "--disaggregation-threshold", str(THRESHOLD)],
                          tmp_path_factory.mktemp("disaggregation")) as cluster:
        yield cluster


def complete(router: RouterProcess, prompt: list[int], stream: bool = False) -> list[int]:
    """Greedy token ids of one completion (read from its logprobs' token names)."""
    body = {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "stream": stream}
    if not stream:
        reply = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return _ids(reply.json()["choices"][0]["logprobs"]["tokens"])
    tokens: list[str] = []
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
                tokens += (choice.get("logprobs") or {}).get("tokens", [])
    return _ids(tokens)


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def last_path(router: RouterProcess) -> str:
    return httpx.get(f"{router.url}/debug/state").json()["routes"][-1]["path"]


def indexed(router: RouterProcess, decode: NodeProcess) -> float:
    return metric(router, "tierserve_router_indexed_pages", role="decode", worker=decode.address, medium="device")


@pytest.mark.integration
@pytest.mark.slow
def test_short_follow_ups_go_to_the_decode_node_and_long_prompts_through_prefill(cluster, tiny_llama: Path) -> None:
    router, prefill, decode = cluster
    rng = random.Random(7)
    history = [rng.randrange(2, 384) for _ in range(6 * PAGE + 5)]  # long and cached nowhere
    served = {p: metric(router, "tierserve_router_served_total", path=p.value) for p in ServedPath}
    held = indexed(router, decode)
    first = complete(router, history)
    assert last_path(router) == ServedPath.PREFILL_DECODE.value
    follow = history + first + [rng.randrange(2, 384) for _ in range(9)]  # the answer plus a short new part
    wait_for(lambda: indexed(router, decode) >= held + (len(follow) - 9 - 1) // PAGE,
             "the router sees the decode node's pages of the history", 10)
    again = complete(router, follow, stream=True)
    assert last_path(router) == ServedPath.DECODE_ONLY.value
    fresh = [rng.randrange(2, 384) for _ in range(3 * PAGE)]  # a long prompt nobody holds: through prefill
    third = complete(router, fresh)
    assert last_path(router) == ServedPath.PREFILL_DECODE.value
    short = [rng.randrange(2, 384) for _ in range(THRESHOLD - 1)]  # a short uncached one: the decode node alone
    fourth = complete(router, short)
    assert last_path(router) == ServedPath.DECODE_ONLY.value
    one = httpx.post(f"{router.url}/v1/completions", json={"prompt": fresh[::-1], "max_tokens": 1, "temperature": 0,
                                                           "logprobs": 0, "ignore_eos": True}, timeout=60).json()
    assert last_path(router) == ServedPath.PREFILL_ONLY.value
    assert one["choices"][0]["finish_reason"] == "length" and one["usage"]["completion_tokens"] == 1
    expected = reference(tiny_llama, [history, follow, fresh, short, fresh[::-1]])
    assert [first, again, third, fourth] == expected[:4]
    assert _ids(one["choices"][0]["logprobs"]["tokens"]) == expected[4][:1]
    assert metric(router, "tierserve_router_served_total", path="decode_only") == served[ServedPath.DECODE_ONLY] + 2
    assert metric(router, "tierserve_router_served_total", path="prefill_decode") == \
        served[ServedPath.PREFILL_DECODE] + 2
    assert metric(router, "tierserve_router_served_total", path="prefill_only") == served[ServedPath.PREFILL_ONLY] + 1
    state = httpx.get(f"{router.url}/debug/state").json()
    assert state["served"]["decode_only"] >= 2 and state["routes"][-1]["decode_cached_pages"] == [0, 0]
    wait_for(lambda: idle(prefill.address, decode.address), "every page back", 20)


@pytest.mark.integration
@pytest.mark.slow
def test_a_request_the_decode_node_refuses_is_a_client_error(cluster) -> None:
    """A node serving a request alone checks it as a single engine does: a bad one is a 4xx, never
    a 5xx, and leaves nothing allocated."""
    router, prefill, decode = cluster
    for prompt, tokens, path in (([5, 6, 1000], 2, ServedPath.DECODE_ONLY),  # 1000: past the vocabulary (384)
                                 ([5] * THRESHOLD + [1000], 1, ServedPath.PREFILL_ONLY)):
        body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0}
        reply = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 400 and "[0, 384)" in reply.text, reply.text  # the node's own check
        assert last_path(router) == path.value
    assert asyncio.run(idle(prefill.address, decode.address))
