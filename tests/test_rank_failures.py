"""A rank of 1..N-1 says what failed (``engine/procs/worker.py``, ``engine/procs/failure_report.py``,
``docs/ranks.md``): a command whose outcome differs from rank 0's raises ``CommandMismatch`` naming it
and the error (it used to be swallowed, and showed only later as a batch checksum mismatch), and the
error a failing rank reports reaches rank 0's store, for the message rank 0 stops the node with. Unit
tests, one process, no engine: the commands are fakes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch.distributed as dist

from tierserve.engine.commands import CollectiveCall
from tierserve.engine.procs.failure_report import CommandMismatch, report_failure, reported_failures
from tierserve.engine.procs.ranks import RankSpec, rendezvous
from tierserve.engine.procs.step_bus import StepMessage
from tierserve.engine.procs.worker import apply_message


@dataclass(frozen=True)
class Fake:
    request_id: str
    error: str | None = None

    def apply(self, engine: object) -> None:
        if self.error:
            raise ValueError(self.error)


class FailingCollective(CollectiveCall):
    def apply(self, engine: object) -> None:
        raise RuntimeError("every rank fails it, agreed")


def _follow(*commands: object, failed: frozenset[int] = frozenset()) -> None:
    apply_message(None, StepMessage(tuple(commands), failed=failed), lambda c: c)  # type: ignore[arg-type]


def test_the_same_outcome_as_rank_0_is_followed_silently() -> None:
    _follow(Fake("a"), Fake("b", "prompt too long"), FailingCollective(), failed=frozenset({1}))


def test_a_command_failing_only_here_names_itself_and_its_error() -> None:
    with pytest.raises(CommandMismatch, match=r"Fake of request b failed on this rank, not on rank 0: .*out of pages"):
        _follow(Fake("a"), Fake("b", "out of pages"))


def test_a_command_failing_only_on_rank_0_is_a_mismatch_too() -> None:
    with pytest.raises(CommandMismatch, match="Fake of request a failed on rank 0, not on this rank"):
        _follow(Fake("a"), failed=frozenset({0}))


def test_a_failing_ranks_error_reaches_rank_0s_store() -> None:
    store = rendezvous(3, 10)
    assert reported_failures(store, 3) == []
    report_failure(RankSpec(2, 3, store.port, 10), CommandMismatch("AddRequest of request x failed on this rank"))
    assert reported_failures(store, 3) == ["rank 2: CommandMismatch: AddRequest of request x failed on this rank"]
    assert isinstance(store, dist.TCPStore)
