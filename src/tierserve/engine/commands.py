"""What reaches an engine from outside, as data: every rank of a node applies the same commands in
the same order (``docs/ranks.md``), so they must cross processes (pickled)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from tierserve.core.sampling import SamplingParams
from tierserve.core.scope import NO_SCOPE, CacheScope
from tierserve.core.storage import StorageAction, StorageKind
from tierserve.engine.engine import Engine
from tierserve.engine.handoff import Handoff, KVCheck, SharedPlan
from tierserve.engine.request import Request, RequestOutput
from tierserve.engine.reservations import DEFAULT_TERMS, ReservationTerms


class EngineCommand(Protocol):
    """A change to the engine's requests. ``apply`` runs on the engine thread of every rank and may
    produce the request's first output; it raises for a request that can never be served."""

    request_id: str

    def apply(self, engine: Engine) -> RequestOutput | None: ...


class EngineCall(Protocol):
    """A change to the engine that is not a request's stream (a reservation, a cache flush): rank
    0 answers the caller with ``apply``'s result; the other ranks apply it too and drop the result."""

    def apply(self, engine: Engine) -> object: ...


class CollectiveCall:
    """An ``EngineCall`` whose ``apply`` runs collectives over the node's ranks: rank 0 publishes
    it on the step bus before applying it (``EngineLoop``), so every rank enters them together."""


def runs_collectives(command: EngineCommand | EngineCall) -> bool:
    """Rank 0 publishes ``command`` before applying it (``CollectiveCall``, or a command whose
    ``collective`` is true), so its ranks agree on its outcome inside it."""
    return isinstance(command, CollectiveCall) or bool(getattr(command, "collective", False))


# A new request with at least this many prompt tokens is published before rank 0 applies it: applying
# one hashes every page of its prompt and starts its L3 probe (4-6 ms at 32K tokens, growing with the
# prompt), which the other ranks then do beside rank 0 instead of after it (issue 28). A shorter one
# rides in the loop turn's message, which carries every command it drained in one broadcast.
AHEAD_PROMPT_TOKENS = 4096


def published_ahead(command: EngineCommand | EngineCall) -> bool:
    """Rank 0 publishes ``command`` before applying it, its outcome in the next message
    (``LeaderBus.publish_ahead``); unlike a collective one, the ranks' outcomes are compared."""
    return isinstance(command, AddRequest) and len(command.prompt_ids) >= AHEAD_PROMPT_TOKENS


@dataclass(frozen=True)
class AddRequest:
    """``Engine.add_request``. A ``handoff`` is this process's own object: it never crosses ranks;
    on a node of several ranks ``plan`` (picklable data) is what each rank builds its own handoff
    from (``RankRole.bind``)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    scope: CacheScope = NO_SCOPE
    handoff: Handoff | None = None
    plan: SharedPlan | None = None
    l3_pending: int = 0  # the prompt's leading pages another node is writing to L3 now

    def apply(self, engine: Engine) -> RequestOutput | None:
        engine.add_request(self.request_id, self.prompt_ids, self.params, self.scope, self.handoff, self.l3_pending)
        return None


@dataclass(frozen=True)
class StartReserved:
    """``Engine.start_reserved``: a reservation whose prompt KV arrived starts decoding."""

    request_id: str
    first_token: int
    params: SamplingParams
    resumed: int = 0  # the prompt's last tokens another engine generated (a migration)
    check: KVCheck | None = None  # refuses KV that arrived corrupted (``--handoff-integrity``)

    @property
    def collective(self) -> bool:
        """A check adds up the ranks' digests (a collective): rank 0 publishes the command first."""
        return self.check is not None

    def apply(self, engine: Engine) -> RequestOutput | None:
        return engine.start_reserved(self.request_id, self.first_token, self.params, self.resumed, self.check)


@dataclass(frozen=True)
class AbortRequest:
    """``Engine.abort``: stops a waiting or running request (nothing if it is gone)."""

    request_id: str

    def apply(self, engine: Engine) -> RequestOutput | None:
        return engine.abort(self.request_id)


@dataclass(frozen=True)
class Reserve:
    """``Engine.reserve`` leased from ``now``, rank 0's clock when the call came: every rank's lease
    ends at the same step (``docs/ranks.md``). Rank 0 answers with the request."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    scope: CacheScope
    terms: ReservationTerms = DEFAULT_TERMS
    now: float = 0.0
    source_tp: int = 0  # the writing prefill node's TP size (0: unknown)

    def apply(self, engine: Engine) -> Request:
        return engine.reserve(self.request_id, self.prompt_ids, self.max_new_tokens, self.scope, self.terms,
                              self.now, self.source_tp)


@dataclass(frozen=True)
class CancelReservation:
    """``Engine.cancel_reservation`` as of ``now`` (rank 0's clock); answers whether the request was
    known, as a reservation or as a running generation (which the caller then aborts)."""

    request_id: str
    writer_stopped: bool
    now: float = 0.0

    def apply(self, engine: Engine) -> bool:
        return engine.cancel_reservation(self.request_id, self.writer_stopped, self.now) or \
            self.request_id in engine.requests


@dataclass(frozen=True)
class FlushCache(CollectiveCall):
    """``PrefixCache.flush`` of unpinned L1 and/or L2 pages; answers (device pages, host pages).
    Collective: the hierarchical cache agrees with the other ranks on the copies it waits for."""

    device: bool
    host: bool

    def apply(self, engine: Engine) -> tuple[int, int]:
        return engine.cache.flush(self.device, self.host)


@dataclass(frozen=True)
class StorageControl(CollectiveCall):
    """``Engine.storage_admin``: run-time L3 attach, detach or clear, on every rank in agreement
    (``engine/l3_admin.py``); answers rank 0's status, or raises the first rank's failure."""

    action: StorageAction
    kind: StorageKind | None = None
    config: dict[str, Any] = field(default_factory=dict)

    def apply(self, engine: Engine) -> dict[str, Any]:
        return engine.storage_admin(self.action, self.kind, self.config)


Bind = Callable[[EngineCommand | EngineCall], EngineCommand | EngineCall]


class RankRole(Protocol):
    """What a node role adds to every rank process of its node (picklable: it crosses to ranks
    1..N-1 at spawn). ``attach`` runs once on every rank, right after its engine is built and in
    the same order on all (it may run collectives, e.g. to gather each rank's transfer endpoint);
    it returns ``bind``, which turns a command received from rank 0 into this rank's own (a
    handoff ``plan`` into this rank's handoff)."""

    def attach(self, engine: Engine) -> Bind: ...


@runtime_checkable
class Shared(Protocol):
    """A command holding process-local objects: ``shared`` is what the other ranks receive instead."""

    def shared(self) -> EngineCommand | EngineCall: ...


def for_other_ranks(command: EngineCommand | EngineCall) -> EngineCommand | EngineCall:
    """What the other ranks receive for ``command``: without rank 0's own handoff, which they
    rebuild from its plan; a handoff without a plan cannot be shared."""
    if isinstance(command, Shared):
        return command.shared()
    if not isinstance(command, AddRequest) or command.handoff is None:
        return command
    if command.plan is None:
        raise ValueError("this KV handoff cannot run on a node of several ranks: it has no plan the ranks can share")
    return replace(command, handoff=None)
