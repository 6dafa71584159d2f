"""The router's request slots (``router/slots.py``): waiting requests get a freed slot by priority
(lower first), equals in arrival order; a waiter cancelled while waiting takes none, and a slot
handed to one as it was cancelled goes on to the next."""

from __future__ import annotations

import asyncio

from tierserve.router.slots import PrioritySlots


async def _queue(slots: PrioritySlots, order: list[str], name: str, priority: int) -> None:
    await slots.acquire(priority)
    order.append(name)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_freed_slot_goes_to_the_most_important_waiter_then_the_earliest() -> None:
    async def run() -> list[str]:
        slots, order = PrioritySlots(1), []
        await slots.acquire(0)
        tasks = [asyncio.create_task(_queue(slots, order, name, prio))
                 for name, prio in [("low-a", 5), ("high-a", 0), ("mid", 2), ("high-b", 0), ("low-b", 5)]]
        await _settle()
        assert slots.waiting == 5 and slots.locked()
        for _ in tasks:
            slots.release()
            await _settle()
        await asyncio.gather(*tasks)
        assert slots.waiting == 0 and slots.locked()  # the last one still holds the slot
        slots.release()
        assert not slots.locked()
        return order

    assert asyncio.run(run()) == ["high-a", "high-b", "mid", "low-a", "low-b"]


def test_a_cancelled_waiter_takes_no_slot() -> None:
    async def run() -> None:
        slots, order = PrioritySlots(1), []
        await slots.acquire(0)
        gone = asyncio.create_task(_queue(slots, order, "gone", 0))
        low = asyncio.create_task(_queue(slots, order, "low", 5))
        await _settle()
        gone.cancel()
        await _settle()
        assert slots.waiting == 1
        slots.release()
        await low
        assert order == ["low"]
        handed = asyncio.create_task(_queue(slots, order, "handed", 0))
        after = asyncio.create_task(_queue(slots, order, "after", 1))
        await _settle()
        slots.release()  # to "handed", which is cancelled before it runs: the slot goes on to "after"
        handed.cancel()
        await _settle()
        assert after.done() and order == ["low", "after"] and slots.free == 0

    asyncio.run(run())
