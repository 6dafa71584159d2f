"""A node's router sessions (``src/tierserve/node/sessions.py``, docs/router.md): the requests a
router made are freed when its last session ends, and only then; other routers' requests are
untouched; a router whose session ended may tie requests again (freed at its next session's end);
a session reports the node's load at once, on each change and at least every interval; a router
reopening a silent session (``src/tierserve/router/sessions.py``) frees nothing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc

from tierserve.node.sessions import RouterSessions
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.router import sessions as router_sessions
from tierserve.router.registry import Worker
from tierserve.router.roles import Role
from tierserve.router.sessions import NodeSessions


class _Load:
    """A node's load that the test changes."""

    def __init__(self) -> None:
        self.report = pb.LoadReport(running=1)

    def __call__(self) -> pb.LoadReport:
        return self.report


async def _open(sessions: RouterSessions, router: str, load: _Load, reports: list[pb.LoadReport],
                interval: float = 1.0) -> asyncio.Task:
    """A session of ``router`` collecting its reports, once the first one came."""
    async def follow() -> None:
        async for report in sessions.session(pb.SessionRequest(router_id=router, interval_seconds=interval), load):
            reports.append(report)

    task = asyncio.create_task(follow())
    while not reports:
        await asyncio.sleep(0.01)  # poll interval
    return task


async def _close(task: asyncio.Task) -> None:
    task.cancel()  # as gRPC cancels the handler when the router's connection resets
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_a_lost_router_frees_its_own_requests_and_no_one_elses() -> None:
    async def scenario() -> tuple[list[list[str]], RouterSessions]:
        sessions, forgotten, load = RouterSessions(), [], _Load()

        async def forget(ids: list[str]) -> None:
            forgotten.append(ids)

        sessions.forget.append(forget)
        a1, a2, b = [await _open(sessions, r, load, []) for r in ("a", "a", "b")]
        sessions.own("a", "ra-1")
        sessions.own("a", "ra-2")
        sessions.own("b", "rb-1")
        sessions.disown("a", "ra-2")  # released by the router: nothing to free
        await _close(a1)
        assert forgotten == [], "a router with a session still open is alive"
        await _close(a2)
        await _close(b)
        return forgotten, sessions

    forgotten, sessions = asyncio.run(scenario())
    assert forgotten == [["ra-1"], ["rb-1"]]
    assert (sessions.lost, sessions.freed, len(sessions.streams)) == (2, 2, 0)
    sessions.own("a", "ra-3")  # its session ended, but it sends: it is alive and reopens its session
    assert sessions.owner("ra-3") == "a"
    sessions.own("", "anonymous")  # no router id: tied to nothing
    sessions.own("new", "rn-1")  # a router whose session is not open yet may own requests
    assert sessions.owner("rn-1") == "new" and sessions.owner("anonymous") == ""


def test_a_router_that_comes_back_may_tie_requests_again() -> None:
    async def scenario() -> RouterSessions:
        sessions, load = RouterSessions(), _Load()
        await _close(await _open(sessions, "a", load, []))
        task = await _open(sessions, "a", load, [])
        sessions.own("a", "ra-1")
        await _close(task)
        return sessions

    assert asyncio.run(scenario()).freed == 1


def test_a_session_reports_the_load_at_once_on_change_and_every_interval() -> None:
    async def scenario() -> list[pb.LoadReport]:
        sessions, load, reports = RouterSessions(), _Load(), []
        task = await _open(sessions, "a", load, reports, interval=0.3)
        load.report = pb.LoadReport(running=2, reservations=1)
        while len(reports) < 3:  # the change, then the same load again after the interval
            await asyncio.sleep(0.01)  # poll interval
        await _close(task)
        return reports

    reports = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert [(r.running, r.reservations) for r in reports[:3]] == [(1, 0), (2, 1), (2, 1)]


class _Registry:
    """What ``NodeSessions`` reads of the router's registry for one worker's session."""

    router_id = "router-1"


class _StallingNode(pb_grpc.NodeServiceServicer):
    """A node whose first session stream reports once, then goes silent (a node too busy or stopped
    to report) while staying open; later streams report as usual."""

    def __init__(self) -> None:
        self.sessions, self.opened, self.forgotten = RouterSessions(), 0, []
        self.sessions.forget.append(self._forget)

    async def _forget(self, ids: list[str]) -> None:
        self.forgotten.append(ids)

    async def Session(self, request: pb.SessionRequest, context: object) -> AsyncIterator[pb.LoadReport]:
        self.opened += 1
        first = self.opened == 1
        async for report in self.sessions.session(request, _Load()):
            yield report
            if first:
                await asyncio.Event().wait()  # silent from now on, never closed by the node


def test_a_silent_session_reopened_by_a_live_router_frees_nothing(monkeypatch) -> None:
    """The router drops a session silent for ``SILENT_S`` and opens another; the node frees a router's
    requests when its last session ends, so the silent one must stay open until the new one reported:
    closing it first made an only slow node abort every generation of a live router (truncated 200
    answers) and cancel its reservations while its prefill nodes still wrote into them (issue 31)."""
    monkeypatch.setattr(router_sessions, "SILENT_S", 0.3)

    async def scenario() -> _StallingNode:
        node, server = _StallingNode(), grpc.aio.server()
        pb_grpc.add_NodeServiceServicer_to_server(node, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        worker = Worker(Role.DECODE, f"127.0.0.1:{port}", channel)
        keep = asyncio.create_task(NodeSessions(_Registry())._keep(worker))
        node.sessions.own("router-1", "request-1")
        deadline = time.monotonic() + 10
        while node.opened < 2 or worker.report is None:
            assert time.monotonic() < deadline, "the router did not reopen the silent session"
            await asyncio.sleep(0.02)  # poll interval
        assert node.forgotten == [] and node.sessions.lost == 0, "a live router's requests were freed"
        keep.cancel()  # the router goes: its last session ends, and now its requests are freed
        with contextlib.suppress(asyncio.CancelledError):
            await keep
        while not node.forgotten:
            assert time.monotonic() < deadline, "a gone router's requests were not freed"
            await asyncio.sleep(0.02)  # poll interval
        await channel.close()
        await server.stop(None)
        return node

    node = asyncio.run(scenario())
    assert node.forgotten == [["request-1"]] and node.sessions.lost == 1
