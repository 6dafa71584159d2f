"""Polling with a deadline: the tests wait for a condition, never for a fixed time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from helpers.forked import Started

T = TypeVar("T")


def wait_until(ready: Callable[[], bool], what: str, deadline_s: float,
               proc: Started | None = None,
               log: Path | None = None) -> None:
    """Polls ``ready()`` until it is true; raises ``RuntimeError`` (with the tail of ``log``) when
    ``proc`` exits first and ``TimeoutError`` past the deadline: a process that is not ready."""
    deadline = time.monotonic() + deadline_s
    while not ready():
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {deadline_s} s")
        time.sleep(0.02)  # poll interval, not a wait for readiness


def wait_for(check: Callable[[], object], what: str, deadline_s: float, interval_s: float = 0.05) -> None:
    """Polls ``check()`` (a bool, or an awaitable of one) until it is true; fails the test (an
    ``AssertionError`` naming ``what``) past the deadline."""
    deadline = time.monotonic() + deadline_s
    while not _value(check()):
        assert time.monotonic() < deadline, f"{what} within {deadline_s} s"
        time.sleep(interval_s)  # poll interval


def _value(result: object) -> bool:
    return asyncio.run(result) if asyncio.iscoroutine(result) else bool(result)


def poll(read: Callable[[], T], ready: Callable[[T], object], what: str, deadline_s: float,
         interval_s: float = 0.1) -> T:
    """``read()``'s first value that ``ready`` accepts; fails the test past the deadline, with the
    last value read in the message."""
    deadline = time.monotonic() + deadline_s
    while not ready(value := read()):
        assert time.monotonic() < deadline, f"{what} within {deadline_s} s: {value!r}"
        time.sleep(interval_s)  # poll interval
    return value


def poll_settled(read: Callable[[], T], ready: Callable[[T], object], deadline_s: float,
                 interval_s: float = 0.05) -> T:
    """``read()``'s first value that ``ready`` accepts, or its last one at the deadline: for a
    caller that asserts on the value itself (a counter that stays 0 fails there, with its value)."""
    deadline = time.monotonic() + deadline_s
    while not ready(value := read()) and time.monotonic() < deadline:
        time.sleep(interval_s)  # poll interval
    return value


async def wait_for_async(check: Callable[[], Awaitable[object]], what: str, deadline_s: float,
                         interval_s: float = 0.05) -> None:
    """``wait_for`` on a running event loop: awaits ``check()`` until it is true, yielding the loop
    between polls; fails the test past the deadline."""
    deadline = time.monotonic() + deadline_s
    while not await check():
        assert time.monotonic() < deadline, f"{what} within {deadline_s} s"
        await asyncio.sleep(interval_s)  # poll interval
