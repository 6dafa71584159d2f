"""A rank of 1..N-1 says what failed (``engine/procs/worker.py``, ``engine/procs/failure_report.py``,
``docs/ranks.md``): a command whose outcome differs from rank 0's raises ``CommandMismatch`` naming it
and the error (it used to be swallowed, and showed only later as a batch checksum mismatch), and the
error a failing rank reports reaches rank 0's store, for the message rank 0 stops the node with. Unit
tests, one process, no engine (the commands are fakes), and one node whose rank 1 fails at start."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
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


def _ahead(*commands: object, then_late: bool) -> None:
    """A message whose last command rank 0 published before applying it, then the next message,
    which says whether it raised on rank 0."""
    unsettled = apply_message(None, StepMessage(tuple(commands), ahead=True), lambda c: c)  # type: ignore[arg-type]
    assert unsettled is not None and unsettled.command is commands[-1]  # not compared yet
    apply_message(None, StepMessage(late=then_late), lambda c: c, unsettled)  # type: ignore[arg-type]


def test_a_command_published_ahead_is_compared_when_rank_0s_outcome_comes() -> None:
    _ahead(Fake("a"), Fake("long"), then_late=False)
    _ahead(Fake("a"), Fake("long", "prompt too long"), then_late=True)
    with pytest.raises(CommandMismatch, match=r"Fake of request long failed on this rank, not on rank 0: .*pages"):
        _ahead(Fake("long", "out of pages"), then_late=False)
    with pytest.raises(CommandMismatch, match="Fake of request long failed on rank 0, not on this rank"):
        _ahead(Fake("long"), then_late=True)


def test_a_failing_ranks_error_reaches_rank_0s_store() -> None:
    store = rendezvous(3, 10)
    assert reported_failures(store, 3) == []
    report_failure(RankSpec(2, 3, store.port, 10), CommandMismatch("AddRequest of request x failed on this rank"))
    assert reported_failures(store, 3) == ["rank 2: CommandMismatch: AddRequest of request x failed on this rank"]
    assert isinstance(store, dist.TCPStore)


NODE_SCRIPT = """
import sys, time
from pathlib import Path
from tierserve.engine.config import EngineConfig
from tierserve.engine.procs.spawn import RankProcesses

if __name__ == "__main__":
    RankProcesses(EngineConfig(Path(sys.argv[1]), device="cuda", tp_size=2), "info")
    time.sleep(60)  # rank 1 fails at once: the watchdog ends this process first
"""


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.is_available(), reason="rank 1 must fail: it asks for a CUDA device there is none of")
def test_rank_0_stops_the_node_naming_the_error_a_failed_rank_reported(tiny_llama: Path, tmp_path: Path) -> None:
    """Both ends in real processes: rank 1 fails before it joins (no CUDA), reports, exits 1; rank 0's
    watchdog stops the node with the exit status and what rank 1 said."""
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tiny_llama)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr[-3000:]
    assert re.search(r"stopping the node: rank-1 \(pid \d+\) exited with status 1; rank 1: \w+: .*cuda", done.stderr,
                     re.IGNORECASE), done.stderr[-3000:]
