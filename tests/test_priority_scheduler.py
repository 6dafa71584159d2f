"""``--schedule-policy priority`` on the real scheduler, page allocator and radix cache (no model):
waiting work is admitted by priority (lower first, vLLM's convention; ties in arrival order), and
when pages run out the least important running request is preempted, also for a more important
waiting one."""

from __future__ import annotations

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.radix_cache import RadixCache
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import SchedulePolicy
from tierserve.engine.request import Request, RequestStatus
from tierserve.engine.scheduler import Scheduler, SchedulerConfig

PAGE = 4


def _scheduler(num_pages: int, policy: SchedulePolicy = SchedulePolicy.PRIORITY, budget: int = 64,
               max_running: int = 8) -> Scheduler:
    allocator = PageAllocator(num_pages)
    cache = RadixCache(allocator, PAGE, b"\0" * 32)
    return Scheduler(SchedulerConfig(PAGE, budget, max_running, policy), allocator, cache)


def _request(rid: str, length: int, priority: int = 0, first: int = 1) -> Request:
    # distinct first tokens: no shared prefixes, so the radix cache plays no part
    return Request(rid, [first, *range(100, 100 + length - 1)], SamplingParams(max_tokens=64, priority=priority))


def _step(s: Scheduler) -> list[str]:
    """One step: what ran, each request then advanced by its tokens (as the engine does)."""
    batch = s.schedule()
    for item in batch:
        item.request.advance(item.num_tokens)
        if item.request.num_computed == item.request.num_tokens:
            item.request.output_ids.append(7)  # its sampled token, to be fed next step
    return [item.request.request_id for item in batch]


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    s = _scheduler(num_pages=64, max_running=2)
    for rid, prio in [("low-a", 5), ("high-a", 0), ("mid", 2), ("high-b", 0), ("low-b", 5)]:
        s.add(_request(rid, 6, prio, first=len(s.waiting) + 1))
    assert _step(s) == ["high-a", "high-b"]
    s.remove(s.running[0])
    s.remove(s.running[0])
    assert _step(s) == ["mid", "low-a"]


def test_fcfs_keeps_arrival_order_whatever_the_priority() -> None:
    s = _scheduler(num_pages=64, policy=SchedulePolicy.FCFS, max_running=2)
    for i, (rid, prio) in enumerate([("low", 5), ("high", 0), ("mid", 2)]):
        s.add(_request(rid, 6, prio, first=i + 1))
    assert _step(s) == ["low", "high"]


def test_a_more_important_waiting_request_preempts_the_least_important_running_one() -> None:
    s = _scheduler(num_pages=6)  # two 11-token prompts and their next token fill the 24-token pool
    s.add(_request("low-old", 11, priority=5, first=1))
    s.add(_request("low-new", 11, priority=5, first=2))
    assert _step(s) == ["low-old", "low-new"] and s.allocator.num_free == 0
    s.add(_request("high", 8, priority=0, first=3))
    ran = _step(s)
    assert "high" in ran and "low-new" not in ran  # the newest of the least important went
    victim = next(r for r in s.waiting if r.request_id == "low-new")
    assert victim.status is RequestStatus.WAITING and victim.num_computed == 0 and not victim.pages
    assert s.num_priority_preemptions == 1 and s.num_preemptions == 1


def test_an_equally_important_waiting_request_does_not_preempt() -> None:
    s = _scheduler(num_pages=6)
    s.add(_request("a", 11, priority=1, first=1))
    s.add(_request("b", 11, priority=1, first=2))
    _step(s)
    s.add(_request("c", 8, priority=1, first=3))
    assert "c" not in _step(s)
    assert s.num_preemptions == 0 and [r.request_id for r in s.waiting] == ["c"]


def test_a_growing_request_preempts_the_least_important_not_the_newest() -> None:
    s = _scheduler(num_pages=7)
    s.add(_request("low", 8, priority=9, first=1))
    s.add(_request("high-a", 8, priority=0, first=2))
    s.add(_request("high-b", 11, priority=0, first=3))  # newest; its 12th token needs a 7th page... then more
    _step(s)
    assert s.allocator.num_free == 0
    for _ in range(3):  # decoding: high-b's next pages come from the low one, never from high-a
        _step(s)
    assert [r.request_id for r in s.waiting] == ["low"]
    assert {r.request_id for r in s.running} == {"high-a", "high-b"}
    assert s.num_priority_preemptions == 0 and s.num_preemptions == 1


def test_fcfs_preempts_the_newest_even_if_more_important() -> None:
    s = _scheduler(num_pages=7, policy=SchedulePolicy.FCFS)
    s.add(_request("low", 8, priority=9, first=1))
    s.add(_request("high-a", 8, priority=0, first=2))
    s.add(_request("high-b", 11, priority=0, first=3))
    for _ in range(4):
        _step(s)
    assert "high-b" in [r.request_id for r in s.waiting] and "low" in [r.request_id for r in s.running]


def test_a_more_important_arrival_takes_the_prefill_budget_before_a_less_important_prompt_in_progress() -> None:
    s = _scheduler(num_pages=64, budget=8)
    s.add(_request("low", 40, priority=5, first=1))
    assert _step(s) == ["low"]  # its first 8-token chunk: 32 prompt tokens to go
    s.add(_request("high", 6, priority=0, first=2))
    batch = s.schedule()
    assert [(b.request.request_id, b.num_tokens) for b in batch] == [("high", 6), ("low", 2)]
    fcfs = _scheduler(num_pages=64, policy=SchedulePolicy.FCFS, budget=8)
    fcfs.add(_request("low", 40, priority=5, first=1))
    _step(fcfs)
    fcfs.add(_request("high", 6, priority=0, first=2))
    assert [b.request.request_id for b in fcfs.schedule()] == ["low"]


def test_the_backlog_counts_prompt_tokens_still_to_compute_by_priority_less_what_was_cached() -> None:
    """``Scheduler.backlog`` is what a node reports as its prefill backlog (``LoadReport``)."""
    s = _scheduler(num_pages=64, budget=8)
    s.add(_request("low", 40, priority=5, first=1))
    assert s.backlog() == {5: 40}
    _step(s)  # its first 8-token chunk
    s.add(_request("high", 6, priority=0, first=2))
    assert s.backlog() == {5: 32, 0: 6}
    _step(s)  # high's whole prompt and 2 more of low's: high now decodes, which is no prefill work
    assert s.backlog() == {5: 30}
    s.remove(next(r for r in s.running if r.request_id == "high"))  # its prompt's full page stays cached
    again = _request("again", 10, priority=0, first=2)  # high's 6 tokens and 4 more: one page (4 tokens) held
    s.add(again)
    assert again.cached_at_arrival == PAGE and s.backlog() == {5: 30, 0: 10 - PAGE}
