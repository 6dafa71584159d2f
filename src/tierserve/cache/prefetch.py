"""L3 -> L2 prefetch of one request's pages, read in order on a worker thread."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from tierserve.cache.staging import PageIO
from tierserve.cache.storage import StorageBackend

log = logging.getLogger(__name__)
CHUNK_PAGES = 16  # pages per backend call: few calls (they cost per call), quick to cancel


@dataclass(frozen=True)
class PrefetchOptions:
    """``--hicache-storage-prefetch-policy`` and the timeouts of the ``timeout`` policy
    (``min(timeout_max, timeout_base + timeout_per_ki_token * tokens / 1024)`` seconds)."""

    threshold_tokens: int = 256
    timeout_base: float = 2.0
    timeout_per_ki_token: float = 0.1
    timeout_max: float = 30.0
    max_reserved_fraction: float = 0.5  # of the host pool, across all running prefetches


@dataclass
class Prefetch:
    """Pages ``start .. start + len(keys)`` of a prompt, read into ``host_pages`` in order.

    ``arrived`` only grows and counts a contiguous run from the first page; ``done`` is set when
    the reader stopped (finished, cancelled or failed).
    """

    start: int
    keys: list[bytes]
    host_pages: list[int]
    timeout: float
    arrived: int = 0
    failed: bool = False
    # what every rank agreed on at the last step boundary (see cache.agreement)
    agreed_arrived: int = 0
    agreed_done: bool = False
    agreed_timed_out: bool = False
    created: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    _started: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def timed_out(self) -> bool:
        return time.monotonic() - self.created > self.timeout

    def begin(self) -> bool:
        """Called by the reader before touching the pages: False if already stopped."""
        with self._lock:
            if self.cancel.is_set():
                self.done.set()
                return False
            self._started = True
            return True

    def stop(self) -> None:
        """Stops the reader; returns once it no longer writes the pages (at once if it never
        started, so a queue of slow L3 calls never blocks the caller)."""
        with self._lock:
            self.cancel.set()
            started = self._started
        if started:
            self.done.wait()

    def run(self, storage: StorageBackend, io: PageIO) -> None:
        """Reads the pages in chunks, in order, until all arrived, one is missing, the store fails
        or ``cancel`` is set; ``done`` is set at the end whatever happened."""
        try:
            for at in range(0, len(self.keys), CHUNK_PAGES):
                if self.cancel.is_set():
                    break
                keys = self.keys[at : at + CHUNK_PAGES]
                ok = io.get_into(storage, keys, self.host_pages[at : at + len(keys)])
                good = next((i for i, x in enumerate(ok) if not x), len(ok))
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
