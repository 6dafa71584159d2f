"""Small drivers shared by engine-level tests."""

from __future__ import annotations

import itertools

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
