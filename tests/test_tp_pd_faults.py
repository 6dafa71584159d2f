"""A rank of a prefill or decode node of several ranks, SIGKILLed under load through the router: the
node exits within 30 s with none of its processes left, and every request (non-streaming, so none
had been sent anything) is retried on the other pair and answers as the single engine does. The
decode node's rank is first frozen (SIGSTOP): the node says NOT_SERVING within 5 s and the router
stops sending to it, still with no request failing."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
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
NEW_TOKENS = 120
PROMPTS = [[2 + (i * 7 + j) % 380 for j in range(40 + 30 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """With a tokenizer whose token i is the word ``w<i>``: the answer's text gives its token ids."""
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("tp_faults"), heads=8, kv_heads=4, max_position=2048)
    return add_word_tokenizer(folder)


@pytest.fixture(scope="module")
def expected(model: Path) -> list[list[int]]:
    """The single engine's answers (both victims' clusters must give them)."""
    engine = Engine(EngineConfig(model, device="cpu", dtype="float32", page_size=16, max_total_tokens=4096))
    return engine.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))


async def _busy(address: str) -> bool:
    report = await load(address)
    return report.running > 0


def _freeze_and_see_it_dropped(rank1: int, victim: NodeProcess, router: RouterProcess) -> None:
    """SIGSTOP of the victim's rank 1 mid-request: the node, still running, says NOT_SERVING within
    UNHEALTHY_WITHIN_S (rank 0's step is overdue, engine/step_watch.py) and the router stops sending to it."""
    os.kill(rank1, signal.SIGSTOP)
    wait_for(lambda: grpc_health(victim.address) == NOT_SERVING, "the frozen node says NOT_SERVING", UNHEALTHY_WITHIN_S)
    assert victim.proc.poll() is None  # unhealthy, not dead: --dist-timeout (120 s) has not passed
    wait_for(lambda: find(scrape(router.url), "tierserve_worker_available", worker=victim.address) == 0,
             "the router stops sending to the frozen node", 10)


@pytest.mark.parametrize("victim_role", ["decode", "prefill"])
def test_a_killed_rank_takes_its_node_down_and_the_router_retries(model: Path, expected: list[list[int]],
                                                                   tmp_path: Path, victim_role: str) -> None:
    other_role = "prefill" if victim_role == "decode" else "decode"
    victim = fault_node(victim_role, model, tmp_path / "victim.log", ["--tp-size", "2"])
    spare = fault_node(victim_role, model, tmp_path / "spare.log", ["--tp-size", "1"])
    other = fault_node(other_role, model, tmp_path / "other.log", ["--tp-size", "1"])
    nodes = [n.wait_ready() for n in (victim, spare, other)]
    workers = [f for n in nodes for f in (f"--{n.role}", n.address)]
    router = RouterProcess(["--model", str(model), *workers, "--health-check-interval", "0.5", "--max-retries", "4",
                            "--prefill-policy", "round_robin", "--decode-policy", "round_robin"], tmp_path / "r.log")
    router.wait_ready()
    processes = descendants(victim.proc.pid)
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(complete, router.url, p, NEW_TOKENS) for p in PROMPTS]
            wait_for(lambda: _busy(victim.address), "the victim works on a request", 60)
            (rank1,) = rank_pids(victim.proc.pid, 1)
            if victim_role == "decode":
                _freeze_and_see_it_dropped(rank1, victim, router)
            killed = time.monotonic()
            os.kill(rank1, signal.SIGKILL)
            assert wait_exit(victim.proc, DEATH_DEADLINE_S) == 1, victim.log.read_text()[-3000:]
            assert wait_gone(processes, DEATH_DEADLINE_S - (time.monotonic() - killed)) == []
            answers = [word_tokens(f.result(timeout=180)) for f in futures]
    finally:
        for proc in (router, *nodes):
            proc.stop()
    assert answers == expected
    log = victim.log.read_text()  # the watchdog saw the death, or a collective broke on the dead peer first
    assert "exited with signal SIGKILL" in log or "lost step with the other ranks" in log, log[-3000:]
    # a request D lost before its first token is retried on a new pair; one D already streamed is
    # migrated (router/migration.py): which one the kill catches depends on timing
    routed = router.log.read_text()
    assert "retrying on a new pair" in routed or "; migrating (" in routed, routed[-3000:]
