"""Admission by predicted time to first token (docs/router.md, "Admission by deadline").

A request may carry a deadline for its first token (``x-request-deadline-ms``, or its API key's
default). Under ``--admission ttft`` the server predicts the request's TTFT before it queues:
the prompt work ahead of it on the worker that would compute its prompt, plus its own uncached
tokens, over that worker's measured prefill rate less what more important work keeps taking of it
(``Lane``); when the best worker cannot make the
deadline the request is answered 429 with ``Retry-After`` at once, instead of being accepted and
timing out later. Under ``--admission fcfs`` deadlines are only counted (late first tokens).

Torch-free: the router and the single-engine server both use it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from tierserve.api import openai as oa
from tierserve.core.outputs import RequestOutput
from tierserve.core.sampling import MAX_UINT32

DEADLINE_HEADER = "x-request-deadline-ms"
_DECAY = 0.9  # each measured first token weighs this much less than the next: about the last 10 count
_MIN_TOKENS = 1  # a lane with fewer measured tokens has no rate yet
DEMAND_WINDOW_S = 30.0  # the work sent in the last this many seconds is a lane's recent demand, by priority
MAX_RETRY_AFTER_S = 60  # a deadline no wait makes (more important work takes the whole rate): retry after this


class AdmissionPolicy(Enum):
    """What a request's deadline does at admission (``--admission``)."""

    TTFT = "ttft"  # predicted time to first token past the deadline: 429 with Retry-After at once
    FCFS = "fcfs"  # admitted in arrival order whatever its deadline; late first tokens are counted


class ShedReason(Enum):
    """Why a request was answered 429 (the ``reason`` label of ``tierserve_requests_shed``)."""

    DEADLINE = "deadline"  # its predicted TTFT is past its deadline
    QUEUE_FULL = "queue_full"  # the server's admission queue is full
    TENANT_LIMIT = "tenant_limit"  # its API key's concurrency or rate limit


def parse_deadline(header: str | None, default_ms: int | None) -> int | None:
    """The request's first-token deadline in milliseconds: the header's, else ``default_ms`` (its
    API key's); None: no deadline. A header that is not a whole number in [1, 2^32) is a 400."""
    if header is None:
        return default_ms
    text = header.strip()
    if not text.isdigit() or not 0 < int(text) <= MAX_UINT32:
        raise oa.APIError(400, f"{DEADLINE_HEADER} must be a whole number of milliseconds in [1, 2^32), "
                               f"got {header!r}", param=DEADLINE_HEADER)
    return int(text)


