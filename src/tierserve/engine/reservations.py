"""Pages set aside for prompts another node computes (the decode role's side of a handoff).

A reservation holds the prompt's page table under a lease: the prefix it already caches (pinned,
read-only) and fresh pages a prefill node writes into. It ends in one of three ways: ``take``
(the prompt arrived; the request starts generating), ``cancel`` with the writer known to have
stopped (pages freed at once), or ``cancel`` without that knowledge, e.g. an expired lease or a
prefill node that vanished (fresh pages quarantined for the terms' ``grace_s``, longer than any
transfer deadline, so a late write can never land in a page someone else now uses). The terms
are the decode role's settings (``decode_node``), given with each reservation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.base import PrefixCache, PrefixHit
from tierserve.engine.request import Request
from tierserve.engine.scheduler import pages_for


class CapacityError(RuntimeError):
    """Not enough free KV pages for the reservation now; retry later or elsewhere."""


@dataclass(frozen=True)
class ReservationTerms:
    """How a reservation is held: ``lease_s`` until ``Generate`` must come, ``grace_s`` that pages a
    writer may still touch stay unused after an unconfirmed end (longer than any transfer
    deadline), and ``headroom_tokens`` reserved beyond the prompt for the first answer tokens."""

    lease_s: float = 30.0
    grace_s: float = 40.0
    headroom_tokens: int = 256


DEFAULT_TERMS = ReservationTerms()


class ReservationStaging(Protocol):
    """Memory beside the pages where a writer may put a reservation's KV first (a decode rank's
    ``transfer.receive_staging.ReceiveStaging``): set aside at reserve, scattered into the pages
    when the request starts, freed (or held for the grace) when it ends otherwise."""

    def stage(self, request_id: str, pages: list[int], tokens: int, source_tp: int) -> object | None: ...

    def holds(self, request_id: str) -> bool: ...

    def scatter(self, request_id: str, pages: list[int], start: int, end: int) -> None: ...

    def drop(self, request_id: str, free_at: float | None) -> None: ...

    def tick(self, now: float) -> None: ...

    @property
    def used_bytes(self) -> int: ...


@dataclass
class Reservation:
    request: Request  # prompt, page table and prefix hit; not yet known to the scheduler
    expires_at: float
    grace_s: float


@dataclass
class Reservations:
    allocator: PageAllocator
    cache: PrefixCache
    page_size: int
    active: dict[str, Reservation] = field(default_factory=dict)
    quarantine: list[tuple[float, list[int]]] = field(default_factory=list)  # (free at, pages)
    expired_leases: int = 0
    staging: ReservationStaging | None = None

    def reserve(self, request: Request, num_tokens: int, terms: ReservationTerms, now: float,
                source_tp: int = 0) -> None:
        """Matches the prompt's cached prefix and allocates pages for ``num_tokens`` tokens, leased
        from ``now`` (rank 0's clock: every rank of a node must expire it at the same step), and
        staging for a writer of ``source_tp`` ranks where that helps; raises ``CapacityError``
        (holding nothing) when the pool cannot supply them."""
        prompt = request.prompt_ids
        hit = self.cache.match(prompt[: len(prompt) - 1], None, request.scope)
        missing = pages_for(num_tokens, self.page_size) - len(hit.pages)
        if self.allocator.num_free < missing:
            self.cache.evict(missing - self.allocator.num_free)
        pages = self.allocator.alloc_after(hit.pages, missing)  # CP: the hit's rotation (docs/cp.md)
        while pages is None and self.cache.evict(missing) > 0:  # CP: the owners it needs may still lack pages
            pages = self.allocator.alloc_after(hit.pages, missing)
        if pages is None:
            self.cache.release(prompt, list(hit.pages), hit.num_tokens, hit)
            raise CapacityError(f"no room for {num_tokens} tokens of KV: {self.allocator.num_free} pages free "
                                f"of {self.allocator.num_pages}")
        request.hit, request.pages, request.num_computed = hit, [*hit.pages, *pages], hit.num_tokens
        self.active[request.request_id] = Reservation(request, now + terms.lease_s, terms.grace_s)
        if self.staging is not None:
            self.staging.stage(request.request_id, request.pages, len(prompt), source_tp)

    def take(self, request_id: str) -> Request:
        """Ends the lease: the prompt's KV arrived (moved from staging into the pages) and the request may run."""
        reservation = self.active.pop(request_id, None)
        if reservation is None:
            raise KeyError(f"no reservation {request_id!r} (unknown, released or its lease expired)")
        r = reservation.request
        if self.staging is not None:
            self.staging.scatter(request_id, r.pages, r.num_computed, len(r.prompt_ids))
        return r

    def cancel(self, request_id: str, writer_stopped: bool, now: float) -> bool:
        """Gives the pages back (unless ``writer_stopped``, fresh pages wait in quarantine until
        ``now`` plus the grace); False if the reservation is unknown."""
        reservation = self.active.pop(request_id, None)
        if reservation is None:
            return False
        r = reservation.request
        kept = len(r.hit.pages)
        if self.staging is not None:
            self.staging.drop(request_id, None if writer_stopped else now + reservation.grace_s)
        if writer_stopped:
            self.cache.release(r.prompt_ids, r.pages, r.hit.num_tokens, r.hit)
        else:
            self.cache.release(r.prompt_ids, r.pages[:kept], r.hit.num_tokens, r.hit)
            self.quarantine.append((now + reservation.grace_s, r.pages[kept:]))
        r.pages, r.hit = [], PrefixHit()
        return True

    def tick(self, now: float) -> list[str]:
        """Expires leases (their writer may still be running) and frees quarantined pages whose
        grace period is over, as of ``now`` (rank 0's clock, sent with the step: ranks that read
        their own clocks could expire a lease at different steps); returns the expired ids."""
        expired = [rid for rid, res in self.active.items() if res.expires_at <= now]
        for rid in expired:
            self.cancel(rid, False, now)
        self.expired_leases += len(expired)
        if self.staging is not None:
            self.staging.tick(now)
        for entry in [q for q in self.quarantine if q[0] <= now]:
            self.quarantine.remove(entry)
            self.allocator.free(entry[1])
        return expired

    def __bool__(self) -> bool:
        return bool(self.active or self.quarantine)

    @property
    def quarantined_pages(self) -> int:
        return sum(len(pages) for _, pages in self.quarantine)
