"""Real ranks (gloo, spawned processes) driven step by step, for the agreement tests: the prompt
they share, the loop every rank steps while any has work, the tree each rank holds (as a list or a
digest), and a spawn with a deadline so a hung collective fails the test instead of hanging it."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import time
from collections.abc import Callable

import torch

from tierserve.core.sampling import SamplingParams
from tierserve.engine.engine import Engine

PAGE = 4
PROMPT = torch.randint(2, 384, (70,), generator=torch.Generator().manual_seed(5)).tolist()  # 17 full pages


def run_agreed(engine: Engine, request_id: str, prompt: list[int], digests: list[str] | None = None,
               count_failures: bool = False, step_seconds: list[float] | None = None
               ) -> tuple[list[int], dict[str, int]]:
    """Runs ``prompt`` to its end, then steps until the cache's copies landed; every rank steps
    while any rank has work (one collective per turn), so the ranks take the same steps. With
    ``digests``, records the tree's digest after every step; with ``count_failures``, a request
    that failed has tiers ``{"failed": 1}``; with ``step_seconds``, each ``step``'s wall time."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    tiers: dict[str, int] = {}
    while engine.ranks.agree_min(-int(engine.has_work())) < 0:
        started = time.perf_counter()
        outputs = engine.step()
        if step_seconds is not None:
            step_seconds.append(time.perf_counter() - started)
        for out in outputs:
            tokens += out.new_token_ids
            tiers = out.cached_by_tier or tiers
        if count_failures:
            tiers = {"failed": 1} if engine.take_failures() else tiers
        if digests is not None:
            digests.append(digest(engine))
    return tokens, tiers


def tree_of(engine: Engine) -> list[tuple[list[int], bool, bool]]:
    """The rank's tree: every node's tokens, and whether it has device and host pages."""
    return sorted((list(n.tokens), n.device is not None, n.host is not None) for n in engine.cache.tree.nodes())


def digest(engine: Engine) -> str:
    """The rank's tree: every node's tokens, device and host pages, and write and load states."""
    nodes = sorted((list(n.tokens), list(n.device or []), list(n.host or []), bool(n.writing),
                    n.loading is not None) for n in engine.cache.tree.nodes())
    return hashlib.sha256(json.dumps(nodes).encode()).hexdigest()[:16]


def run_ranks(target: Callable[..., None], args: list[tuple], deadline_s: float) -> list[int | None]:
    """Runs one spawned process per rank (``target(*args[rank])``) and returns their exit codes; a
    rank still running after ``deadline_s`` is killed."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=deadline_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [p.exitcode for p in procs]


def assert_same_tree_every_step(first: dict, second: dict) -> None:
    """Two stages' results (their ``digests``): as many steps, and the same tree after every one."""
    assert len(first["digests"]) == len(second["digests"])
    for step, (a, b) in enumerate(zip(first["digests"], second["digests"], strict=True)):
        assert a == b, f"the stages' trees differ after step {step}"
