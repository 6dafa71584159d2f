"""A rank of a decode node at CP 2, a stage of one at PP 2 and a rank of a prefill node at CP 2, under
load through the router (issue 31), as tests/test_tp_pd_faults.py does at TP 2: the rank is frozen
(SIGSTOP) mid-request, the node says
NOT_SERVING within 5 s and the router stops sending to it; then it is SIGKILLed: the node exits within
30 s with none of its processes left, and every request (non-streaming, so none had been sent
anything) is retried or continued on another pair and answers as the single engine does. One
module-scoped cluster: the victims and a spare node of each role (TP 1) behind one router."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.metrics import find, scrape
from helpers.pd_nodes import load
from helpers.polling import wait_for
from helpers.processes import NodeProcess, RouterProcess
from helpers.rank_faults import (
    DEATH_DEADLINE_S,
    NOT_SERVING,
    UNHEALTHY_WITHIN_S,
    complete,
    fault_node,
    grpc_health,
    word_tokens,
)
from helpers.rank_servers import descendants, rank_pids, wait_exit, wait_gone
from helpers.tiny_models import add_word_tokenizer, make_tiny_model

from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NEW_TOKENS = 60
# the victims, nodes of two ranks: name -> (role, layout)
LAYOUTS = {"decode-cp2": ("decode", ["--cp-size", "2"]), "decode-pp2": ("decode", ["--pp-size", "2"]),
           "prefill-cp2": ("prefill", ["--cp-size", "2"])}
# each victim's own prompts: a prefix the cluster cached in an earlier test would make its prefill too short to catch
PROMPTS = {name: [[2 + (i * 7 + j + 101 * k) % 380 for j in range(40 + 30 * i)] for i in range(6)]
           for k, name in enumerate(LAYOUTS)}


@dataclass(frozen=True)
class Cluster:
    router: RouterProcess
    victims: dict[str, NodeProcess]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """With a tokenizer whose token i is the word ``w<i>``: the answer's text gives its token ids."""
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("cp_pp_faults"), heads=8, kv_heads=4,
                             max_position=2048)
    return add_word_tokenizer(folder)


@pytest.fixture(scope="module")
def expected(model: Path) -> dict[str, list[list[int]]]:
    """The single engine's answers to each victim's prompts (the cluster must give them whichever node dies)."""
    engine = Engine(EngineConfig(model, device="cpu", dtype="float32", page_size=16, max_total_tokens=8192))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return {name: engine.generate(prompts, params) for name, prompts in PROMPTS.items()}


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("cp-pp-faults-logs")
    victims = {name: fault_node(role, model, logs / f"{name}.log", flags) for name, (role, flags) in LAYOUTS.items()}
    others = [fault_node(role, model, logs / f"spare-{role}.log", []) for role in ("decode", "prefill")]
    nodes = [*victims.values(), *others]
    router = None
    try:
        workers = [f for n in nodes for f in (f"--{n.role}", n.wait_ready().address)]
        router = RouterProcess(["--model", str(model), *workers, "--health-check-interval", "0.5", "--max-retries",
                                "4", "--prefill-policy", "round_robin", "--decode-policy", "round_robin"],
                               logs / "router.log").wait_ready()
        yield Cluster(router, victims)
    finally:
        for proc in (*([router] if router else []), *nodes):
            proc.stop()


async def _busy(address: str) -> bool:
    report = await load(address)
    return report.running + report.waiting > 0


def _freeze_and_see_it_dropped(rank1: int, victim: NodeProcess, router: RouterProcess) -> None:
    """SIGSTOP of the victim's rank 1 mid-request: the node, still running, says NOT_SERVING within
    UNHEALTHY_WITHIN_S (rank 0's step is overdue, engine/step_watch.py) and the router stops sending to it."""
    os.kill(rank1, signal.SIGSTOP)
    wait_for(lambda: grpc_health(victim.address) == NOT_SERVING, "the frozen node says NOT_SERVING", UNHEALTHY_WITHIN_S)
    assert victim.proc.poll() is None  # unhealthy, not dead: --dist-timeout (120 s) has not passed
    wait_for(lambda: find(scrape(router.url), "tierserve_worker_available", worker=victim.address) == 0,
             "the router stops sending to the frozen node", 10)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_frozen_then_killed_rank_is_dropped_and_its_requests_retried(cluster: Cluster,
                                                                       expected: dict[str, list[list[int]]],
                                                                       layout: str) -> None:
    victim, router = cluster.victims[layout], cluster.router
    routed_before = len(router.log.read_text())
    processes = descendants(victim.proc.pid)
    (rank1,) = rank_pids(victim.proc.pid, 1)
    try:
        with ThreadPoolExecutor(len(PROMPTS[layout])) as pool:
            futures = [pool.submit(complete, router.url, p, NEW_TOKENS) for p in PROMPTS[layout]]
            wait_for(lambda: _busy(victim.address), "the victim works on a request", 60)
            _freeze_and_see_it_dropped(rank1, victim, router)
            killed = time.monotonic()
            os.kill(rank1, signal.SIGKILL)
            assert wait_exit(victim.proc, DEATH_DEADLINE_S) == 1, victim.log.read_text()[-3000:]
            assert wait_gone(processes, DEATH_DEADLINE_S - (time.monotonic() - killed)) == []
            answers = [word_tokens(f.result(timeout=180)) for f in futures]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank1, signal.SIGKILL)  # never left stopped if the test failed before its kill
    assert answers == expected[layout]
    log = victim.log.read_text()  # the watchdog saw the death, or a collective broke on the dead peer first
    assert "exited with signal SIGKILL" in log or "lost step with the other ranks" in log, log[-3000:]
    # a request D lost before its first token is retried on a new pair; one D already streamed is
    # migrated (router/migration.py): which one the kill catches depends on timing
    routed = router.log.read_text()[routed_before:]
    assert "retrying on a new pair" in routed or "; migrating (" in routed, routed[-3000:]
