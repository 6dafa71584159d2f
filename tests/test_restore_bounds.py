"""Every wait on an L2 -> L1 restore is bounded (docs/cache.md, "Loads overlap compute layer by
layer"): a copy that hangs fails its request within the step's bound instead of holding the engine,
a given-up copy stops writing, and the agreement on a step's restores keeps one collective shape."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from tierserve.cache import hicache as hicache_module
from tierserve.cache.loads import HostLoadError, LayerwiseLoad
from tierserve.cache.options import HiCacheOptions
from tierserve.cache.sharded.agreement import SLOTS, SingleRank, agreed_all
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
BOUND_S = 1.0  # the engine's dist timeout: a step's restore waits end after half of it


def test_a_given_up_load_fails_every_wait_and_stops_after_its_current_layer() -> None:
    gate, copied = threading.Event(), []
    load = LayerwiseLoad(3)

    def copy_layer(i: int) -> None:
        copied.append(i)
        gate.wait(10)

    worker = threading.Thread(target=load.run, args=(copy_layer,))
    worker.start()
    with pytest.raises(HostLoadError):
        load.wait(0, 0.05)  # layer 0 is still copying: given up
    assert load.failed and not load.finished()  # still writing its pages
    with pytest.raises(RuntimeError, match="still runs"):
        load.join(0.05)
    gate.set()
    load.join(10)
    worker.join(10)
    assert copied == [0] and load.finished() and not load.done()
    with pytest.raises(HostLoadError):
        load.wait(2)


def test_agreed_all_runs_one_collective_per_slots_flags() -> None:
    calls = []

    class Counting(SingleRank):
        def min(self, values: list[int]) -> list[int]:
            calls.append(len(values))
            return super().min(values)

    flags = [i % 3 != 0 for i in range(SLOTS + 5)]
    assert agreed_all(Counting(), flags) == flags
    assert calls == [SLOTS, 5]


@pytest.fixture()
def engine(tiny_llama: Path) -> Engine:
    # L1 holds 96 tokens: the fillers push the target's pages out of it, into L2
    config = EngineConfig(tiny_llama, dtype="float32", page_size=4, max_total_tokens=96, dist_timeout_s=BOUND_S,
                          enable_hierarchical_cache=True, hicache=HiCacheOptions(ratio=4.0))
    return Engine(config)


def test_a_hung_restore_fails_its_request_within_the_bound_and_the_engine_goes_on(engine: Engine,
                                                                                   monkeypatch) -> None:
    gen = torch.Generator().manual_seed(3)
    target, *fillers = [torch.randint(2, 384, (60,), generator=gen).tolist() for _ in range(3)]
    expected = engine.generate([target], PARAMS)[0]
    for filler in fillers:
        engine.cache.wait_background()
        engine.generate([filler], PARAMS)
    engine.cache.wait_background()
    gate = threading.Event()
    real = hicache_module.copy_pages

    def hung(device, host, device_ids, host_ids, to_host, backend, layers=None) -> None:
        if not to_host:
            gate.wait(30)  # hangs until the test lets it go
        real(device, host, device_ids, host_ids, to_host, backend, layers)

    monkeypatch.setattr(hicache_module, "copy_pages", hung)
    engine.add_request("doomed", target, PARAMS)
    engine.add_request("bystander", list(range(100, 117)), PARAMS)  # nothing cached: must not fail with it
    started = time.monotonic()
    outputs = engine.step()  # the restoring step
    assert time.monotonic() - started < BOUND_S, "the step waited past its bound"
    assert [(rid, type(exc)) for rid, exc in engine.take_failures()] == [("doomed", HostLoadError)]
    assert [out.request_id for out in outputs] == ["bystander"]
    gate.set()  # the copy comes back: it stops after the layer it was copying
    monkeypatch.undo()
    while engine.has_work():
        engine.step()
    assert engine.take_failures() == []
    assert engine.generate([target], PARAMS)[0] == expected  # restored again, correctly
    assert engine.cache.stats()["l2_load_failures_total"] == 1
