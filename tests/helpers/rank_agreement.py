"""Real ranks (gloo, spawned processes) driven step by step, for the agreement tests: the prompt
they share, the loop every rank steps while any has work, the tree each rank holds (as a list or a
digest), and a spawn with a deadline so a hung collective fails the test instead of hanging it."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tierserve.core.sampling import SamplingParams
from tierserve.engine.engine import Engine
from tierserve.engine.procs.ranks import leave
from tierserve.launch import free_port

PAGE = 4
CONTROL_TIMEOUT_S = 6.0  # a negative control's collectives: its diverged ranks wait this out, and it only has to fail
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


def report_and_leave(engine: Engine, out: str, report: dict) -> None:
    """A rank's last act: writes its JSON ``report`` to ``out``, waits for the other ranks (none
    leaves before every one is done), closes its cache and leaves the process group."""
    Path(out).write_text(json.dumps(report))
    engine.ranks.agree_min(0)
    engine.cache.close()
    leave()


def rank_reports(target: Callable[..., None], args: Callable[[int, int, str], tuple], ranks: int, folder: Path,
                 deadline_s: float) -> list[dict]:
    """Runs ``target(*args(rank, port, out))`` in one spawned process per rank (``port``: a fresh one
    for their rendezvous; ``out``: where the rank writes its JSON report), asserts that every rank
    exited 0 (diverged ranks time out or disagree) and returns the reports in rank order."""
    outs = [folder / f"rank{r}.json" for r in range(ranks)]
    port = free_port()
    codes = run_ranks(target, [args(r, port, str(outs[r])) for r in range(ranks)], deadline_s)
    assert codes == [0] * ranks, f"a rank failed (diverged ranks time out or disagree): exit codes {codes}"
    return [json.loads(o.read_text()) for o in outs]


def assert_same_tree_every_step(first: dict, second: dict) -> None:
    """Two stages' results (their ``digests``): as many steps, and the same tree after every one."""
    assert len(first["digests"]) == len(second["digests"])
    for step, (a, b) in enumerate(zip(first["digests"], second["digests"], strict=True)):
        assert a == b, f"the stages' trees differ after step {step}"


def collective_timeout_s(timeout_s: float, agreement_off: bool) -> float:
    """The ranks' collective timeout: ``timeout_s``, or ``CONTROL_TIMEOUT_S`` for a negative control."""
    return CONTROL_TIMEOUT_S if agreement_off else timeout_s


def holds_only_with_the_agreement(agreed: bool, check: Callable[[], None]) -> None:
    """Runs ``check`` (the ranks, then what they must agree on). With the agreement switched off (the
    negative control, each rank applying its own view) the same check must fail: the ranks diverge,
    time out or disagree, so the test can tell the agreement is what holds them together."""
    if agreed:
        check()
        return
    try:
        check()
    except AssertionError:
        return
    raise AssertionError("the ranks stayed together with the agreement switched off: the test cannot fail")
