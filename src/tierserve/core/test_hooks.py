"""Test-only switches: L3 and handoff fault injection and the multi-rank agreement turned off
(``docs/faults.md``, test-only switches). They exist to show a test can fail, so they are reachable
from tests only: the environment variable ``TIERSERVE_TEST_FAULTS`` names a JSON file of them, which
only the test helpers and the benchmarks' test tooling set (never a flag, a config key, the CLI or a
deploy manifest). A node's extra config or a run-time attach that names one is refused: one JSON key
must never turn a production node's safety off."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")  # a rank's command

FAULTS_ENV = "TIERSERVE_TEST_FAULTS"


class FaultSwitch(Enum):
    """A key of the tests' fault file; each is refused in a node's config."""

    SKIP_AGREEMENT = "unsafe_skip_agreement"  # each rank applies its own L3 view, unagreed (ranks diverge)
    STORAGE_FAULTS = "fault_injection"  # a rank's L3 misbehaves (``StorageFaults``)
    HANDOFF_FAULTS = "handoff_faults"  # a prefill node's KV handoffs fail, lag or write wrong bytes (``HandoffFaults``)
    LAG_COMMANDS = "lag_commands"  # a node's ranks 1..N-1 apply these commands late: {command type name: seconds}


JOIN_LAG = "join"  # a ``lag_commands`` key: ranks 1..N-1 sleep after all ranks arrived, before the groups form
JOINED_LAG = "joined"  # ... and this one: they sleep once the groups formed, before their engine's collectives


def refuse_test_switches(config: Mapping[str, Any]) -> None:
    """``ValueError`` naming the first test-only switch that ``config`` (an L3 extra config) holds."""
    for switch in FaultSwitch:
        if switch.value in config:
            raise ValueError(f"{switch.value!r} is a test-only switch, refused in a node's L3 extra config "
                             f"(tests set it through {FAULTS_ENV}; docs/faults.md)")


def injected(switch: FaultSwitch) -> Any:
    """The value the tests' fault file gives ``switch``; None without ``TIERSERVE_TEST_FAULTS`` or
    the key. Read at each call, so a test may change the file between a node's run-time attaches."""
    path = os.environ.get(FAULTS_ENV)
    if not path:
        return None
    return json.loads(Path(path).read_text()).get(switch.value)


def injected_lag(name: str) -> float:
    """Seconds the tests' ``lag_commands`` switch gives ``name`` (a command's type name, ``JOIN_LAG``
    or ``JOINED_LAG``); 0 without it."""
    return float((injected(FaultSwitch.LAG_COMMANDS) or {}).get(name, 0.0))


def lagging(bind: Callable[[C], C]) -> Callable[[C], C]:
    """A follower rank's ``bind`` (``engine/procs/worker.py``) that first sleeps as long as the tests'
    ``lag_commands`` switch says for the command's type, e.g. ``{"StartReserved": 3.0}``: a stage or
    rank slow (or stopped) to apply what rank 0 already applied and answered. ``bind`` itself
    without the switch, read once when the rank starts."""
    lags = injected(FaultSwitch.LAG_COMMANDS) or {}
    if not lags:
        return bind

    def late(command: C) -> C:
        time.sleep(lags.get(type(command).__name__, 0.0))
        return bind(command)

    return late
