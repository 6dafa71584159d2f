"""L3 behind the host tier: backups after L2 writes, prefetches before admission, and a circuit
breaker so a failing store degrades the cache to L1 + L2 instead of failing requests."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from tierserve.cache.agreement import leading_true
from tierserve.cache.hashing import page_keys, salted_seed
from tierserve.cache.host_pool import HostKVPool
from tierserve.cache.prefetch import Prefetch, PrefetchOptions, prefetch_timeout
from tierserve.cache.radix_tree import Node, RadixTree
from tierserve.cache.staging import page_io
from tierserve.cache.storage import StorageBackend

log = logging.getLogger(__name__)
RETRY_AFTER_S = 5.0


@dataclass
class _Backup:
    node: Node
    future: Future


class StorageTier:
    """Runs every L3 call on one worker thread; the tree changes only on the engine thread
    (``finish``, ``on_step``). Host pages a prefetch reserves are capped by the options.

    Hands the backend the buffer its spans live in (``attach_host_buffer``) before any transfer:
    the host pool itself, or a staging buffer where the layout has no contiguous pages.
    """

    def __init__(self, storage: StorageBackend, host: HostKVPool, tree: RadixTree, options: PrefetchOptions,
                 host_pages: Callable[[int], list[int] | None]) -> None:
        self.storage, self.host, self.tree, self.options = storage, host, tree, options
        self.io = page_io(host)
        storage.attach_host_buffer(self.io.buffer)
        self._host_pages = host_pages
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-l3")
        self._backups: list[_Backup] = []
        self.tickets: list[Prefetch] = []  # running prefetches, oldest first
        self._reserved = 0
        self._down_until = 0.0
        self.failures = 0
        self.backed_up_pages = 0
        self.prefetched_pages = 0

    @property
    def busy(self) -> bool:
        """Backups or prefetches are in flight."""
        return bool(self._backups or self.tickets)

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self._down_until

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self.storage.close()

    # -- prefetch --------------------------------------------------------------------------------

    def start(self, token_ids: Sequence[int], salt: str) -> Prefetch | None:
        """If the prompt extends beyond L1 + L2 by at least the threshold, asks L3 how much of the
        rest it has and, if that is at least the threshold too, reserves host pages for it (they
        may evict L2, so only for pages that exist) and starts reading them in the background."""
        ps = self.tree.page_size
        local, total = self.tree.cached_pages(token_ids, salt), len(token_ids) // ps
        if not self.healthy or (total - local) * ps < self.options.threshold_tokens:
            return None
        keys = page_keys(salted_seed(self.tree.seed, salt), token_ids[: total * ps], ps)[local:]
        try:
            present = self.storage.batch_exists(keys)  # one cheap call; a down store fails fast
        except Exception as exc:  # any backend error is a miss
            self._fail("exists", exc)
            return None
        cap = int(self.host.num_pages * self.options.max_reserved_fraction) - self._reserved
        n = min(present, cap)
        host_pages = self._reserve(token_ids[: local * ps], salt, n) if n * ps >= self.options.threshold_tokens \
            else None
        if host_pages is None:
            return None
        ticket = Prefetch(local, keys[:n], host_pages, prefetch_timeout(self.options, n * ps))
        self._reserved += n
        self.tickets.append(ticket)
        self._worker.submit(self._read, ticket)
        return ticket

    def _reserve(self, prefix: Sequence[int], salt: str, n: int) -> list[int] | None:
        """Host pages for ``n`` prefetched pages. Reserving may evict L2, so the local prefix the
        prefetch extends is pinned meanwhile: losing it would make the prefetch useless."""
        anchor = self.tree.match(prefix, salt).last_node if prefix else None
        if anchor is not None:
            self.tree.lock(anchor)
        try:
            return self._host_pages(n)
        finally:
            if anchor is not None:
                self.tree.unlock(anchor)

    def _read(self, ticket: Prefetch) -> None:
        if not ticket.begin():
            return
        ticket.run(self.storage, self.io)
        if ticket.failed:
            self._fail("prefetch", None)

    def finish(self, ticket: Prefetch, token_ids: Sequence[int], salt: str) -> int:
        """Stops the prefetch, hangs what arrived under the local match as host-only nodes and
        frees the rest of its pages; returns how many pages it contributed."""
        self._stop(ticket)
        ps = self.tree.page_size
        # the match may ask for fewer tokens than the prefetch read (the last token is always computed)
        arrived = max(0, min(ticket.agreed_arrived, len(token_ids) // ps - ticket.start))
        found = self.tree.match(token_ids[: (ticket.start + arrived) * ps], salt)
        have = found.num_pages
        skip = have - ticket.start  # pages the tree gained meanwhile; negative if it lost some
        if skip < 0 or arrived <= skip:
            self.host.allocator.free(ticket.host_pages)
            return 0
        keep = ticket.host_pages[skip:arrived]
        self.host.allocator.free(ticket.host_pages[:skip] + ticket.host_pages[arrived:])
        node = self.tree.add_host_child(found.last_node, token_ids[have * ps : (ticket.start + arrived) * ps], keep)
        node.from_storage = True
        self.prefetched_pages += len(keep)
        return len(keep)

    def drop(self, ticket: Prefetch) -> None:
        self._stop(ticket)
        self.host.allocator.free(ticket.host_pages)

    def _stop(self, ticket: Prefetch) -> None:
        ticket.stop()
        self.tickets.remove(ticket)
        self._reserved -= len(ticket.host_pages)

    # -- backup ----------------------------------------------------------------------------------

    def backup(self, node: Node, keys: list[bytes], host_pages: list[int]) -> None:
        """Writes pages just copied to L2 on to L3; ``node`` is pinned and is unpinned when done."""
        if not self.healthy:
            self.tree.unlock(node)
            return
        self._backups.append(_Backup(node, self._worker.submit(self._write, keys, host_pages)))

    def _write(self, keys: list[bytes], host_pages: list[int]) -> int:
        skip = self.storage.batch_exists(keys)  # L3 often has a shared prefix already
        return sum(self.io.set_from(self.storage, keys[skip:], host_pages[skip:]))

    def wait_backups(self, timeout: float) -> None:
        futures.wait([b.future for b in self._backups], timeout=timeout)

    def local_state(self, max_tickets: int) -> list[int]:
        """This rank's view, for the agreement: leading backups done, then per ticket (oldest
        ``max_tickets``, padded) pages arrived, done, and timed out."""
        values = [leading_true(b.future.done() for b in self._backups)]
        for i in range(max_tickets):
            t = self.tickets[i] if i < len(self.tickets) else None
            values += _ticket_state(t) if t else [0, 0, 0]
        return values

    def apply(self, agreed: list[int]) -> None:
        """Applies the agreed view: finished backups unpin their nodes; tickets learn how far
        every rank got."""
        done, per_ticket = agreed[0], agreed[1:]
        for b in self._backups[:done]:
            self.tree.unlock(b.node)
            if b.future.exception() is not None:
                self._fail("backup", b.future.exception())
            else:
                self.backed_up_pages += b.future.result()
        self._backups = self._backups[done:]
        for t, i in zip(self.tickets, range(0, len(per_ticket), 3), strict=False):
            t.agreed_arrived, t.agreed_done, t.agreed_timed_out = per_ticket[i], bool(per_ticket[i + 1]), \
                bool(per_ticket[i + 2])

    def _fail(self, what: str, exc: BaseException | None) -> None:
        self.failures += 1
        if self.healthy:
            log.warning("L3 %s failed (%s); serving from L1 + L2, retrying L3 in %.0f s", what, exc, RETRY_AFTER_S)
        self._down_until = time.monotonic() + RETRY_AFTER_S


def _ticket_state(ticket: Prefetch) -> list[int]:
    """[arrived, done, timed out]. ``done`` is read before ``arrived``: the reader stops growing
    ``arrived`` before it sets ``done``, so a done ticket reports its final count (read the other
    way round, a reader finishing in between looked done with pages missing)."""
    done = ticket.done.is_set()
    return [ticket.arrived, int(done), int(ticket.timed_out())]
