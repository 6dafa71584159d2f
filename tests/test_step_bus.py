"""Rank 0's engine loop tells the other ranks everything that changes its engine: every command it
applied, in order, once per loop turn, with whether a step follows; a failed step at several ranks
takes the node down (``docs/ranks.md``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import make_tiny_model

from tierserve.core.sampling import InvalidRequestError, SamplingParams
from tierserve.engine.commands import AHEAD_PROMPT_TOKENS, AbortRequest, AddRequest, EngineCommand
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.loop import EngineLoop
from tierserve.engine.procs.ranks import Ranks
from tierserve.engine.procs.step_bus import LeaderBus
from tierserve.model.parallel import TensorParallel


class RecordingBus:
    """A ``StepBus`` that keeps what it would broadcast."""

    idle_wait: float | None = None

    def __init__(self, engine: Engine | None = None) -> None:
        self.engine = engine
        self.pending: list[EngineCommand] = []
        self.turns: list[tuple[tuple[EngineCommand, ...], bool]] = []
        self.times: list[float] = []
        self.stopped = False
        self.errors: list[BaseException] = []
        self.failures: list[EngineCommand] = []  # commands marked failed on rank 0
        self.ahead: list[tuple[str, bool]] = []  # published ahead: (request, was rank 0's engine holding it then)
        self.late: list[EngineCommand] = []  # published ahead, then failed on rank 0

    def record(self, command: EngineCommand) -> None:
        self.pending.append(command)

    def failed(self) -> None:
        if self.pending:
            self.failures.append(self.pending[-1])
        else:
            self.late.append(self.turns[-1][0][-1])

    def publish(self, step: bool, now: float) -> None:
        self.turns.append((tuple(self.pending), step))
        self.times.append(now)
        self.pending = []

    def publish_ahead(self) -> None:
        request_id = self.pending[-1].request_id
        self.ahead.append((request_id, self.engine is not None and request_id in self.engine.requests))
        self.publish(False, 0.0)

    def stop(self) -> None:
        self.stopped = True

    def lost(self, error: BaseException) -> None:
        self.errors.append(error)


async def _run_two(loop: EngineLoop) -> None:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    async for _ in loop.generate("a", [5, 6, 7], params):
        pass
    stream = loop.generate("b", [8, 9], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    await anext(stream)
    await stream.aclose()  # the client goes: an abort
    await loop.call(lambda engine: None)  # the engine thread took the abort (its queue is FIFO)


def test_every_command_is_published_in_order_before_the_step(tiny_llama: Path) -> None:
    bus = RecordingBus()
    loop = EngineLoop(Engine(EngineConfig(tiny_llama, dtype="float32", max_total_tokens=512)), bus).start()
    try:
        asyncio.run(_run_two(loop))
    finally:
        loop.stop()
    # A command recorded after the last turn may stay unpublished: no step follows it.
    commands = [c for turn, _ in bus.turns for c in turn] + bus.pending
    assert [type(c) for c in commands] == [AddRequest, AddRequest, AbortRequest]
    assert [c.request_id for c in commands] == ["a", "b", "b"]
    first = next(i for i, (turn, _) in enumerate(bus.turns) if turn)
    assert bus.turns[first][1]  # the turn that adds "a" steps it
    assert bus.stopped and not bus.errors
    assert bus.times == sorted(bus.times)  # each turn's clock, for the other ranks' lease expiry


def test_a_failed_step_is_reported_to_the_bus(tiny_llama: Path) -> None:
    bus = RecordingBus()
    engine = Engine(EngineConfig(tiny_llama, dtype="float32", max_total_tokens=512))
    engine.runner.run = lambda *_: (_ for _ in ()).throw(RuntimeError("collective timed out"))  # type: ignore
    loop = EngineLoop(engine, bus).start()

    async def one() -> None:
        async for _ in loop.generate("a", [5, 6, 7], SamplingParams(max_tokens=2)):
            pass

    try:
        with pytest.raises(RuntimeError, match="collective timed out"):
            asyncio.run(one())
    finally:
        loop.stop()
    assert [str(e) for e in bus.errors] == ["collective timed out"]


def test_a_command_that_fails_on_rank_0_is_marked_failed_for_the_other_ranks(tiny_llama: Path) -> None:
    """The other ranks must fail it too (``engine/procs/worker.py``); one that went well is not marked."""
    bus = RecordingBus()
    loop = EngineLoop(Engine(EngineConfig(tiny_llama, dtype="float32", max_total_tokens=512)), bus).start()

    async def run() -> None:
        with pytest.raises(InvalidRequestError, match="the prompt is empty"):
            async for _ in loop.generate("empty", [], SamplingParams(max_tokens=2)):
                pass
        async for _ in loop.generate("fine", [5, 6], SamplingParams(max_tokens=2)):
            pass

    try:
        asyncio.run(run())
    finally:
        loop.stop()
    assert [c.request_id for c in bus.failures] == ["empty"]


def test_a_long_prompt_goes_out_before_rank_0_applies_it_and_its_failure_with_the_next_message(
        tmp_path: Path) -> None:
    """A prompt of ``AHEAD_PROMPT_TOKENS`` is published before rank 0 hashes its pages and starts its
    L3 probe (the other ranks do it beside rank 0: issue 28), and when applying it then raises here,
    the bus marks it for the next message (``StepMessage.late``); a shorter one rides in the turn's
    message, as before."""
    model = make_tiny_model("llama", tmp_path / "llama", max_position=2 * AHEAD_PROMPT_TOKENS)
    engine = Engine(EngineConfig(model, dtype="float32", max_total_tokens=2 * AHEAD_PROMPT_TOKENS + 64))
    bus = RecordingBus(engine)
    loop = EngineLoop(engine, bus).start()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    async def run() -> None:
        for request_id, prompt in (("long", [5] * AHEAD_PROMPT_TOKENS), ("short", [5] * 40)):
            async for _ in loop.generate(request_id, prompt, params):
                pass
        with pytest.raises(InvalidRequestError):  # longer than the model's context: refused on every rank
            async for _ in loop.generate("too-long", [5] * (2 * AHEAD_PROMPT_TOKENS + 1), params):
                pass

    try:
        asyncio.run(run())
    finally:
        loop.stop()
    assert bus.ahead == [("long", False), ("too-long", False)]  # before rank 0's engine had it
    assert [c.request_id for c in bus.late] == ["too-long"] and not bus.failures


def test_a_handoff_cannot_cross_ranks() -> None:
    bus = LeaderBus(Ranks(TensorParallel(0, 2), torch.device("cpu")), on_lost=lambda reason: None)
    with pytest.raises(ValueError, match="KV handoff"):
        bus.record(AddRequest("a", (1, 2), SamplingParams(), handoff=object()))  # type: ignore[arg-type]
    bus.record(AddRequest("b", (1, 2), SamplingParams()))
    bus.record(AddRequest("c", (1, 2), SamplingParams(), handoff=object(), plan="data"))  # type: ignore[arg-type]
    assert [c.handoff for c in bus._pending] == [None, None]  # the plan crosses, rank 0's own handoff does not


def test_the_step_time_crosses_ranks_exactly() -> None:
    """Lease expiry compares times: every rank must see rank 0's float, bit for bit."""
    from tierserve.engine.procs.step_bus import _bits, _float

    for now in (0.0, 12345.678901234567, 1e-300, 987654.3210000001):
        assert _float(_bits(now)) == now
