"""The cache's background lanes (``cache/lanes.py``): calls run in order on one thread, each with its
future; closing waits for the queued calls, but a call that never returns is abandoned after the
bound, and its thread does not hold the process's exit."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from tierserve.cache.lanes import Lane, close_lanes


def test_calls_run_in_order_and_close_waits_for_the_queued_ones() -> None:
    lane, ran = Lane("test-lane"), []
    futures = [lane.submit(ran.append, i) for i in range(5)]
    failing = lane.submit(lambda: 1 / 0)
    assert close_lanes([lane], "test", bound_s=10)
    assert ran == [0, 1, 2, 3, 4] and all(f.done() for f in futures)
    with pytest.raises(ZeroDivisionError):
        failing.result()
    with pytest.raises(RuntimeError, match="shut down"):
        lane.submit(print)


def test_a_call_that_never_returns_is_abandoned_after_the_bound() -> None:
    stuck, never = Lane("test-stuck"), threading.Event()
    stuck.submit(never.wait)
    started = time.monotonic()
    assert not close_lanes([stuck, Lane("test-idle")], "test", bound_s=0.2)
    assert time.monotonic() - started < 5
    never.set()


@pytest.mark.integration
def test_an_abandoned_lane_does_not_hold_the_process_exit() -> None:
    code = ("import threading; from tierserve.cache.lanes import Lane, close_lanes; "
            "lane = Lane('x'); lane.submit(threading.Event().wait); print(close_lanes([lane], 'x', 0.1))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
