"""Migration through real processes (issue 17 items 1-3): a mooncake_master, a prefill node, a
spare decode node and, per test, a victim decode node and a router that sends every request to the
victim. The victim dies (SIGKILL) or drains (SIGTERM) mid-stream; every request continues on the
spare, re-prefilled from the prompt plus the tokens it produced, and ends as an uninterrupted run
would (greedy, greedy under a grammar, and seeded sampling at temperature 0.8). 16 concurrent
streams: about 2 s of decoding on 2 CPU cores. Gaps and the L3 share of the re-prefill are measured
by ``benchmarks/migration.py``."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from helpers.migration_streams import ARGS, PAGE, Stream, l3_args, model_with_words, prompts, start_all, wait_streaming
from helpers.pd_nodes import metric
from helpers.processes import MasterProcess, NodeProcess, RouterProcess
from helpers.tiny_models import WORD_REGEX

from tierserve.core.constraint import Constraint, ConstraintKind
from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ADMIN = {"Authorization": "Bearer k"}
CONCURRENT, PROMPT, MAX_NEW, CUT = 16, 40, 300, 40  # CUT: tokens every stream got before the fault
CONSTRAINED = 4  # of the 16 streams killed mid-stream: these decode under a grammar


@pytest.fixture(scope="module")
def words(tmp_path_factory) -> Path:
    return model_with_words(tmp_path_factory.mktemp("words"))


@pytest.fixture(scope="module")
def shared(words: Path, tmp_path_factory) -> Iterator[tuple[MasterProcess, NodeProcess, NodeProcess]]:
    """The master, the prefill node (the only L3 segment) and the spare decode node."""
    logs = tmp_path_factory.mktemp("migration")
    master = MasterProcess(logs / "master.log").start()
    prefill = NodeProcess("prefill", ["--model", str(words), *ARGS, *l3_args(master.address, 256 << 20)],
                          logs / "prefill.log")
    spare = NodeProcess("decode", ["--model", str(words), *ARGS, *l3_args(master.address, 0)], logs / "spare.log")
    try:
        yield master, prefill.wait_ready(), spare.wait_ready()
    finally:
        for proc in (prefill, spare):
            proc.stop()
        master.kill()


@pytest.fixture()
def victim(words: Path, shared, tmp_path: Path, request) -> Iterator[tuple[NodeProcess, RouterProcess]]:
    """A decode node and a router that knows it alone (the spare joins just before the fault);
    indirect parameters: more router flags."""
    master, prefill, _ = shared
    node = NodeProcess("decode", ["--model", str(words), *ARGS, *l3_args(master.address, 0)], tmp_path / "victim.log")
    router = None
    try:
        node.wait_ready()
        router = RouterProcess(["--model", str(words), "--prefill", prefill.address, "--decode", node.address,
                                "--admin-api-key", "k", "--health-check-interval", "0.5",
                                *getattr(request, "param", [])],
                               tmp_path / "router.log").wait_ready()
        yield node, router
    finally:
        for proc in (router, node):
            if proc is not None:
                proc.stop()


def reference(model: Path, batch: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """One engine, no fault: what every request must answer."""
    engine = Engine(EngineConfig(model, device="cpu", dtype="float32", page_size=PAGE, max_total_tokens=16384))
    return engine.generate(batch, params)


def body(prompt: list[int], stream: bool, **sampling) -> dict:
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    return {"prompt": prompt, "max_tokens": MAX_NEW, "ignore_eos": True, "stream": stream,
            "temperature": 0, **usage, **sampling}


def fault_midway(router: RouterProcess, spare: NodeProcess, victim: NodeProcess, streams: list[Stream],
                 sig: int, fails: bool = False) -> None:
    """Starts ``streams``, waits until each streaming one got ``CUT`` tokens, adds the spare,
    sends ``sig`` to the victim and waits for every answer (``fails``: none may complete)."""
    threads = start_all(router.url, streams)
    wait_streaming(streams, CUT)
    added = httpx.post(f"{router.url}/workers", json={"role": "decode", "address": spare.address}, headers=ADMIN)
    assert added.status_code == 201 and added.json()["state"] == "healthy", added.text
    victim.signal(sig)
    for thread in threads:
        thread.join(180)
    if fails:
        return
    assert all(s.status == 200 and not s.errors and s.finish_reason == "length" for s in streams), \
        [(s.status, s.errors, s.finish_reason) for s in streams]


def migrated(router: RouterProcess) -> dict:
    return httpx.get(f"{router.url}/debug/state", headers={"Authorization": "Bearer k"}).json()  # an admin route


def test_sigkill_mid_stream_every_request_completes_identically(words: Path, shared, victim) -> None:
    """16 greedy streams, their decode node SIGKILLed after 40 tokens each: all 16 complete with the
    tokens (and the text) of an uninterrupted run, each migrated once, re-prefilled partly from L3.
    The first ``CONSTRAINED`` decode under a regex (docs/structured.md): the spare rebuilds the
    grammar's state from the tokens so far, so they too end as one engine's constrained run."""
    _, _, spare = shared
    node, router = victim
    batch = prompts(CONCURRENT, PROMPT)
    regex = {"structured_outputs": {"regex": WORD_REGEX}}
    streams = [Stream(body(p, stream=True, **(regex if i < CONSTRAINED else {}))) for i, p in enumerate(batch)]
    fault_midway(router, spare, node, streams, signal.SIGKILL)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    expected = reference(words, batch[:CONSTRAINED], replace(params, constraint=Constraint(ConstraintKind.REGEX,
                                                                                           WORD_REGEX)))
    assert all(re.fullmatch(r"( w[2-9][0-9]?)+", s.text) for s in streams[:CONSTRAINED])
    assert [s.tokens for s in streams] == expected + reference(words, batch[CONSTRAINED:], params)
    assert all(s.usage["completion_tokens"] == MAX_NEW and s.usage["prompt_tokens"] == PROMPT for s in streams)
    state = migrated(router)
    assert state["migrations"] == CONCURRENT and state["migrations_by_reason"]["failed"] == CONCURRENT
    resumed = state["recent_migrations"]
    assert all(m["generated"] >= CUT and m["reprefill_tokens"] == PROMPT + m["generated"] for m in resumed)
    assert sum(m["cached_by_tier"].get("storage", 0) for m in resumed) > 0, resumed  # L3 served re-prefills
    assert metric(router, "tierserve_router_migrations_total", reason="failed") == CONCURRENT


def test_sigterm_drains_mid_stream_with_no_failed_request(words: Path, shared, victim) -> None:
    """The same under SIGTERM (a rolling update): the victim hands every stream back, its pages in
    L3 first, and exits; 0 failed, every output as uninterrupted."""
    _, _, spare = shared
    node, router = victim
    batch = prompts(CONCURRENT, PROMPT, seed=1)
    streams = [Stream(body(p, stream=True)) for p in batch]
    fault_midway(router, spare, node, streams, signal.SIGTERM)
    expected = reference(words, batch, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    assert [s.tokens for s in streams] == expected
    state = migrated(router)
    assert state["migrations_by_reason"]["draining"] == CONCURRENT, state["migrations_by_reason"]
    assert node.proc.wait(30) == 0
    assert all(m["cached_by_tier"].get("storage", 0) > 0 for m in state["recent_migrations"]), state


def test_seeded_sampling_survives_a_migration_streamed_or_not(words: Path, shared, victim) -> None:
    """Temperature 0.8 with a fixed seed, four streams and two non-streaming requests: after the
    SIGKILL each answer equals one engine's uninterrupted run with that seed."""
    _, _, spare = shared
    node, router = victim
    batch = prompts(6, PROMPT, seed=2)
    seeded = {"temperature": 0.8, "seed": 1234}
    streams = [Stream(body(p, stream=i < 4, **seeded)) for i, p in enumerate(batch)]
    fault_midway(router, spare, node, streams, signal.SIGKILL)
    expected = reference(words, batch, SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=1234,
                                                      ignore_eos=True))
    assert [s.tokens for s in streams] == expected
    assert migrated(router)["migrations"] == 6


@pytest.mark.parametrize("victim", [["--max-migrations", "0"]], indirect=True)
def test_max_migrations_zero_ends_the_streams_with_an_error(words: Path, shared, victim) -> None:
    """``--max-migrations 0``: a stream whose decode node dies ends with the error event and
    ``finish_reason: "error"`` even with a healthy spare; a non-streaming request gets a 502."""
    _, _, spare = shared
    node, router = victim
    streams = [Stream(body(p, stream=i == 0)) for i, p in enumerate(prompts(2, PROMPT, seed=3))]
    fault_midway(router, spare, node, streams, signal.SIGKILL, fails=True)
    assert streams[0].status == 200 and streams[0].finish_reason == "error", streams[0]
    assert [e["code"] for e in streams[0].errors] == ["decode_failed"]
    assert streams[1].status == 502
    state = migrated(router)
    assert state["migrations"] == 0 and state["migrations_given_up"] == 2