@dataclass
class Lane:
    """The prompt work sent to one worker whose first token has not come yet, and the worker's
    prefill rate measured from it: between two first tokens while work was outstanding (or from
    the first send on an idle worker) the tokens of the one that came were computed. Batches and
    chunked prefill make single gaps uneven; the decayed sums of tokens and seconds even them out.
    ``recent`` keeps the last ``DEMAND_WINDOW_S`` seconds of sends: the demand of each priority.

    The work ahead is the node's when it reports it (``observe``: its prefill backlog, every
    router's requests), corrected by this lane's own sends since that report (not in it yet) and
    its own first tokens since (the report may still count them), as ``Worker.pressure`` corrects
    the request counts; never less than this lane's own outstanding work."""

    clock: Callable[[], float] = time.monotonic
    ahead: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (priority, tokens)
    recent: deque[tuple[float, int, int]] = field(default_factory=deque)  # (sent at, priority, tokens)
    reported: Mapping[int, int] | None = None  # the node's last prefill backlog by priority (None: none)
    unreported: set[str] = field(default_factory=set)  # ids in ``ahead`` sent since that report
    gone: dict[int, int] = field(default_factory=dict)  # tokens by priority the report counts that came since
    _report: object = None  # the report ``reported`` came from (a new one resets the corrections)
    _tokens: float = 0.0
    _seconds: float = 0.0
    _mark: float | None = None  # when the worker last had no outstanding work, or last gave a first token

    def observe(self, report: object, backlog: Mapping[int, int] | None) -> None:
        """The node's latest load report (any object, compared by identity: the same one again
        changes nothing) and its prefill backlog by priority (None: no report, the session broke)."""
        if report is self._report:
            return
        self._report, self.reported = report, backlog
        self.unreported.clear()
        self.gone.clear()

    def sent(self, request_id: str, priority: int, tokens: int) -> None:
        now = self.clock()
        if not self.ahead:
            self._mark = now
        self.ahead[request_id] = (priority, tokens)
        if self.reported is not None:
            self.unreported.add(request_id)
        self.recent.append((now, priority, tokens))
        while self.recent and self.recent[0][0] < now - DEMAND_WINDOW_S:
            self.recent.popleft()

    def first_token(self, request_id: str, computed: int | None = None) -> None:
        """``request_id``'s first token came: its tokens (``computed``, what the worker reported it
        did not find cached, when known) took the time since the last mark."""
        entry = self._settle(request_id)
        now = self.clock()
        if entry is not None and self._mark is not None:
            self._tokens = self._tokens * _DECAY + (entry[1] if computed is None else computed)
            self._seconds = self._seconds * _DECAY + max(now - self._mark, 0.0)
        self._mark = now if self.ahead else None

    def dropped(self, request_id: str) -> None:
        """``request_id`` ended before its first token (failed, cancelled): not a measurement."""
        self._settle(request_id)
        if not self.ahead:
            self._mark = None

    def _settle(self, request_id: str) -> tuple[int, int] | None:
        """``request_id`` leaves ``ahead``; the node's report counts it until the next one."""
        entry = self.ahead.pop(request_id, None)
        if request_id in self.unreported:
            self.unreported.discard(request_id)
        elif entry is not None and self.reported is not None:
            self.gone[entry[0]] = self.gone.get(entry[0], 0) + entry[1]
        return entry

    def work_ahead(self, priority: int) -> int:
        """Prompt tokens ahead of a request of ``priority`` (that priority or a more important
        one): the node's backlog, corrected since its report, or this lane's own when larger."""
        own = sum(t for p, t in self.ahead.values() if p <= priority)
        if self.reported is None:
            return own
        node = sum(t for p, t in self.reported.items() if p <= priority) \
            + sum(self.ahead[r][1] for r in self.unreported if self.ahead[r][0] <= priority) \
            - sum(t for p, t in self.gone.items() if p <= priority)
        return max(own, node)

    @property
    def rate(self) -> float | None:
        """Prompt tokens per second; None until measured."""
        if self._tokens < _MIN_TOKENS or self._seconds <= 0:
            return None
        return self._tokens / self._seconds

    def predict(self, priority: int, tokens: int, loaded: int = 0, load_rate: float = 0.0) -> float | None:
        """Seconds until the first token of a request of ``priority`` with ``tokens`` to compute:
        the work ahead of it (``work_ahead``: at its priority or a more important one, as a
        priority scheduler admits) and its own, at the rate more important work leaves it (the
        measured rate less the recent demand of more important work, which keeps coming and goes
        first: a priority queue's wait); ``math.inf`` when that demand takes the whole rate; None
        before a measurement. ``loaded`` more tokens come from L3 at ``load_rate`` tokens/s, read
        while the work ahead runs (a prefetch starts on arrival); with no rate they count as computed."""
        rate = self.rate
        if rate is None:
            return None
        if load_rate <= 0:
            tokens, loaded = tokens + loaded, 0
        spare = rate - sum(t for _, p, t in self.recent if p < priority) / DEMAND_WINDOW_S
        if spare <= 0:
            return math.inf
        return max(self.work_ahead(priority) / spare, loaded / load_rate if loaded else 0.0) + tokens / spare


async def tracked(lane: Lane, request_id: str, priority: int, tokens: int,
                  outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """``outputs`` of a request sent to the worker of ``lane``, which counts it ahead until its first
    token (a measurement of the worker's rate) or its end."""
    lane.sent(request_id, priority, tokens)
    first = False
    try:
        async with contextlib.aclosing(outputs) as items:
            async for out in items:
                if not first and out.new_token_ids:
                    first = True
                    lane.first_token(request_id, max(1, out.prompt_tokens - out.cached_tokens))
                yield out
    finally:
        if not first:
            lane.dropped(request_id)


def check_deadline(predicted_s: float | None, deadline_ms: int | None) -> None:
    """Raises 429 (``code`` "deadline") with ``Retry-After`` when the predicted TTFT is past the
    deadline: retrying once the work ahead drained might make it."""
    if predicted_s is None or deadline_ms is None or predicted_s * 1000 <= deadline_ms:
        return
    wait = min(predicted_s - deadline_ms / 1000, MAX_RETRY_AFTER_S)
    predicted = f"{predicted_s * 1000:.0f} ms" if math.isfinite(predicted_s) else "more important work takes it all"
    raise oa.APIError(429, f"the first token cannot come within the request's deadline of {deadline_ms} ms "
                           f"(predicted {predicted}); retry later", code=ShedReason.DEADLINE.value,
                      headers={"Retry-After": str(max(1, math.ceil(wait)))})


def shed_reason(error: oa.APIError) -> ShedReason | None:
    """Why a 429 was answered (None: not a 429, or one of no known reason)."""
    if error.status != 429:
        return None
    known = {"deadline": ShedReason.DEADLINE, "overloaded": ShedReason.QUEUE_FULL,
             "tenant_limit": ShedReason.TENANT_LIMIT}
    return known.get(error.code or "")
