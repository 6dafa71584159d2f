"""L3 -> L2 prefetch of one request's pages, read in order on a worker thread, and its ticket."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tierserve.cache.sharded.shards import Source

log = logging.getLogger(__name__)
CHUNK_PAGES = 16  # the fewest of a rank's pages per backend call: a call costs about 1 ms besides its bytes
CHUNK_BYTES = 2 << 20  # smaller pages go in calls of about this many bytes (docs/cache.md, prefetch)
MAX_CHUNK_PAGES = 256  # ... and no more pages: quick to cancel, and the arrival counted this often at least


def chunk_pages(page_bytes: int) -> int:
    """A rank's pages per backend call of a prefetch, for pages of ``page_bytes``: ``CHUNK_PAGES``,
    or more where pages are small, so that a call carries about ``CHUNK_BYTES``. Reading a 32K-token
    prompt of 8 KiB pages from L3 in calls of 256 pages instead of 16 took TTFT from 0.21 to 0.14 s
    (benchmarks/RESULTS.md#l3-chunks)."""
    return max(CHUNK_PAGES, min(MAX_CHUNK_PAGES, CHUNK_BYTES // max(page_bytes, 1)))


@dataclass(frozen=True)
class PrefetchOptions:
    """``--hicache-storage-prefetch-policy`` and the timeouts of the ``timeout`` policy
    (``min(timeout_max, timeout_base + timeout_per_ki_token * tokens / 1024)`` seconds)."""

    # Small: the auto policy weighs each prefetch, and a probe is one cheap call off the engine
    # thread; 256 (SGLang's) lost a tenth of a conversation trace's reuse (benchmarks/RESULTS.md).
    threshold_tokens: int = 64
    timeout_base: float = 2.0
    timeout_per_ki_token: float = 0.1
    timeout_max: float = 30.0
    max_reserved_fraction: float = 0.5  # of the host pool, across all running prefetches


@dataclass
class PrefetchTicket:
    """One request's L3 -> L2 prefetch of the prompt's pages from ``start`` on (``keys``): the
    handle ``PrefixCache.prefetch`` gives the engine, which only hands it back (``ready``,
    ``match``, ``cancel``).

    Its life (``docs/cache.md``): the L3 worker asks the store how many leading
    keys it has (``probed``); at a step boundary, on the value every rank agreed, the engine thread
    either gives up (too few pages, no host room: nothing to read) or reserves ``host_pages`` and
    the worker reads them in order (``arrived`` only grows, a contiguous run from the first page;
    ``done`` is set when the reader stopped). The request's match (or its abort) consumes it without
    waiting for the reader; pages it did not keep (``leftover``) are freed once the reader stopped
    on every rank, when the ticket is retired.
    """

    start: int
    keys: list[bytes]
    timeout: float  # seconds from ``created`` after which the ``timeout`` and ``auto`` policies stop waiting
    hard_timeout: float = 30.0  # after this no policy waits, ``wait_complete`` included (a hung store)
    prefix: list[int] = field(default_factory=list)  # the prompt tokens before ``start`` (pinned while reserving)
    salt: str = ""
    # leading ``keys`` another node is writing to L3 now (the router says so): the probe asks again
    # until the store has them or ``pending_until`` (``docs/cache.md``, "Backups in flight")
    pending: int = 0
    pending_until: float = 0.0
    awaited: bool = False  # L3 worker: probed again at least once for pending pages
    ended_at: float = 0.0  # L3 worker: when this rank's probe, then its read, ended (``time.monotonic()``)
    source: Source | None = None  # L3 worker: the objects that hold this rank's heads (set with ``probed``)
    host_pages: list[int] = field(default_factory=list)
    probed: int = -1  # L3 worker: how many leading keys the store has (-1: not asked yet)
    decided: bool = False  # engine thread: read (host pages reserved) or gave up
    wait: bool = True  # the auto policy's agreed verdict: reading beats computing
    consumed: bool = False  # the request matched or went away
    leftover: list[int] = field(default_factory=list)
    arrived: int = 0
    failed: bool = False
    # engine thread: its read was stuck past ``hard_timeout`` on some rank; its host pages are out of the
    # prefetch reservations, quarantined until every rank's reader returned (``StorageTier._abandon``)
    abandoned: bool = False
    # what every rank agreed on at the last step boundary that covered this ticket (see cache/sharded/agreement.py)
    agreed_probed: int = -1
    agreed_arrived: int = 0
    agreed_done: bool = False
    agreed_overdue: int = 0  # the ``overdue`` level every rank reached
    agreed_vote: int = 0  # 1: every rank expects reading to beat computing
    created: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    _started: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def overdue(self) -> int:
        """0: in time; 1: past ``timeout``; 2: past ``hard_timeout`` as well."""
        age = time.monotonic() - self.created
        return int(age > self.timeout) + int(age > self.hard_timeout)

    def awaits_backup(self, probed: int) -> bool:
        """Whether a probe that found ``probed`` pages should be asked again: pages said to be on
        their way are not all there yet, the bound has not passed and the request is still wanted."""
        return probed < self.pending and time.monotonic() < self.pending_until and not self.cancel.is_set()

    def awaits_peers(self, within: float) -> bool:
        """This rank's probe (before the decision) or read (after) ended less than ``within``
        seconds ago, and the ranks have not yet agreed that every rank's did."""
        if time.monotonic() - self.ended_at > within:
            return False
        if not self.decided:
            return self.probed >= 0
        return bool(self.host_pages) and self.done.is_set() and not self.agreed_done

    def finished(self) -> bool:
        """Nothing is or will be read: given up, or the reader stopped (this rank's view)."""
        return self.decided and (not self.host_pages or self.done.is_set())

    def begin(self) -> bool:
        """Called by the reader before touching the pages: False if already stopped."""
        with self._lock:
            if self.cancel.is_set():
                self.done.set()
                return False
            self._started = True
            return True

    def stop(self) -> None:
        """Asks the reader to stop after its current chunk; does not wait (the caller must not reuse
        pages beyond ``agreed_arrived`` until the reader is agreed done)."""
        with self._lock:
            self.cancel.set()
            if not self._started:
                self.done.set()

    def run(self, read: Callable[[list[bytes], list[int]], list[bool]],
            on_chunk: Callable[[list[int], float], None], chunk: int = CHUNK_PAGES) -> None:
        """Reads the pages in chunks of ``chunk`` through ``read(page keys, host pages)`` (per-page
        success), in order, until all arrived, one is missing, the store fails or ``cancel`` is set;
        reports each chunk's host pages that arrived and its seconds; ``done`` is set at the end."""
        try:
            for at in range(0, len(self.keys), chunk):
                if self.cancel.is_set():
                    break
                keys = self.keys[at : at + chunk]
                started = time.perf_counter()
                ok = read(keys, self.host_pages[at : at + len(keys)])
                good = next((i for i, x in enumerate(ok) if not x), len(ok))
                on_chunk(self.host_pages[at : at + good], time.perf_counter() - started)
                self.arrived += good
                if good < len(ok):
                    break
        except Exception as exc:
            log.warning("L3 prefetch failed after %d pages: %s", self.arrived, exc)
            self.failed = True
        finally:
            self.done.set()


def prefetch_timeout(options: PrefetchOptions, num_tokens: int) -> float:
    return min(options.timeout_max, options.timeout_base + options.timeout_per_ki_token * num_tokens / 1024)
