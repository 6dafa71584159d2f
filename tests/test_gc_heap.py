"""The collector in a serving process (``core/gc_heap.py``, docs/architecture.md "The collector"): freezing the
heap alive at ready takes it out of every later pass, and the pauses are counted for ``/metrics``. Run in a
fresh interpreter: freezing the test process's own heap would outlive the test. The processes of a running
cluster are checked in ``test_observability.py``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, json
    from prometheus_client import CollectorRegistry, generate_latest
    from tierserve.core.gc_heap import GCCollector, freeze_startup_heap, pauses

    startup = [{"page": i, "owners": [i]} for i in range(50_000)]  # state that lives as long as the process
    tracked_before = len(gc.get_objects())
    frozen = freeze_startup_heap()
    tracked_after = len(gc.get_objects())
    passes_before = pauses().passes[2]
    served = [[i] for i in range(1_000)]  # what serving allocates since
    gc.collect()
    registry = CollectorRegistry()
    registry.register(GCCollector())
    print(json.dumps({"tracked_before": tracked_before, "frozen": frozen, "tracked_after": tracked_after,
                      "full_passes": pauses().passes[2] - passes_before, "full_seconds": pauses().seconds[2],
                      "metrics": generate_latest(registry).decode()}))
""")


def _run() -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_freezing_takes_the_startup_heap_out_of_every_later_pass_and_the_pauses_are_exported() -> None:
    seen = _run()
    assert seen["tracked_before"] > 100_000  # the dicts and lists above, beside the imports'
    assert seen["frozen"] >= seen["tracked_before"] - 1_000  # all of it but what the collection freed
    assert seen["tracked_after"] < 1_000  # a full pass now walks only what came after
    assert seen["full_passes"] == 1 and seen["full_seconds"] > 0
    metrics = seen["metrics"]
    assert f"tierserve_gc_frozen_objects {float(seen['frozen'])}" in metrics
    assert 'tierserve_gc_passes_total{generation="2"}' in metrics
    assert 'tierserve_gc_pause_seconds_total{generation="2"}' in metrics
