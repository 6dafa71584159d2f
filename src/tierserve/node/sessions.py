"""Router sessions on a node (``docs/router.md``, router sessions): which router made which
request, and which routers are alive. A router holds one ``NodeService.Session`` stream open to
each node while it lives; the requests it sends carry its id. When its last stream ends (it died:
kill -9 resets the TCP connection, so the node sees it at once), the node frees what that
router's requests hold: its reservations, its running generations and prefills. Other routers'
requests are untouched. A request without a router id is tied to nothing (its lease bounds it).
A request from a router whose session ended is accepted and tied to it: a router that sends is
alive and reopens its session (a removed and re-added worker, a broken connection); were it dead
after all, the request's lease bounds what it holds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from tierserve.proto import tierserve_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0  # a session's report at least this often (the router sees the stream is alive)
MIN_INTERVAL_S = 0.05  # and at most this often, even when the load keeps changing
CHANGE_POLL_S = 0.02  # how often a session looks for a change of load to report early

Forget = Callable[[list[str]], Awaitable[None]]  # frees what these request ids hold on this node


class RouterSessions:
    """The open sessions per router id and the requests each router owns. One event loop (the
    node's gRPC server's). ``forget`` frees a lost router's requests (the role's service sets it)."""

    def __init__(self) -> None:
        self.streams: Counter[str] = Counter()  # open Session streams per router id
        self.owned: dict[str, set[str]] = {}  # router id -> request ids it made that may hold something
        self.forget: list[Forget] = []
        self.lost = 0  # routers whose last session ended
        self.freed = 0  # requests freed or aborted because their router was lost

    @contextlib.contextmanager
    def tie(self, router_id: str, request_id: str) -> Iterator[None]:
        """``request_id`` belongs to ``router_id`` for the block (an RPC serving it)."""
        self.own(router_id, request_id)
        try:
            yield
        finally:
            self.disown(router_id, request_id)

    def own(self, router_id: str, request_id: str) -> None:
        """Ties a request (a reservation outliving its Reserve call) to a router; no-op without an
        id. A router whose session is not open (starting, or reopening) may own requests: its next
        session's end frees them."""
        if not router_id:
            return
        self.owned.setdefault(router_id, set()).add(request_id)

    def disown(self, router_id: str, request_id: str) -> None:
        ids = self.owned.get(router_id)
        if ids is not None:
            ids.discard(request_id)

    def owner(self, request_id: str) -> str:
        """The router a request is tied to ('' for none); for a Generate that continues a reservation."""
        return next((router for router, ids in self.owned.items() if request_id in ids), "")

    async def session(self, request: pb.SessionRequest, load: Callable[[], pb.LoadReport]
                      ) -> AsyncIterator[pb.LoadReport]:
        """One router's stream: the node's load now, then whenever it changed (at most every
        ``MIN_INTERVAL_S``) and at least every ``interval_seconds``; until the router goes.
        The router's requests are freed when its last stream ends."""
        router = request.router_id
        interval = request.interval_seconds or DEFAULT_INTERVAL_S
        self.streams[router] += 1
        log.info("router %s: session opened (%d open)", router, self.streams[router])
        try:
            async for report in _reports(load, interval):
                yield report
        finally:
            self.streams[router] -= 1
            if self.streams[router] <= 0:
                del self.streams[router]
                await asyncio.shield(self._lose(router))

    async def _lose(self, router: str) -> None:
        """The router's last session ended: free what its requests hold."""
        ids = sorted(self.owned.pop(router, set()))
        self.lost += 1
        self.freed += len(ids)
        log.warning("router %s: session ended; freeing its %d request(s) on this node", router or "(no id)",
                    len(ids))
        for forget in self.forget:
            await forget(ids)


async def _reports(load: Callable[[], pb.LoadReport], interval: float) -> AsyncIterator[pb.LoadReport]:
    """The load now, then each change (no sooner than ``MIN_INTERVAL_S`` after the one before),
    and the same load again after ``interval`` seconds without a change."""
    last = load()
    sent = time.monotonic()
    yield last
    while True:
        await asyncio.sleep(max(CHANGE_POLL_S, MIN_INTERVAL_S - (time.monotonic() - sent)))
        now = load()
        if now != last or time.monotonic() - sent >= interval:
            last, sent = now, time.monotonic()
            yield now
