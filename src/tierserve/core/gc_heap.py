"""Python's garbage collector in a serving process (``docs/architecture.md``, "The collector").

Everything alive once a process is ready (imported modules, the model, the tokenizer, the pools' and the
tree's bookkeeping) lives until the process exits, yet every full (generation 2) collection walks all of it,
with the GIL held: 118-166 ms per pass in a rank process of the long-context benchmark's tiny model, a stall
that lands on whatever request is in flight, and at several ranks on the whole node (its ranks step in
lockstep). Freezing that heap once at ready leaves collections only what serving allocates since (vLLM and
SGLang do the same). The process's pauses are counted on ``/metrics`` so the claim can be checked in
production.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

GENERATIONS = 3


def freeze_startup_heap() -> int:
    """Collects once (startup garbage must not be frozen), then moves every object alive now to the
    collector's permanent generation; returns how many objects that generation holds. Objects frozen
    are still freed by reference counting; only a cycle among them is never reclaimed. Call once the
    process is ready to serve, before the first request."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GCPauses:
    """Every collection of this process from its creation on: how many, and the seconds each
    generation's passes stopped the interpreter. ``gc.callbacks`` is process-wide, so there is one
    per process (``pauses``)."""

    def __init__(self) -> None:
        self.passes = [0] * GENERATIONS
        self.seconds = [0.0] * GENERATIONS
        self._started = 0.0  # a collection holds the GIL: passes never overlap
        gc.callbacks.append(self._on_pass)

    def _on_pass(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info["generation"]
        self.passes[generation] += 1
        self.seconds[generation] += time.perf_counter() - self._started


_pauses: GCPauses | None = None
_pauses_lock = threading.Lock()


def pauses() -> GCPauses:
    """This process's recorder, made (and its callback added) on the first call."""
    global _pauses
    with _pauses_lock:
        if _pauses is None:
            _pauses = GCPauses()
        return _pauses


class GCCollector:
    """The Prometheus view of this process's collector: passes and pause seconds by generation, and
    the objects frozen at ready (0 until ``freeze_startup_heap`` ran)."""

    def __init__(self) -> None:
        self.pauses = pauses()

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        passes = CounterMetricFamily("tierserve_gc_passes", "Garbage-collector passes of this process, by "
                                     "generation", labels=["generation"])
        seconds = CounterMetricFamily("tierserve_gc_pause_seconds", "Seconds the garbage collector stopped "
                                      "this process, by generation", labels=["generation"])
        for generation in range(GENERATIONS):
            passes.add_metric([str(generation)], self.pauses.passes[generation])
            seconds.add_metric([str(generation)], self.pauses.seconds[generation])
        yield passes
        yield seconds
        yield GaugeMetricFamily("tierserve_gc_frozen_objects", "Objects frozen out of the collector's passes "
                                "when this process became ready", value=gc.get_freeze_count())
