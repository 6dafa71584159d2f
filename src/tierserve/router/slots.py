"""The router's request slots (``--max-running-requests``), handed out by priority (docs/router.md,
"Admission by deadline, and priorities"): a request waiting for a slot is served before every
waiting request less important than it (a lower ``priority`` value is more important, as vLLM's),
equals in arrival order. A FIFO semaphore made a high-priority request wait behind every batch
request that queued first, whatever the nodes' schedulers then did."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    future: asyncio.Future[None] = field(compare=False)


class PrioritySlots:
    """``capacity`` slots; ``acquire`` waits for one (most important waiter first), ``release``
    gives one back. One event loop. A waiter cancelled while waiting takes no slot (one handed to
    it as it was cancelled goes to the next waiter)."""

    def __init__(self, capacity: int) -> None:
        self.free = capacity
        self.waiting = 0  # requests in ``acquire`` now
        self._heap: list[_Waiter] = []  # their waiters, and cancelled ones ``release`` has not popped yet
        self._seq = itertools.count()

    def locked(self) -> bool:
        """No slot is free for a newcomer."""
        return self.free <= 0

    async def acquire(self, priority: int) -> None:
        if self.free > 0 and not self.waiting:
            self.free -= 1
            return
        waiter = _Waiter(priority, next(self._seq), asyncio.get_running_loop().create_future())
        heapq.heappush(self._heap, waiter)
        self.waiting += 1
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release()  # handed a slot as it was cancelled: the next waiter gets it
            raise
        finally:
            self.waiting -= 1

    def release(self) -> None:
        """A slot comes back: to the most important waiter, else to the free count."""
        while self._heap:
            waiter = heapq.heappop(self._heap)
            if not waiter.future.done():
                waiter.future.set_result(None)
                return
        self.free += 1
