"""HiCache L1 + L2 in the engine: host hits give the same outputs as no cache, for every layout,
I/O backend and write policy, and every page is accounted for afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import run_one

from tierserve.cache.options import HostLayout, IOBackend, WritePolicy
from tierserve.engine.config import EngineConfig, HiCacheOptions
from tierserve.engine.engine import Engine
from tierserve.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _prompts() -> tuple[list[int], list[list[int]]]:
    gen = torch.Generator().manual_seed(11)
    target = torch.randint(2, 384, (64,), generator=gen).tolist()
    fillers = [torch.randint(2, 384, (60,), generator=gen).tolist() for _ in range(3)]
    return target, fillers


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> list[int]:
    plain = Engine(EngineConfig(tiny_llama, dtype="float32", page_size=4, max_total_tokens=512,
                                disable_radix_cache=True))
    return plain.generate([_prompts()[0]], PARAMS)[0]


def _engine(model: Path, **options) -> Engine:
    # L1 holds 96 tokens: the fillers push the target's pages out of it
    return Engine(EngineConfig(model, dtype="float32", page_size=4, max_total_tokens=96,
                               enable_hierarchical_cache=True, hicache=HiCacheOptions(ratio=4.0, **options)))


def _run(engine: Engine, prompt: list[int]) -> tuple[list[int], dict[str, int]]:
    return run_one(engine, prompt, PARAMS)


def _settle(engine: Engine) -> None:
    """Lets background L1 -> L2 copies land (they are applied at step boundaries)."""
    engine.cache.wait_background()


def _check_accounting(engine: Engine) -> None:
    cache = engine.cache
    _settle(engine)
    assert engine.stats()["kv_pages_used"] == 0
    assert cache.host.allocator.num_used == len(cache.tree.host_pages())
    cache.evict(engine.allocator.num_pages)
    assert engine.allocator.num_used == 0
    engine.allocator.check()
    cache.host.allocator.check()


@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("backend", list(IOBackend))
def test_host_hit_gives_identical_output(tiny_llama: Path, expected: list[int], layout, backend) -> None:
    engine = _engine(tiny_llama, mem_layout=layout, io_backend=backend)
    target, fillers = _prompts()
    assert _run(engine, target)[0] == expected
    for filler in fillers:
        _settle(engine)
        _run(engine, filler)
    _settle(engine)
    tokens, tiers = _run(engine, target)
    assert tokens == expected
    assert tiers.get("host", 0) >= 32, tiers  # most of the prompt came back from host memory
    stats = engine.stats()
    assert stats["cache_l2_load_pages_total"] >= 8 and stats["cache_l2_write_pages_total"] > 0
    assert stats["cache_device_evicted_pages_total"] > 0 and stats["cache_host_pages_used"] > 0
    _check_accounting(engine)


def test_write_back_copies_only_on_eviction(tiny_llama: Path, expected: list[int]) -> None:
    engine = _engine(tiny_llama, write_policy=WritePolicy.WRITE_BACK)
    target, fillers = _prompts()
    _run(engine, target)
    assert engine.cache.host.allocator.num_used == 0  # nothing copied yet
    for filler in fillers:
        _run(engine, filler)
    assert engine.cache.host.allocator.num_used > 0  # evicted nodes went to L2
    tokens, tiers = _run(engine, target)
    assert tokens == expected and tiers.get("host", 0) > 0
    _check_accounting(engine)


def test_selective_write_through_waits_for_hits(tiny_llama: Path, expected: list[int]) -> None:
    engine = _engine(tiny_llama, write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE, write_threshold=2)
    target, _ = _prompts()
    _run(engine, target)
    _settle(engine)
    assert engine.cache.host.allocator.num_used == 0
    for _ in range(2):
        assert _run(engine, target)[0] == expected
    _settle(engine)
    assert engine.cache.host.allocator.num_used > 0
    _check_accounting(engine)


def test_cache_metrics_are_exported(tiny_llama: Path) -> None:
    from prometheus_client import generate_latest

    from tierserve.engine.metrics import Metrics

    engine = _engine(tiny_llama)
    target, fillers = _prompts()
    for prompt in [target, *fillers, target]:
        _settle(engine)
        _run(engine, prompt)
    text = generate_latest(Metrics(engine).registry).decode()
    for name in ("tierserve_cache_l2_load_pages_total", "tierserve_cache_l2_write_bytes_total",
                 "tierserve_cache_device_evicted_pages_total", "tierserve_cache_host_pages_used"):
        line = next(x for x in text.splitlines() if x.startswith(name + " "))
        assert float(line.split()[1]) > 0, line
