"""The router's prediction of a request's time to first token (``--admission ttft``, docs/router.md).

Each worker that computes prompts (every prefill node, and a decode node for the prompts it
prefills itself) has a ``Lane``: the prompt tokens still to compute there by priority, as the node
reports them (``LoadReport.prefill_backlog``: every router's requests) corrected by what this
router sent or saw start since the report, and its prefill rate measured from this router's
first tokens. A new request's tokens on a worker are those the router's KV index does not see it
holding in L1 or L2; of those, the pages after them that the cluster's L3 holds (any node's
``storage`` events) are loaded, at the L3 read rate the node reports, while the work ahead runs;
the rest are computed. The prediction is the best worker's: the work ahead at the request's
priority or a more important one (or the L3 load, if longer) plus its own computed tokens, over
that worker's rate. Workers not yet measured give none.

The same lanes choose a request's path under ``--disaggregation-spill-priority`` (``spills``): an
important prompt whose prefill nodes are backed up with as important work is prefilled on its decode
node instead (Dynamo's load-based conditional disaggregation, docs/router.md).
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

# The prefill path must be predicted this many times slower than the decode node's own prefill: that
# prediction leaves out the decode steps sharing its steps, and a spilled prefill slows its streams.
SPILL_MARGIN = 1.5

LookupFactory = Callable[[list[int], str], Callable[[Worker], CachedPrefix]]
L3LookupFactory = Callable[[list[int], str], Callable[[int], int]]  # prompt -> (pages held -> L3 pages after)


class TTFTView:
    """Lanes by worker address (a worker that comes back at the same address keeps its rate)."""

    def __init__(self, registry: Registry, lookup: LookupFactory, disaggregation: Disaggregation,
                 l3_lookup: L3LookupFactory | None = None) -> None:
        self.registry, self.lookup, self.disaggregation = registry, lookup, disaggregation
        self.l3_lookup = l3_lookup or (lambda prompt, salt: lambda held: 0)
        self.lanes: dict[str, Lane] = {}

    def lane(self, worker: Worker) -> Lane:
        """``worker``'s lane, up to date with the node's last load report (``Lane.observe``)."""
        lane = self.lanes.setdefault(worker.address, Lane())
        report = worker.report
        lane.observe(report, report.prefill_backlog if report is not None else None)
        return lane

    def predict(self, prompt: list[int], priority: int, salt: str) -> float | None:
        """Seconds to the first token on the best worker that would compute the prompt: any prefill
        node, or a decode node holding all but fewer than ``--disaggregation-threshold`` (times its
        CP size: ``Disaggregation.limit``) of its tokens, or one the prompt would spill to (``spills``);
        None when none of them was measured yet."""
        lookup, l3 = self.lookup(prompt, salt), self.l3_lookup(prompt, salt)
        held = {w: lookup(w) for role in (Role.PREFILL, Role.DECODE) for w in self.registry.available(role)}
        candidates = [(w, self._uncached(prompt, h), h) for w, h in held.items()]
        candidates = [(w, n, h) for w, n, h in candidates
                      if w.role is Role.PREFILL or n < self.disaggregation.limit(w.cp_size)]
        known = [p for w, n, h in candidates if (p := self._predict(w, n, h, l3, priority)) is not None]
        best, spilled = min(known, default=None), self._spill_time(prompt, priority, lookup)
        return spilled if best is not None and spilled is not None and best > SPILL_MARGIN * spilled else best

    def _predict(self, worker: Worker, uncached: int, held: CachedPrefix, l3: Callable[[int], int],
                 priority: int) -> float | None:
        """``worker``'s lane's prediction, the prompt's pages in L3 after those it holds loaded, not
        computed (at the rate the node reports; as computed while it has not read from L3 yet)."""
        loaded = min(l3(held.device + held.host) * self._page_size(), uncached - 1)
        rate = worker.report.l3_read_tokens_per_second if worker.report is not None else 0.0
        return self.lane(worker).predict(priority, uncached - loaded, loaded, rate)

    def spills(self, decode: Worker, prefill: Worker, prompt: list[int], priority: int, salt: str) -> bool:
        """Whether ``decode`` should prefill the prompt itself rather than ``prefill``: it computes no
        prompt of ``priority`` or a more important one (its lane's work ahead, every router's), and
        ``prefill``'s prediction is ``SPILL_MARGIN`` times its own (``_local_time``). False while
        ``prefill`` is not measured."""
        lookup, l3 = self.lookup(prompt, salt), self.l3_lookup(prompt, salt)
        held = lookup(prefill)
        remote = self._predict(prefill, self._uncached(prompt, held), held, l3, priority)
        local = self._local_time(decode, prompt, priority, lookup, self.lane(prefill).rate)
        return remote is not None and local is not None and remote > SPILL_MARGIN * local

    def _spill_time(self, prompt: list[int], priority: int, lookup: Callable[[Worker], CachedPrefix]
                    ) -> float | None:
        """Under ``--disaggregation-spill-priority`` for ``priority``: the soonest first token of a
        decode node that would take the prompt spilled (``_local_time``, a prefill node's rate where
        it has none); None otherwise."""
        if not self.disaggregation.may_spill(priority):
            return None
        rates = [r for w in self.registry.available(Role.PREFILL) if (r := self.lane(w).rate) is not None]
        times = [self._local_time(w, prompt, priority, lookup, max(rates, default=None))
                 for w in self.registry.available(Role.DECODE)]
        return min((t for t in times if t is not None), default=None)

    def _local_time(self, decode: Worker, prompt: list[int], priority: int, lookup: Callable[[Worker], CachedPrefix],
                    fallback: float | None) -> float | None:
        """Seconds for ``decode`` to prefill the prompt itself, at its measured rate (or, not measured
        yet, ``fallback``: a prefill node's, the same model's); None while it computes a prompt of
        ``priority`` or a more important one (one at a time), or with no rate."""
        lane = self.lane(decode)
        rate = lane.rate or fallback
        if lane.work_ahead(priority) > 0 or rate is None:
            return None
        return self._uncached(prompt, lookup(decode)) / rate

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
        return uncached_tokens(len(prompt), held, self._page_size())

    def _page_size(self) -> int:
        info = self.registry.info
        return info.identity.page_size if info is not None else 1
