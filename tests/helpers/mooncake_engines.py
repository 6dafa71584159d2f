"""Engines whose L3 is a real ``mooncake_master``, as the Mooncake tests build them: the sampling
they run, their page and segment sizes, a seeded prompt, and the wait for their backups."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.processes import MasterProcess
from tierserve.cache.options import HiCacheOptions, HostLayout, PrefetchPolicy
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PAGE = 16
SEGMENT = 32 << 20  # per client: a few MiB of pages is all these tests store


def prompt_of(seed: int, n: int) -> list[int]:
    """``n`` random token ids of the tiny models' vocabulary, the same for the same seed."""
    return torch.randint(2, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def plain_engine(model: Path) -> Engine:
    """An engine without any prefix cache: what every cached run must reproduce."""
    return Engine(EngineConfig(model, dtype="float32", page_size=PAGE, max_total_tokens=2048,
                               disable_radix_cache=True))


def l3_engine(model: Path, master: MasterProcess, closing, layout: HostLayout = HostLayout.PAGE_FIRST_DIRECT
              ) -> Engine:
    """An engine with HiCache and L3 on ``master``; its cache is closed by ``closing`` at teardown."""
    config = {"master_server_address": master.address, "global_segment_size": SEGMENT,
              "local_buffer_size": 16 << 20, "prefetch_threshold": 64}
    opts = HiCacheOptions(ratio=2.0, mem_layout=layout, storage_backend="mooncake",
                          storage_config=config, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    engine = Engine(EngineConfig(model, dtype="float32", page_size=PAGE, max_total_tokens=2048,
                                 enable_hierarchical_cache=True, hicache=opts))
    closing(engine.cache)
    return engine


def settle(engine: Engine) -> None:
    """Waits for L2 writes and the L3 backups they start (a failed backup counts as settled)."""
    engine.cache.wait_background()
