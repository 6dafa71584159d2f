"""The tests' channel to the test-only switches (``src/tierserve/core/test_hooks.py``, docs/faults.md):
a JSON file named by ``TIERSERVE_TEST_FAULTS``, in the environment of a node the test starts
(``node_env``) or of a rank process the test spawned itself (``inject_here``). Never a node's flags or
config: a node refuses those keys there."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tierserve.core.test_hooks import FAULTS_ENV, FaultSwitch


def write_faults(path: Path, storage: dict[str, Any] | None = None, skip_agreement: bool = False,
                 handoff: dict[str, float] | None = None, lag: dict[str, float] | None = None) -> Path:
    """Writes the fault file at ``path``: ``storage`` (``StorageFaults``' fields, e.g. ``{"ranks": [1],
    "exists_cap": 6}``), the agreement switched off when ``skip_agreement``, and ``handoff``
    (``HandoffFaults``' fields, e.g. ``{"corrupt_rate": 0.5}``, read by a prefill node at start), and ``lag``
    (seconds a node's ranks 1..N-1 sleep before applying a command, by its type's name, e.g.
    ``{"StartReserved": 3.0}``, read by each rank at start). The
    L3 keys are read again at each cache build and run-time attach, so a test may rewrite it between
    attaches."""
    faults = {FaultSwitch.STORAGE_FAULTS.value: storage, FaultSwitch.SKIP_AGREEMENT.value: skip_agreement,
              FaultSwitch.HANDOFF_FAULTS.value: handoff, FaultSwitch.LAG_COMMANDS.value: lag}
    path.write_text(json.dumps(faults))
    return path


def handoff_env(path: Path, **faults: float) -> dict[str, str]:
    """The environment of a prefill node the test starts whose handoffs get ``faults``
    (``HandoffFaults``' fields: ``rate``, ``delay_s``, ``corrupt_rate``), through a fault file at ``path``."""
    return node_env(write_faults(path, handoff=faults))


def node_env(path: Path) -> dict[str, str]:
    """The environment entry that points a node started by the test at the fault file ``path``."""
    return {FAULTS_ENV: str(path)}


def inject_here(path: Path, storage: dict[str, Any] | None = None, skip_agreement: bool = False) -> None:
    """Writes the fault file and points this process at it: for a rank process the test spawned (never
    the test process itself, whose environment outlives the test); caches built after this see it."""
    os.environ[FAULTS_ENV] = str(write_faults(path, storage, skip_agreement))
