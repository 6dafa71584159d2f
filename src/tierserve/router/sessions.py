"""This router's sessions with the nodes (``docs/router.md``, several routers): one
``NodeService.Session`` stream per worker, open while the router lives. It brings the node's own
load (every router's requests), which the policies balance on (``Worker.pressure``), and its
end tells the node this router is gone, so the node frees what this router's requests hold
(``node/sessions.py``): a router killed with no goodbye leaks nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.router.registry import Registry, Worker

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 1.0  # the node reports at least this often (and soon after each change)
SILENT_S = 3 * REPORT_INTERVAL_S  # a session with no report for this long is dropped (a frozen node) and reopened
RETRY_S = 0.2  # a broken session is opened again after this, doubling up to MAX_RETRY_S
MAX_RETRY_S = 2.0


class NodeSessions:
    """Keeps one session per listed worker (draining ones too: their requests still run) until cancelled."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._tasks: dict[Worker, asyncio.Task] = {}

    async def run(self, registry: Registry) -> None:
        """Follows the registry's workers (an app task)."""
        try:
            while True:
                self._sync()
                await asyncio.sleep(min(registry.check_interval_s, 0.5))
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _sync(self) -> None:
        listed = set(self.registry.listed())
        for worker in [w for w in self._tasks if w not in listed]:
            self._tasks.pop(worker).cancel()
        for worker in listed - self._tasks.keys():
            self._tasks[worker] = asyncio.create_task(self._keep(worker), name=f"session {worker.address}")

    async def _keep(self, worker: Worker) -> None:
        """Opens the session again whenever it breaks (the node restarted, a network cut); a node
        that does not know sessions (an older one) is left at this router's own load."""
        delay = RETRY_S
        while True:
            try:
                await self._follow(worker)
                delay = RETRY_S
            except grpc.aio.AioRpcError as exc:
                worker.reported(None)
                if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("worker %s has no router sessions: balancing on this router's load", worker.address)
                    return
                log.debug("session with %s broke (%s); again in %.1f s", worker.address, exc.code().name, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, MAX_RETRY_S)

    async def _follow(self, worker: Worker) -> None:
        request = pb.SessionRequest(router_id=self.registry.router_id, interval_seconds=REPORT_INTERVAL_S)
        call = pb_grpc.NodeServiceStub(worker.channel).Session(request)
        try:
            while True:
                async with asyncio.timeout(SILENT_S):
                    report = await call.read()
                if report is grpc.aio.EOF:
                    return
                worker.reported(report)
        except TimeoutError:
            log.warning("session with %s: no load report for %.0f s; opening it again", worker.address, SILENT_S)
        finally:
            call.cancel()
            with contextlib.suppress(Exception):
                worker.reported(None)
