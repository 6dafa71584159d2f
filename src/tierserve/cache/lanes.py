"""The cache's background lanes (L1 <-> L2 copies, L3 calls): one thread each, calls run in order, and a
close that waits a bounded time (``docs/faults.md``): a store call that never returns must not keep a node
from stopping."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

log = logging.getLogger(__name__)
CLOSE_BOUND_S = 4.0  # how long a close waits for a tier's lanes: a node stops within 15 s of SIGTERM


class Lane:
    """``ThreadPoolExecutor(max_workers=1)``'s ``submit`` and ``shutdown``, on a daemon thread: a call
    stuck for ever is abandoned by ``close_lanes`` and does not hold the interpreter's exit either (an
    executor's threads are joined at exit, however long they take)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple[Any, ...]] | None] = \
            queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queues ``fn(*args)``; its future holds the result or the exception. ``RuntimeError`` once shut down."""
        if self._closed:
            raise RuntimeError(f"lane {self._thread.name} is shut down")
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Takes no more calls; the queued ones still run. ``wait``: until they ran (unbounded: see
        ``close_lanes``)."""
        if not self._closed:
            self._closed = True
            self._calls.put(None)
        if wait:
            self._thread.join()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if future.set_running_or_notify_cancel():
                _settle(future, fn, args)


def _settle(future: Future, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        result = fn(*args)
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)


class Executor(Protocol):
    def shutdown(self, wait: bool = True) -> None: ...


def close_lanes(lanes: Sequence[Executor], what: str, bound_s: float = CLOSE_BOUND_S) -> bool:
    """Shuts ``lanes`` down, waiting ``bound_s`` at most for their queued calls; False (logged) when
    some still run then: they are abandoned (a ``Lane``'s daemon thread ends with the process)."""
    closer = threading.Thread(target=lambda: [lane.shutdown(wait=True) for lane in lanes],
                              name=f"close-{what}", daemon=True)
    closer.start()
    closer.join(bound_s)
    if closer.is_alive():
        log.warning("abandoning the %s lanes: a call has not returned within %.0f s of close", what, bound_s)
    return not closer.is_alive()
