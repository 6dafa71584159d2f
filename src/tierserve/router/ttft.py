"""The router's prediction of a request's time to first token (``--admission ttft``, docs/router.md).

Each worker that computes prompts (every prefill node, and a decode node for the prompts it
prefills itself) has a ``Lane``: the prompt tokens still to compute there by priority, as the node
reports them (``LoadReport.prefill_backlog``: every router's requests) corrected by what this
router sent or saw start since the report, and its prefill rate measured from this router's
first tokens. A new request's tokens on a worker are those the router's KV index does not see it
holding (L1 and L2; L3 is not indexed per worker, so its pages count as computed: an
over-estimate). The prediction is the best worker's: the work ahead at the request's priority or
a more important one plus its own, over that worker's rate. Workers not yet measured give none.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from tierserve.api.admission import Lane, tracked
from tierserve.core.outputs import RequestOutput
from tierserve.core.sampling import MAX_INT32
from tierserve.router.disaggregation import Disaggregation, uncached_tokens
from tierserve.router.policies import CachedPrefix
from tierserve.router.registry import Registry, Worker
from tierserve.router.roles import Role

LookupFactory = Callable[[list[int], str], Callable[[Worker], CachedPrefix]]


class TTFTView:
    """Lanes by worker address (a worker that comes back at the same address keeps its rate)."""

    def __init__(self, registry: Registry, lookup: LookupFactory, disaggregation: Disaggregation) -> None:
        self.registry, self.lookup, self.disaggregation = registry, lookup, disaggregation
        self.lanes: dict[str, Lane] = {}

    def lane(self, worker: Worker) -> Lane:
        """``worker``'s lane, up to date with the node's last load report (``Lane.observe``)."""
        lane = self.lanes.setdefault(worker.address, Lane())
        report = worker.report
        lane.observe(report, report.prefill_backlog if report is not None else None)
        return lane

    def predict(self, prompt: list[int], priority: int, salt: str) -> float | None:
        """Seconds to the first token on the best worker that would compute the prompt: any prefill
        node, or a decode node holding all but fewer than ``--disaggregation-threshold`` of its
        tokens; None when none of them was measured yet."""
        lookup = self.lookup(prompt, salt)
        candidates = [(w, self._uncached(prompt, lookup(w))) for w in self.registry.available(Role.PREFILL)]
        candidates += [(w, n) for w in self.registry.available(Role.DECODE)
                       if (n := self._uncached(prompt, lookup(w))) < self.disaggregation.threshold]
        known = [p for w, n in candidates if (p := self.lane(w).predict(priority, n)) is not None]
        return min(known, default=None)

    def track(self, worker: Worker, request_id: str, tokens: int, priority: int,
              outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """``outputs`` of a try whose prompt ``worker`` computes (``tokens`` of it uncached there, as
        the routing decision looked them up), counted in its lane until the first."""
        return tracked(self.lane(worker), request_id, priority, tokens, outputs)

    def state(self) -> dict[str, object]:
        """For ``/debug/state``: each lane's own outstanding tokens, rate, the node's reported
        backlog and the work ahead of the least important request."""
        for worker in self.registry.listed():
            if worker.address in self.lanes:
                self.lane(worker)  # brought up to date with the node's report
        return {address: {"ahead_tokens": sum(t for _, t in lane.ahead.values()), "rate": lane.rate,
                           "work_ahead": lane.work_ahead(MAX_INT32),
                           "node_backlog": dict(lane.reported) if lane.reported is not None else None}
                for address, lane in self.lanes.items()}

    def _uncached(self, prompt: list[int], held: CachedPrefix) -> int:
        info = self.registry.info
        return uncached_tokens(len(prompt), held, info.identity.page_size if info is not None else 1)
