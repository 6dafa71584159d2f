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
        that does not know sessions (an older one) is left at this router's own load. A session
        dropped for silence stays open until its replacement reported (``_follow``)."""
        delay = RETRY_S
        silent: grpc.aio.UnaryStreamCall | None = None
        try:
            while True:
                try:
                    silent = await self._follow(worker, silent)
                    delay = RETRY_S
                    if silent is not None:
                        continue  # reopen at once: the silent session holds the node's count meanwhile
                except grpc.aio.AioRpcError as exc:
                    silent = None  # ended by ``_follow``
                    worker.reported(None)
                    if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                        log.warning("worker %s has no router sessions: balancing on this router's load",
                                    worker.address)
                        return
                    log.debug("session with %s broke (%s); again in %.1f s", worker.address, exc.code().name, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, MAX_RETRY_S)
        finally:
            _end(silent)

    async def _follow(self, worker: Worker, silent: grpc.aio.UnaryStreamCall | None = None
                      ) -> grpc.aio.UnaryStreamCall | None:
        """Follows one session until it ends (None) or goes silent for ``SILENT_S`` (a frozen or
        overloaded node): then it is returned still open, and ended only once the next session
        (``silent`` there) brought its first report. The node frees this router's requests when its
        last session with it ends (``node/sessions.py``), so closing the silent one first would
        make a node that was only slow abort every generation and cancel every reservation of a
        live router, whose prefill nodes may go on writing into those pages (issue 31)."""
        request = pb.SessionRequest(router_id=self.registry.router_id, interval_seconds=REPORT_INTERVAL_S)
        call = pb_grpc.NodeServiceStub(worker.channel).Session(request)
        kept = None
        try:
            while True:
                report = await _read(call)
                silent = _end(silent)  # the node counts the new session now: the silent one may end
                if report is grpc.aio.EOF:
                    return None
                worker.reported(report)
        except TimeoutError:
            log.warning("session with %s: no load report for %.0f s; opening it again", worker.address, SILENT_S)
            kept, silent = (silent, None) if silent is not None else (call, None)  # the one the node surely counts
            return kept
        finally:
            _end(silent)
            if kept is not call:
                call.cancel()
            with contextlib.suppress(Exception):
                worker.reported(None)


async def _read(call: grpc.aio.UnaryStreamCall) -> object:
    """The session's next report; ``TimeoutError`` after ``SILENT_S`` without one. The read is not
    cancelled then (cancelling a read cancels the call, which must stay open: ``_follow``)."""
    read = asyncio.ensure_future(call.read())
    read.add_done_callback(_retrieved)
    done, _ = await asyncio.wait({read}, timeout=SILENT_S)
    if not done:
        raise TimeoutError
    return read.result()


def _retrieved(read: asyncio.Future) -> None:
    """A read left pending on a silent session ends with its call's cancellation: nothing to report."""
    if not read.cancelled():
        read.exception()


def _end(call: grpc.aio.UnaryStreamCall | None) -> None:
    """Ends a session call (None: nothing to end); returns None, for ``silent = _end(silent)``."""
    if call is not None:
        call.cancel()
    return None
