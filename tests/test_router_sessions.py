"""A node's router sessions (``src/tierserve/node/sessions.py``, docs/router.md): the requests a
router made are freed when its last session ends, and only then; other routers' requests are
untouched; a router whose session ended may tie requests again (freed at its next session's end);
a session reports the node's load at once, on each change and at least every interval."""

from __future__ import annotations

import asyncio
import contextlib

from tierserve.node.sessions import RouterSessions
from tierserve.proto import tierserve_pb2 as pb


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
