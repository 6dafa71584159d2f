"""The router's workers: where they come from (flags, the admin API, Kubernetes), whether they
may get traffic (health checks, a circuit breaker, the KV namespace), their live load, and how
they leave (drained: no new work, running requests finish)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierserve.core.node_auth import TLSFiles, node_channel
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.router.roles import Role

log = logging.getLogger(__name__)


class WorkerState(Enum):
    STARTING = "starting"  # not yet reached (no Info)
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # failed health checks or the circuit breaker is open
    REFUSED = "refused"  # its KV namespace differs from the cluster's (checked again when it comes back)
    DRAINING = "draining"  # removed: no new work; its channel closes once its requests ended


@dataclass
class BreakerOptions:
    """``failures`` consecutive failed requests or checks open the breaker for ``open_s`` seconds."""

    failures: int = 3
    open_s: float = 10.0


@dataclass(eq=False)
class Worker:
    role: Role
    address: str
    channel: grpc.aio.Channel
    state: WorkerState = WorkerState.STARTING
    info: pb.NodeInfo | None = None
    load: int = 0  # this router's requests on it now (a request counts until its stream ends)
    report: pb.LoadReport | None = None  # the node's own load (every router's requests), from its Session
    sent_since_report: int = 0  # this router's requests begun since that report (not in it yet)
    ended_since_report: int = 0  # and ended since it (the report may still count them)
    failures: int = 0  # consecutive
    open_until: float = 0.0
    reason: str = ""
    _idle: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # set while load is 0

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def available(self) -> bool:
        return self.state is WorkerState.HEALTHY and time.monotonic() >= self.open_until

    def begin(self) -> None:
        """A request starts using this worker; ``end`` must follow, however it ends."""
        self.load += 1
        self.sent_since_report += 1
        self._idle.clear()

    def end(self) -> None:
        self.load -= 1
        self.ended_since_report += 1
        if self.load == 0:
            self._idle.set()

    def reported(self, report: pb.LoadReport | None) -> None:
        """The node's load as its Session stream reported it (None: the stream broke)."""
        self.report, self.sent_since_report, self.ended_since_report = report, 0, 0

    @property
    def pressure(self) -> int:
        """The requests the policies balance on: those the node reports, from every router
        (running, waiting and, on a decode node, reserved), corrected by this router's begun and
        ended since the report (a node reports a change up to 50 ms late: a stale report made the
        cache-aware policy send a conversation's next turn away from its prefix), and never less
        than this router's own count (which holds a PD request on its prefill node until the
        stream ends); that count alone while no session reports (``router/sessions.py``)."""
        r = self.report
        if r is None:
            return self.load
        reported = r.running + r.waiting + r.reservations + self.sent_since_report - self.ended_since_report
        return max(self.load, reported)

    @property
    def cp_size(self) -> int:
        """The node's context-parallel ranks (``NodeInfo.cp_size``; 1 until known or from a node
        that does not send it)."""
        return max(1, self.info.cp_size) if self.info is not None else 1

    def fits(self, tokens: int) -> bool:
        """Whether one request of ``tokens`` tokens of KV fits the node's pool (``NodeInfo.kv_capacity_tokens``,
        every CP rank's pages together); True while the capacity is unknown."""
        capacity = self.info.kv_capacity_tokens if self.info is not None else 0
        return not capacity or tokens <= capacity

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no request uses this worker; False if ``timeout_s`` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def describe(self) -> dict[str, object]:
        return {"role": self.role.value, "address": self.address, "state": self.state.value, "load": self.load,
                "pressure": self.pressure, "node_load": _report(self.report),
                "namespace": self.info.namespace_digest if self.info else None, "reason": self.reason}


def _report(report: pb.LoadReport | None) -> dict[str, int] | None:
    if report is None:
        return None
    return {"running": report.running, "waiting": report.waiting, "reservations": report.reservations,
            "kv_pages_used": report.kv_pages_used, "kv_pages_total": report.kv_pages_total}


