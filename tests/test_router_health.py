"""The router's health checks (``Registry.check``) against real gRPC health servers on loopback: an
answer late past the check's deadline takes a worker out only when another of its role is available
(the last one keeps its traffic, docs/router.md); NOT_SERVING and a refused connection always do."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierserve.launch import free_port
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.router.registry import Registry, Worker, WorkerState
from tierserve.router.roles import Role

LATE_S = 0.6  # the servers' delay, past the registry's deadline below
DEADLINE_S = 0.2


class SlowHealth(health_pb2_grpc.HealthServicer):
    """Answers ``status`` after ``delay_s``."""

    def __init__(self, status: int, delay_s: float) -> None:
        self.status, self.delay_s = status, delay_s

    async def Check(self, request, context):
        await asyncio.sleep(self.delay_s)
        return health_pb2.HealthCheckResponse(status=self.status)


class Identity(pb_grpc.NodeServiceServicer):
    """``Info`` of one model and KV namespace (what a serving node's check asks next)."""

    async def Info(self, request, context):
        return pb.NodeInfo(model="m", namespace_digest="n")


class Node:
    """A gRPC server with ``SlowHealth`` and ``Identity`` only; ``address`` once started."""

    def __init__(self, status: int, delay_s: float) -> None:
        self.server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(SlowHealth(status, delay_s), self.server)
        pb_grpc.add_NodeServiceServicer_to_server(Identity(), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"


async def _checked(nodes: list[Node | None]) -> list[WorkerState]:
    """Starts ``nodes`` (None: an address where nothing listens), registers each as a healthy decode
    worker, runs one round of checks; the workers' states after it."""
    registry = Registry(check_timeout_s=DEADLINE_S)
    for node in nodes:
        address = f"127.0.0.1:{free_port()}" if node is None else node.address
        if node is not None:
            await node.server.start()
        worker = Worker(Role.DECODE, address, grpc.aio.insecure_channel(address), WorkerState.HEALTHY)
        registry.workers[(Role.DECODE, address)] = worker
    try:
        await registry.check_all()
        return [w.state for w in registry.workers.values()]
    finally:
        for worker in registry.workers.values():
            await worker.channel.close()
        await asyncio.gather(*(node.server.stop(None) for node in nodes if node is not None))


def _run(*nodes: tuple[int, float] | None) -> list[WorkerState]:
    async def main() -> list[WorkerState]:
        return await _checked([None if n is None else Node(*n) for n in nodes])
    return asyncio.run(main())


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_late_answer_keeps_the_last_available_worker_of_its_role() -> None:
    assert _run((SERVING, LATE_S)) == [WorkerState.HEALTHY]


def test_a_late_answer_takes_a_worker_out_when_another_is_available() -> None:
    assert _run((SERVING, LATE_S), (SERVING, 0.0)) == [WorkerState.UNHEALTHY, WorkerState.HEALTHY]


def test_not_serving_or_a_refused_connection_takes_even_the_last_worker_out() -> None:
    assert _run((NOT_SERVING, 0.0)) == [WorkerState.UNHEALTHY]
    assert _run(None) == [WorkerState.UNHEALTHY]


def test_a_timely_answer_keeps_it() -> None:
    assert _run((SERVING, 0.0)) == [WorkerState.HEALTHY]
