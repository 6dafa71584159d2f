"""The same engine code on CUDA (run where a GPU exists: pytest -m gpu)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierserve.cache.options import HiCacheOptions
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_greedy_matches_cpu_and_host_tier_round_trips(tiny_llama: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 384, (n,), generator=gen).tolist() for n in (9, 33, 70)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    cpu = Engine(EngineConfig(tiny_llama, device="cpu", dtype="float32", page_size=16, max_total_tokens=2048))
    cuda = Engine(EngineConfig(tiny_llama, device="cuda", dtype="float32", page_size=16, max_total_tokens=2048,
                               chunked_prefill_size=16, enable_hierarchical_cache=True,
                               hicache=HiCacheOptions(ratio=2.0)))
    assert cuda.pool.buffer.is_cuda and cuda.cache.host.buffer.is_pinned()
    expected = cpu.generate(prompts, params)
    assert cuda.generate(prompts, params) == expected
    assert cuda.generate(prompts, params) == expected  # now with device hits
    assert cuda.stats()["kv_pages_used"] == 0