@dataclass
class Registry:
    """All workers by (role, address). The first worker that answers ``Info`` fixes the cluster's
    model and KV namespace; a worker that disagrees is refused (and logged) so KV never mixes."""

    breaker: BreakerOptions = field(default_factory=BreakerOptions)
    check_interval_s: float = 2.0
    check_timeout_s: float = 2.0  # a health check's answer; Info, asked only of a serving node, gets 5 s
    drain_timeout_s: float = 600.0  # a removed worker's requests get this long to finish
    workers: dict[tuple[Role, str], Worker] = field(default_factory=dict)
    draining: dict[Worker, asyncio.Task] = field(default_factory=dict)  # removed, until their requests end
    namespace: str | None = None
    model: str | None = None
    info: pb.NodeInfo | None = None  # of the first accepted worker: page size, context, seed
    node_token: str | None = None  # sent on every call to the workers (core/node_auth.py)
    tls: TLSFiles | None = None  # TLS to the workers (None: plaintext)
    router_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # this process's, in its requests (sessions)

    def add(self, role: Role, address: str) -> Worker:
        """Registers a worker (idempotent); it gets traffic once a health check reached it."""
        key = (role, address)
        if key not in self.workers:
            self.workers[key] = Worker(role, address, node_channel(address, self.node_token, self.tls))
            log.info("worker added: %s %s", role.value, address)
        return self.workers[key]

    async def remove(self, role: Role, address: str) -> bool:
        """Drains a worker (False if unknown): from now on it gets no new request, its running
        ones finish, then its channel closes (when its load reaches 0, or after
        ``drain_timeout_s``, which cuts what still runs). Returns at once."""
        worker = self.workers.pop((role, address), None)
        if worker is None:
            return False
        worker.state = WorkerState.DRAINING
        log.info("worker removed: %s %s; draining %d requests", role.value, address, worker.load)
        self.draining[worker] = asyncio.create_task(self._drain(worker), name=f"drain {address}")
        return True

    async def _drain(self, worker: Worker) -> None:
        if not await worker.wait_idle(self.drain_timeout_s):
            log.warning("worker %s %s: %d requests still running after the %.0f s drain deadline; cutting them",
                        worker.role.value, worker.address, worker.load, self.drain_timeout_s)
        self.draining.pop(worker, None)
        await worker.channel.close(grace=None)

    def listed(self) -> list[Worker]:
        """Every worker, draining ones included (for operators)."""
        return [*self.workers.values(), *self.draining]

    def available(self, role: Role) -> list[Worker]:
        return [w for w in self.workers.values() if w.role is role and w.available]

    def ready(self) -> bool:
        return bool(self.available(Role.PREFILL) and self.available(Role.DECODE))

    def succeeded(self, worker: Worker) -> None:
        worker.failures = 0

    def failed(self, worker: Worker, reason: str, unreachable: bool = False) -> None:
        """A request failed because of this worker: enough in a row open its breaker. An
        unreachable worker (connection refused or reset) gets no traffic until a health check
        reaches it again, so a retry does not pick it."""
        if unreachable and worker.state is WorkerState.HEALTHY:
            worker.state, worker.reason = WorkerState.UNHEALTHY, reason
            log.warning("worker %s %s unreachable (%s): no traffic until a health check passes", worker.role.value,
                        worker.address, reason)
        worker.failures += 1
        if worker.failures >= self.breaker.failures and time.monotonic() >= worker.open_until:
            self._open(worker, reason)

    def _open(self, worker: Worker, reason: str) -> None:
        """Opens the breaker, unless ``worker`` is the last available one of its role: ejecting it
        would turn a flaky node into an outage (every request 503 for ``open_s``), as a load
        balancer's maximum ejection share prevents. A dead one still goes (``unreachable``)."""
        if self._last_available(worker):
            if worker.failures == self.breaker.failures:
                log.warning("worker %s %s: %d failures (%s), but it is the last available %s worker: it keeps "
                            "its traffic", worker.role.value, worker.address, worker.failures, reason,
                            worker.role.value)
            return
        worker.open_until = time.monotonic() + self.breaker.open_s
        worker.reason = reason
        log.warning("worker %s %s: circuit open for %.0f s after %d failures (%s)", worker.role.value,
                    worker.address, self.breaker.open_s, worker.failures, reason)

    def _last_available(self, worker: Worker) -> bool:
        return self.available(worker.role) == [worker]

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))

    async def check(self, worker: Worker) -> None:
        """One health check (gRPC health service), plus ``Info`` while it serves: what answers at
        the same address after an outage may be another process, with other weights, so its
        identity is checked again (and a refused worker gets another chance). A restart faster
        than one check interval is seen too: the new process has another ``instance_id``."""
        try:
            request = health_pb2.HealthCheckRequest()
            reply = await health_pb2_grpc.HealthStub(worker.channel).Check(request, timeout=self.check_timeout_s)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            if serving:
                self._identify(worker, await pb_grpc.NodeServiceStub(worker.channel).Info(pb.InfoRequest(), timeout=5))
        except grpc.aio.AioRpcError as exc:
            if self._only_slow(worker, exc):
                return
            serving = False
            worker.reason = f"health check: {exc.code().name}"
        if not serving:
            worker.info = None
        self._set_state(worker, serving)

    def _only_slow(self, worker: Worker, exc: grpc.aio.AioRpcError) -> bool:
        """Whether a failed check leaves ``worker`` as it was: an answer late past the deadline from the
        last available worker of its role. A loaded machine delays answers (a CI run lost its only decode
        worker to one late check, and every request got 503 until the next); as ``_open`` keeps the last
        one, the check does not turn a slow node into an outage. A node that knows it cannot serve says
        NOT_SERVING (a frozen rank, docs/faults.md), and a dead one refuses the connection: both still count."""
        if exc.code() is not grpc.StatusCode.DEADLINE_EXCEEDED or not self._last_available(worker):
            return False
        log.warning("worker %s %s: health check late (over %.1f s), but it is the last available %s worker: it "
                    "keeps its traffic", worker.role.value, worker.address, self.check_timeout_s, worker.role.value)
        return True

    def _identify(self, worker: Worker, info: pb.NodeInfo) -> None:
        if worker.info is not None and worker.info.instance_id != info.instance_id:
            log.warning("worker %s %s restarted between two health checks (another process at its address); "
                        "identifying it again", worker.role.value, worker.address)
        worker.info = info

    def _set_state(self, worker: Worker, serving: bool) -> None:
        if serving and worker.info is not None and not self._accept(worker):
            return
        new = WorkerState.HEALTHY if serving else WorkerState.UNHEALTHY
        if new is not worker.state:
            log.info("worker %s %s is %s", worker.role.value, worker.address, new.value)
            worker.state = new
            if serving:
                worker.reason, worker.failures, worker.open_until = "", 0, 0.0

    def _accept(self, worker: Worker) -> bool:
        info = worker.info
        if self.namespace is None:
            self.namespace, self.model, self.info = info.namespace_digest, info.model, info
            log.info("cluster KV namespace %s (model %s) from %s", self.namespace, self.model, worker.address)
        if info.namespace_digest != self.namespace:
            worker.reason = (f"KV namespace {info.namespace_digest} differs from the cluster's {self.namespace}: "
                             "another model, other weights, dtype, page size or KV layout")
            if worker.state is not WorkerState.REFUSED:
                log.error("refusing worker %s %s: %s", worker.role.value, worker.address, worker.reason)
            worker.state = WorkerState.REFUSED
            return False
        return True

    async def run_checks(self) -> None:
        """Checks every worker every ``check_interval_s`` until cancelled."""
        while True:
            await self.check_all()
            await asyncio.sleep(self.check_interval_s)

    async def close(self) -> None:
        for task in self.draining.values():
            task.cancel()
        for worker in self.listed():
            with contextlib.suppress(Exception):
                await worker.channel.close(grace=None)
