"""Small drivers shared by engine-level tests."""

from __future__ import annotations

import itertools

import torch

from tierserve.core.sampling import SamplingParams
from tierserve.core.scope import CacheScope
from tierserve.engine.engine import Engine

_ids = itertools.count()


def run_one(
    engine: Engine, prompt: list[int], params: SamplingParams, cache_salt: str = ""
) -> tuple[list[int], dict[str, int]]:
    """Runs one request to the end: its tokens and where its cached prefix came from."""
    engine.add_request(f"r{next(_ids)}", prompt, params, CacheScope(cache_salt=cache_salt))
    tokens, tiers = [], {}
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
            tiers = out.cached_by_tier
    return tokens, tiers


def spread_prompts(n: int, length: int, seed: int = 5) -> list[list[int]]:
    """``n`` seeded random prompts of ``length``, ``length + 3``, ... tokens (ids 2-383: any tiny model's)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 384, (length + 3 * i,), generator=gen).tolist() for i in range(n)]


def assert_no_pages_held(engine: Engine) -> None:
    """Every used page is one the prefix cache holds: no request left pages behind."""
    engine.allocator.check()
    assert engine.allocator.num_used == engine.cache.num_cached_pages
