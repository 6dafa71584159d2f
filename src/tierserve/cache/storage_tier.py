"""L3 behind the host tier: backups after L2 writes, prefetches before admission, and a circuit
breaker so a failing store degrades the cache to L1 + L2 instead of failing requests.

Every L3 call runs on an L3 worker (prefetch or backup lane), never on the engine thread (a slow
store must not stall the running batch), a prefetch's first call (which pages does the store have)
included. The tree, the host allocator and every decision that admits a request change only on
the engine thread, on values all ranks agreed (``docs/ranks.md``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass

from tierserve.cache.draft_kv import SidecarIO, SidecarKV
from tierserve.cache.hashing import page_keys, salted_seed
from tierserve.cache.host_pool import HostKVPool
from tierserve.cache.lanes import Lane, close_lanes
from tierserve.cache.options import PrefetchPolicy
from tierserve.cache.prefetch import PrefetchOptions, PrefetchTicket, chunk_pages, prefetch_timeout
from tierserve.cache.radix_tree import Node, RadixTree
from tierserve.cache.sharded.agreement import leading_true
from tierserve.cache.sharded.cp_host import rank_io
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.cache.sharded.shards import KVShard
from tierserve.cache.speed import SpeedModel
from tierserve.cache.staging import page_io
from tierserve.cache.storage import StorageBackend
from tierserve.core.tiers import CacheTier

log = logging.getLogger(__name__)
RETRY_AFTER_S = 5.0
WINDOW = 24  # prefetches in one step's agreement (5 slots each); the window moves on every step
BACKUP_CALL_PAGES = 1024  # pages per put call: with puts of 4096 pages (a CP=2 rank's half of a 128K-token
# prompt) 231 of the prompt's 8192 pages failed at once with Mooncake TRANSFER_FAIL; 2048-page puts and
# 1024-page calls never did (one run each, on 2 CPU cores: the cause inside Mooncake is not established)
# Pages another node is writing to L3 now (``docs/cache.md``, "Backups in flight"): the store is asked
# again every PENDING_PROBE_S, for as long as writing them takes here (PENDING_SLACK times this node's
# own measured write time, plus PENDING_FLOOR_S for the writer's L1 -> L2 copy and the router's view
# lagging), never longer than computing them would take, nor past the ticket's timeout.
PENDING_PROBE_S = 0.05
PENDING_SLACK = 2.0
PENDING_FLOOR_S = 0.5
# A rank whose probe or read of a prefetch ended waits for the others' at a step's agreement; their
# lanes cannot wake its loop (each wakes its own process), so its loop polls without backing off
# (``EngineLoop``) for up to PEER_WAIT_S: the ranks of a CP node read side by side and end within
# a few tens of ms of each other (issue 28: the back-off lost up to 50 ms twice per prefetch). A
# rank further behind is slow or stuck: the loop backs off as for any other background work.
PEER_WAIT_S = 1.0


def nothing() -> None:
    """A waker that wakes nobody (no engine loop yet)."""


@dataclass
class _Backup:
    node: Node
    future: Future  # of ``_write``: (pages written, the keys the store holds now)


class StorageTier:
    """L3 for one HiCache. Host pages that prefetches hold are capped by the options; ``speed``
    measures L3 reads and prefill for the ``auto`` policy.

    Hands the backend the buffer its spans live in (``attach_host_buffer``) before any transfer:
    the host pool itself, or a staging buffer where the layout has no contiguous pages. ``shard``:
    this rank's heads of every page, the share of each page it stores and reads (``ShardIO``);
    ``ownership``: a CP rank's, which stores and reads only the pages it owns (``cp_host``).
    ``host_pages(previous, n)`` reserves ``n`` host pages continuing the rotation of ``previous``.
    ``sidecar``: a speculative draft's pools in the sidecar layout (``cache/draft_kv.py``).
    """

    def __init__(self, storage: StorageBackend, host: HostKVPool, tree: RadixTree, options: PrefetchOptions,
                 host_pages: Callable[[Sequence[int], int], list[int] | None], shard: KVShard,
                 ownership: PageOwnership | None = None, sidecar: SidecarKV | None = None) -> None:
        self.storage, self.host, self.tree, self.options = storage, host, tree, options
        self.ownership = ownership or PageOwnership()
        self.io = rank_io(host, page_io(host), shard, self.ownership)
        storage.attach_host_buffer(self.io.buffer)
        if sidecar is not None:  # a draft's own objects go and come with every page
            self.io = SidecarIO(self.io, sidecar.host, storage, sidecar.shard, self.ownership)
        self._host_pages = host_pages
        # Two lanes: a prefetch (probe, then read) is on a request's critical path and must never
        # queue behind backups, which pile up under load.
        self._worker = Lane("hicache-l3-backup")
        self._reader = Lane("hicache-l3-prefetch")
        self._backups: list[_Backup] = []
        self.tickets: list[PrefetchTicket] = []  # every prefetch not yet retired, oldest first
        self._window: list[PrefetchTicket] = []  # the tickets of this step's agreement
        self._cursor = 0
        self._reserved = 0
        self._down_until = 0.0
        self._fail_lock = threading.Lock()
        self.agreed_healthy = True
        self.speed = SpeedModel()
        self.failures = self.backed_up_pages = self.prefetched_pages = 0
        self.abandoned = 0  # prefetches whose read was stuck past ``timeout_max`` (``_abandon``)
        self.backup_waits = 0  # prefetches that probed again for pages another node was writing
        self.refused_pages = 0  # CP: prefetched pages not hung, as they would break a path's rotation
        self.decisions = {"wait": 0, "no_wait": 0}
        self.wake: Callable[[], None] = nothing  # the engine's: a request may be waiting on this lane

    @property
    def busy(self) -> bool:
        """Backups or prefetches are in flight."""
        return bool(self._backups or self.tickets)

    @property
    def awaits_peers(self) -> bool:
        """This rank's probe or read of a prefetch ended less than ``PEER_WAIT_S`` ago and the
        ranks have not yet agreed that every rank's did."""
        return any(t.awaits_peers(PEER_WAIT_S) for t in self.tickets)

    @property
    def backups_in_flight(self) -> int:
        return len(self._backups)

    @property
    def healthy(self) -> bool:
        """This rank's circuit breaker is closed (decisions use ``agreed_healthy``)."""
        return time.monotonic() >= self._down_until

    def stats(self) -> dict[str, float]:
        """Its counters for ``/metrics``: pages backed up and prefetched (and, under CP, prefetched
        but refused for another rotation), the ``auto`` policy's decisions, prefetches that waited
        for another node's backup, failures (integrity failures among them), the breaker's state and
        the backups in flight (a stuck store shows); host pages reserved for prefetches, prefetches
        abandoned as stuck and the host pages they hold in quarantine until their reads return."""
        return {"l3_backup_pages_total": self.backed_up_pages, "l3_prefetch_pages_total": self.prefetched_pages,
                "l3_backups_in_flight": float(self.backups_in_flight),
                "l3_prefetch_reserved_pages": float(self._reserved),
                "l3_prefetch_abandoned_total": self.abandoned,
                "l3_prefetch_quarantined_pages": float(sum(map(_quarantined, self.tickets))),
                "l3_prefetch_refused_pages_total": self.refused_pages,
                "l3_prefetch_wait_decisions_total": self.decisions["wait"],
                "l3_prefetch_no_wait_decisions_total": self.decisions["no_wait"],
                "l3_prefetch_backup_waits_total": self.backup_waits,
                "l3_failures_total": self.failures, "l3_healthy": float(self.healthy),
                "l3_read_tokens_per_second": self.read_tokens_per_s(),
                "l3_integrity_failures_total": getattr(self.storage, "integrity_failures", 0)}

    def close(self) -> None:
        """Stops the lanes (a bounded wait, ``close_lanes``), then the store's client; a client with a
        call still in flight on an abandoned lane is not closed under it but left to the process's exit."""
        if close_lanes((self._worker, self._reader), "L3"):
            self.storage.close()

    # -- prefetch --------------------------------------------------------------------------------

    def start(self, token_ids: Sequence[int], salt: str, pending: int = 0) -> PrefetchTicket | None:
        """A ticket when the prompt extends beyond L1 + L2 by at least the threshold; the L3 worker
        then asks the store how much of the rest it has. No L3 call here (engine thread).
        ``pending``: the prompt's leading pages another node is writing to L3 now; the store is
        asked again until it has them, for as long as writing them takes (``PENDING_SLACK``)."""
        ps = self.tree.page_size
        local, total = self.tree.cached_pages(token_ids, salt), len(token_ids) // ps
        if not self.agreed_healthy or (total - local) * ps < self.options.threshold_tokens:
            return None
        keys = page_keys(salted_seed(self.tree.seed, salt), token_ids[: total * ps], ps)[local:]
        timeout = prefetch_timeout(self.options, len(keys) * ps)
        on_way = max(0, min(pending, total) - local)
        ticket = PrefetchTicket(local, keys, timeout, self.options.timeout_max, list(token_ids[: local * ps]), salt,
                                pending=on_way, pending_until=time.monotonic() + self._backup_wait(on_way, timeout))
        self.tickets.append(ticket)
        self._reader.submit(self._probe, ticket).add_done_callback(self._woken)
        return ticket

    def _backup_wait(self, pages: int, timeout: float) -> float:
        """Seconds a probe waits for ``pages`` another node is writing: as long as this node takes
        to write as many (under CP, its ranks write side by side), and never longer than computing
        them here would take (each once measured), nor than the ticket's timeout."""
        share = -(-pages // self.ownership.size)
        write = self.speed.write_seconds(share * self.host.geometry.bytes_per_page)
        compute = self.speed.compute_seconds(pages * self.tree.page_size)
        bounds = [timeout, *([PENDING_SLACK * write + PENDING_FLOOR_S] if write is not None else []),
                  *([compute] if compute is not None else [])]
        return min(bounds)

    def _woken(self, _: Future) -> None:
        """A probe or read ended (any thread): the engine steps now to act on it, not at its next poll."""
        self.wake()

    def _probe(self, ticket: PrefetchTicket) -> None:
        """L3 prefetch lane: how many leading pages the store has (a failure counts as none)."""
        if ticket.cancel.is_set():
            ticket.probed = 0
            return
        try:
            probed, source = self.io.probe(self.storage, ticket.keys)
        except Exception as exc:  # any backend error is a miss
            ticket.probed = 0
            self._fail("exists", exc)
            return
        if ticket.awaits_backup(probed):
            self._probe_later(ticket)
            return
        ticket.source = source  # read only by ``_read``, later on this same lane
        ticket.ended_at = time.monotonic()
        ticket.probed = probed

    def _probe_later(self, ticket: PrefetchTicket) -> None:
        """Probes again after ``PENDING_PROBE_S``, not holding the lane meanwhile: other requests'
        probes and reads go on."""
        if not ticket.awaited:
            ticket.awaited = True
            self.backup_waits += 1
        timer = threading.Timer(PENDING_PROBE_S, self._probe_again, (ticket,))
        timer.daemon = True
        timer.start()

    def _probe_again(self, ticket: PrefetchTicket) -> None:
        try:
            self._reader.submit(self._probe, ticket).add_done_callback(self._woken)
        except RuntimeError:  # the lanes closed meanwhile: nothing will be read
            ticket.probed = 0

    def ready(self, ticket: PrefetchTicket, policy: PrefetchPolicy) -> bool:
        """Whether the request may be admitted now, on agreed values only. No request waits on L3
        for ever: an unhealthy L3 (breaker open) holds none, and past ``timeout_max`` no policy
        waits, ``wait_complete`` included."""
        if not self.agreed_healthy or policy is PrefetchPolicy.BEST_EFFORT or ticket.agreed_overdue >= 2:
            return True
        complete = ticket.agreed_done or (ticket.decided and not ticket.host_pages)
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            return complete
        if policy is PrefetchPolicy.AUTO and ticket.decided and not ticket.wait:
            return True
        return complete or ticket.agreed_overdue >= 1

    def _decide(self, ticket: PrefetchTicket) -> None:
        """Engine thread, on the agreed probe: reserve host pages and start reading, or give up."""
        ticket.decided = True
        ps = self.tree.page_size
        cap = int(self.host.allocator.num_pages * self.options.max_reserved_fraction) - self._reserved
        n = min(ticket.agreed_probed, cap)
        if ticket.consumed or n * ps < self.options.threshold_tokens:
            return
        pages = self._reserve(ticket.prefix, ticket.salt, n)
        if pages is None:
            return
        ticket.keys, ticket.host_pages = ticket.keys[:n], pages
        self._reserved += n
        self._judge(ticket)
        self._reader.submit(self._read, ticket).add_done_callback(self._woken)

    def _judge(self, ticket: PrefetchTicket) -> None:
        """The ``auto`` policy's verdict, agreed: every rank voted in the same step. A request that
        waits does so as under ``timeout`` (the reads are expected to be the faster way, so they
        normally end first; the timeout only bounds a store that is slower than it looked)."""
        ticket.wait = bool(ticket.agreed_vote)
        self.decisions["wait" if ticket.wait else "no_wait"] += 1

    def _vote(self, ticket: PrefetchTicket) -> int:
        """This rank's view of the auto verdict for a probed ticket (1: waiting is worth it). Under
        CP a rank reads only the pages it owns: the time to read the largest rank's share (ranks read
        side by side) against the node computing them all."""
        n = max(ticket.probed, 0)
        share = -(-n // self.ownership.size)
        return int(self.speed.worth_waiting(share, n, self.host.geometry.bytes_per_page, self.tree.page_size))

    def _reserve(self, prefix: Sequence[int], salt: str, n: int) -> list[int] | None:
        """Host pages for ``n`` prefetched pages. Reserving may evict L2, so the local prefix the
        prefetch extends is pinned meanwhile: losing it would make the prefetch useless."""
        anchor = self.tree.match(prefix, salt).last_node if prefix else None
        if anchor is not None:
            self.tree.lock(anchor)
        try:
            return self._host_pages(_last_page(anchor), n)
        finally:
            if anchor is not None:
                self.tree.unlock(anchor)

    def _read(self, ticket: PrefetchTicket) -> None:
        if not ticket.begin():
            return
        page_bytes = self.host.geometry.bytes_per_page
        source = ticket.source or self.io.own

        def read(keys: list[bytes], pages: list[int]) -> list[bool]:
            return self.io.get_into(self.storage, source, keys, pages)

        def record(pages: list[int], seconds: float) -> None:  # the bytes this rank read (CP: its own pages)
            self.speed.record_read(sum(map(self.ownership.owns, pages)) * page_bytes, seconds)

        # Under CP a rank reads one page in ``size``: chunks of ``chunk_pages`` of its own pages, or each
        # rank would make as many calls for its share as a CP=1 node for the whole prompt.
        ticket.run(read, record, chunk_pages(page_bytes) * self.ownership.size)
        ticket.ended_at = time.monotonic()  # before the lane wakes the engine (``_woken``)
        if ticket.failed:
            self._fail("prefetch", None)

    def finish(self, ticket: PrefetchTicket, token_ids: Sequence[int], salt: str) -> int:
        """The request matches now: hangs what every rank agreed arrived under the local match as
        host-only nodes (the reader is not waited for); returns how many pages it contributed."""
        arrived = ticket.agreed_arrived if ticket.host_pages else 0
        ps = self.tree.page_size
        # the match may ask for fewer tokens than the prefetch read (the last token is always computed)
        arrived = max(0, min(arrived, len(token_ids) // ps - ticket.start))
        found = self.tree.match(token_ids[: (ticket.start + arrived) * ps], salt)
        have = found.num_pages
        skip = have - ticket.start  # pages the tree gained meanwhile; negative if it lost some
        if skip < 0 or arrived <= skip:
            self._consume(ticket, [])
            return 0
        keep = ticket.host_pages[skip:arrived]
        if not self._continues(found.last_node, keep):
            self.refused_pages += len(keep)
            self._consume(ticket, [])
            return 0
        self._consume(ticket, keep)
        node = self.tree.add_host_child(found.last_node, token_ids[have * ps : (ticket.start + arrived) * ps], keep)
        node.from_storage = True
        self.prefetched_pages += len(keep)
        return len(keep)

    def _continues(self, node: Node, pages: list[int]) -> bool:
        """Whether ``pages`` hung below ``node`` keep its path one rotation (``docs/cp.md``). They
        continued the rotation of the path the prefetch extended when it was decided, but the tree
        may have changed since (the prefix computed again, by a request of another rotation)."""
        last = _last_page(node)
        return not last or self.ownership.follows(last[0], pages) == len(pages)

    def drop(self, ticket: PrefetchTicket) -> None:
        """The request went away before its match."""
        self._consume(ticket, [])

    def _consume(self, ticket: PrefetchTicket, keep: list[int]) -> None:
        """Stops the reader (without waiting) and sets aside the pages not kept until it stopped."""
        ticket.stop()
        ticket.consumed = True
        kept = set(keep)
        ticket.leftover = [p for p in ticket.host_pages if p not in kept]
        if not ticket.abandoned:  # an abandoned ticket's reservation ended then
            self._reserved -= len(ticket.host_pages)
        self._retire([ticket])

    def _retire(self, tickets: list[PrefetchTicket]) -> None:
        """Drops consumed tickets that no rank still reads into: their leftover pages are free."""
        for ticket in tickets:
            if ticket.consumed and ticket.decided and (ticket.agreed_done or not ticket.host_pages):
                self.host.allocator.free(ticket.leftover)
                ticket.leftover = []
                self.tickets.remove(ticket)

    # -- backup ----------------------------------------------------------------------------------

    def backup(self, node: Node, keys: list[bytes], host_pages: list[int]) -> None:
        """Writes pages just copied to L2 on to L3; ``node`` is pinned and is unpinned when done.
        Decided on the agreed health, so every rank queues the same backups (a rank whose own
        breaker is open skips the write itself, in ``_write``)."""
        if not self.agreed_healthy:
            self.tree.unlock(node)
            return
        self._backups.append(_Backup(node, self._worker.submit(self._write, keys, host_pages)))

    def _write(self, keys: list[bytes], host_pages: list[int]) -> tuple[int, list[bytes]]:
        if not self.healthy:
            return 0, []
        # A put of a stored key is a no-op in stores that say so: no exists call first.
        skip = 0 if self.storage.put_skips_existing else self.io.exists(self.storage, keys)
        started = time.perf_counter()
        stored = [k for at in range(skip, len(keys), BACKUP_CALL_PAGES)
                  for k in self._put(keys[at : at + BACKUP_CALL_PAGES], host_pages[at : at + BACKUP_CALL_PAGES])]
        mine = sum(map(self.ownership.owns, host_pages[skip:]))  # the bytes this rank wrote (CP: its own pages)
        self.speed.record_write(mine * self.host.geometry.bytes_per_page, time.perf_counter() - started)
        return len(stored), keys[:skip] + stored

    def _put(self, keys: list[bytes], host_pages: list[int]) -> list[bytes]:
        """Stores the pages; the keys this rank stored. A CP rank writes, and reports on, only the
        pages it owns (``OwnedShardIO.set_from``): the others' owners store and announce theirs."""
        ok = self.io.set_from(self.storage, keys, host_pages)
        own = [k for k, page in zip(keys, host_pages, strict=True) if self.ownership.owns(page)]
        return [k for k, good in zip(own, ok, strict=True) if good]

    def wait_backups(self, timeout: float) -> None:
        futures.wait([b.future for b in self._backups], timeout=timeout)

    # -- agreement ---------------------------------------------------------------------------------

    def local_state(self) -> list[int]:
        """This rank's view, for the agreement: leading backups done, healthy, then for each ticket
        of this step's window (``WINDOW`` of them, moving on every step so that every prefetch
        progresses; padded) its ``PrefetchTicket`` state: probed + 1, arrived, done, overdue, vote."""
        self._window = self._next_window()
        values = [leading_true(b.future.done() for b in self._backups), int(self.healthy)]
        for i in range(WINDOW):
            t = self._window[i] if i < len(self._window) else None
            values += self._ticket_state(t) if t else [0, 0, 0, 0, 0]
        return values

    def _next_window(self) -> list[PrefetchTicket]:
        n = len(self.tickets)
        if n <= WINDOW:
            return list(self.tickets)
        start, self._cursor = self._cursor % n, self._cursor + WINDOW
        return (self.tickets + self.tickets)[start : start + WINDOW]

    def _ticket_state(self, ticket: PrefetchTicket) -> list[int]:
        """``done`` is read before ``arrived``: the reader stops growing ``arrived`` before it sets
        ``done``, so a done ticket reports its final count (read the other way round, a reader
        finishing in between looked done with pages missing)."""
        done = ticket.finished()
        vote = self._vote(ticket) if ticket.probed >= 0 else 0
        return [ticket.probed + 1, ticket.arrived, int(done), ticket.overdue(), vote]

    def apply(self, agreed: list[int]) -> None:
        """Applies the agreed view: finished backups unpin their nodes; the window's tickets learn
        how far every rank got; probed ones are decided; consumed and stopped ones retire."""
        self._apply_backups(agreed[0])
        self.agreed_healthy = bool(agreed[1])
        for t, i in zip(self._window, range(2, len(agreed), 5), strict=False):
            t.agreed_probed, t.agreed_arrived = agreed[i] - 1, agreed[i + 1]
            t.agreed_done, t.agreed_overdue, t.agreed_vote = bool(agreed[i + 2]), agreed[i + 3], agreed[i + 4]
            if not t.decided and t.agreed_probed >= 0:
                self._decide(t)
            if t.host_pages and t.agreed_overdue >= 2 and not t.agreed_done and not t.abandoned:
                self._abandon(t)
        self._retire([t for t in self._window if t in self.tickets])

    def _abandon(self, ticket: PrefetchTicket) -> None:
        """A read still running on some rank past ``timeout_max`` (agreed, so every rank at once): the
        request computes what did not arrive (``ready`` admits it), the reader is asked to stop and
        its pages leave the prefetch reservations. They are not freed: the stuck call may still
        write into them, so they stay quarantined (``l3_prefetch_quarantined_pages``) until every
        rank's reader returned, then are freed as any consumed ticket's (``_retire``)."""
        ticket.abandoned = True
        ticket.stop()
        self.abandoned += 1
        if not ticket.consumed:  # a consumed ticket's reservation ended at its match
            self._reserved -= len(ticket.host_pages)
        log.warning("L3 prefetch of %d pages stuck past %.0f s: abandoned, the request computes them; its host "
                    "pages are quarantined until the read returns", len(ticket.host_pages), ticket.hard_timeout)

    def _apply_backups(self, done: int) -> None:
        for b in self._backups[:done]:
            self.tree.unlock(b.node)
            if b.future.exception() is not None:
                self._fail("backup", b.future.exception())
            else:
                written, stored = b.future.result()
                self.backed_up_pages += written
                self._announce(stored)
        self._backups = self._backups[done:]

    def _announce(self, keys: list[bytes]) -> None:
        """Tells the KV events' listener that ``keys`` are in L3 (a ``storage`` BlockStored): the
        routers count them at a load cost, not a compute cost, in their TTFT prediction. Not their
        removal: the store evicts on its own, unseen (docs/router.md)."""
        if keys and self.tree.listener is not None:
            self.tree.listener.stored(keys, None, [], CacheTier.STORAGE)

    def read_tokens_per_s(self) -> float:
        """Prompt tokens per second this rank reads from L3, as measured (0 before a read)."""
        return self.speed.read_bps / self.host.geometry.bytes_per_page * self.tree.page_size

    def _fail(self, what: str, exc: BaseException | None) -> None:
        """Any thread: counts the failure and opens the breaker for ``RETRY_AFTER_S``."""
        with self._fail_lock:
            self.failures += 1
            if self.healthy:
                log.warning("L3 %s failed (%s); serving from L1 + L2, retrying L3 in %.0f s", what, exc,
                            RETRY_AFTER_S)
            self._down_until = time.monotonic() + RETRY_AFTER_S


def _quarantined(ticket: PrefetchTicket) -> int:
    """Host pages an abandoned ticket holds only because its stuck read may still write into them:
    what its request did not keep (before its match: what had not arrived)."""
    if not ticket.abandoned:
        return 0
    return len(ticket.leftover) if ticket.consumed else len(ticket.host_pages) - ticket.agreed_arrived


def _last_page(node: Node | None) -> list[int]:
    """The last page of ``node`` (device or host: a page's copies have one owner), whose rotation a
    prefetch under it continues; none at the root."""
    if node is None or node.parent is None:
        return []
    pages = node.device if node.device is not None else node.host
    return list(pages[-1:]) if pages else []
