"""Shared by the tests that freeze or kill a rank of a multi-rank node under router load
(``test_tp_pd_faults.py``, ``test_cp_pp_pd_faults.py``): the nodes they start, a greedy request
through the router on a word-tokenizer model, and a node's gRPC health."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.pd_nodes import DECODE_ARGS, NODE_ARGS
from helpers.processes import NodeProcess

DEATH_DEADLINE_S = 30.0
UNHEALTHY_WITHIN_S = 5.0  # a node whose rank is frozen says so this soon (docs/ranks.md)
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def fault_node(role: str, model: Path, log: Path, layout: list[str]) -> NodeProcess:
    """A prefill or decode node (not yet ready) with the rank ``layout`` flags; prefill chunks of 16
    tokens, so a prefill lasts several steps a fault can land in."""
    args = DECODE_ARGS if role == "decode" else [*NODE_ARGS, "--chunked-prefill-size", "16"]
    return NodeProcess(role, ["--model", str(model), *args, *layout], log)


def complete(url: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    """One greedy, non-streaming completion through the router (a retry is invisible to it)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=180)


def word_tokens(response: httpx.Response) -> list[int]:
    """The answer's token ids, read back from a word tokenizer's text (token i is ``w<i>``)."""
    assert response.status_code == 200, response.text
    return [int(word.removeprefix("w")) for word in response.json()["choices"][0]["text"].split()]


def grpc_health(address: str) -> int:
    """The node's gRPC health status (``health_pb2.HealthCheckResponse`` values)."""
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
