"""A node of several ranks dies whole: a rank killed with SIGKILL mid-request takes the node down
within 30 s (rank 0 exits non-zero, health stops answering), and no process of it is left, at TP 2
and at TP 2 x CP 2 (the last rank, in neither rank 0's tensor group nor its CP group); a frozen rank
turns the node unhealthy within 5 s, healthy again when it goes on, and takes it down past
--dist-timeout; a TP size the model cannot be split over is refused before any rank starts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers.injected_faults import node_env, write_faults
from helpers.polling import poll, poll_settled, wait_for
from helpers.processes import cmdline, proc_state
from helpers.rank_servers import (
    TPServer,
    descendants,
    rank_pids,
    start_server,
    wait_exit,
    wait_gone,
)
from helpers.tiny_models import add_word_tokenizer, make_tiny_model

from tierserve.cli.main import main
from tierserve.core.test_hooks import JOIN_LAG, JOINED_LAG

pytestmark = pytest.mark.integration
DEATH_DEADLINE_S = 30.0
HELD_FOR_S = 4.0  # twice the --dist-timeout of the slow-start test
UNHEALTHY_WITHIN_S = 5.0  # a frozen rank's node reports unhealthy this soon (docs/ranks.md)
FROZEN_DIST_TIMEOUT_S = 10  # long enough to thaw a rank after its node turned unhealthy


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """With a tokenizer: a stream sends text, so its first chunk arrives with the first token."""
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("tp_llama"), heads=8, kv_heads=4, max_position=4096)
    return add_word_tokenizer(folder)


def _stream_in_background(server: TPServer) -> threading.Event:
    """Starts a long streaming request; the event is set once its first token arrived."""
    streaming = threading.Event()

    def run() -> None:
        body = {"prompt": list(range(2, 60)), "max_tokens": 3000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as reply:
                for _ in reply.iter_lines():
                    streaming.set()
        except httpx.HTTPError:
            pass  # the node died under it: expected

    threading.Thread(target=run, daemon=True).start()
    return streaming


@pytest.mark.parametrize(("cp", "victim"), [(1, "worker"), (1, "rank0"), (2, "worker")],
                         ids=["tp2-worker", "tp2-rank0", "tp2cp2-worker"])
def test_a_killed_rank_takes_the_node_down(model: Path, cp: int, victim: str, tmp_path: Path) -> None:
    server = start_server(model, 2, tmp_path / "serve.log", "--max-total-tokens", "8192",
                          "--cp-size", str(cp)).wait_healthy()
    processes = descendants(server.proc.pid)
    worker = rank_pids(server.proc.pid, 2 * cp - 1)[-1]  # the highest pid: the last rank spawned
    try:
        assert _stream_in_background(server).wait(60), "no token streamed"
        started = time.monotonic()
        os.kill(worker if victim == "worker" else server.proc.pid, signal.SIGKILL)
        status = wait_exit(server.proc, DEATH_DEADLINE_S)
        left = wait_gone(processes, DEATH_DEADLINE_S - (time.monotonic() - started))
    finally:
        server.stop()
    assert status == (1 if victim == "worker" else -signal.SIGKILL), server.log.read_text()[-3000:]
    assert left == []
    assert not server.healthy()
    if victim == "worker":
        log = server.log.read_text()  # the watchdog saw the death, or a collective broke on the dead peer first
        assert "exited with signal SIGKILL" in log or "lost step with the other ranks" in log, log[-3000:]


def _stream_to_end(server: TPServer, max_tokens: int, done: list[str]) -> threading.Event:
    """Starts a streaming request of ``max_tokens``; the event is set at its first token, and ``done``
    gets its finish reason (or the error that ended it)."""
    streaming = threading.Event()

    def run() -> None:
        body = {"prompt": list(range(2, 60)), "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as reply:
                for line in reply.iter_lines():
                    streaming.set()
                    if line.startswith("data: {") and (reason := json.loads(line[6:])["choices"][0]["finish_reason"]):
                        done.append(reason)
        except httpx.HTTPError as exc:
            done.append(repr(exc))

    threading.Thread(target=run, daemon=True).start()
    return streaming


def test_a_frozen_rank_turns_the_node_unhealthy_and_past_the_dist_timeout_takes_it_down(model: Path,
                                                                                         tmp_path: Path) -> None:
    """SIGSTOP of rank 1 while the node is idle: its heartbeat goes stale (engine/procs/heartbeat.py) and the
    idle loop's keep-alive waits on it, so /health answers 503 within UNHEALTHY_WITHIN_S, and 200 once it
    goes on. With a request in flight: rank
    0's step is overdue (engine/step_watch.py), 503 as soon; SIGCONT within --dist-timeout: healthy again and
    the request completes. Stopped again past --dist-timeout: rank 0's collective times out and the node exits 1."""
    server = start_server(model, 2, tmp_path / "serve.log", "--max-total-tokens", "8192",
                          "--dist-timeout", str(FROZEN_DIST_TIMEOUT_S))
    server.wait_healthy()
    processes = descendants(server.proc.pid)
    (worker,) = rank_pids(server.proc.pid, 1)
    done: list[str] = []
    try:
        os.kill(worker, signal.SIGSTOP)
        wait_for(lambda: not server.healthy(), "/health non-200 with rank 1 stopped while idle", UNHEALTHY_WITHIN_S)
        os.kill(worker, signal.SIGCONT)
        wait_for(server.healthy, "/health 200 once rank 1 goes on", 10)
        assert _stream_to_end(server, 200, done).wait(60), "no token streamed"
        os.kill(worker, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(lambda: not server.healthy(), "/health non-200 with rank 1 stopped", UNHEALTHY_WITHIN_S)
        assert time.monotonic() - stopped < FROZEN_DIST_TIMEOUT_S - 3, "thawed too late to test a thaw"
        os.kill(worker, signal.SIGCONT)
        wait_for(server.healthy, "/health 200 once rank 1 goes on", 10)
        wait_for(lambda: done, "the frozen request's end", 120)
        assert done == ["length"], server.log.read_text()[-3000:]
        assert _stream_in_background(server).wait(60), "no token streamed"
        os.kill(worker, signal.SIGSTOP)
        assert wait_exit(server.proc, DEATH_DEADLINE_S) == 1, server.log.read_text()[-3000:]
        assert wait_gone(processes, 10) == []  # the frozen rank was killed, not left stopped
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)
        server.stop()
    log = server.log.read_text()
    assert "past its bound" in log and "healthy again" in log and "lost step with the other ranks" in log


def test_a_rank_slow_to_start_is_waited_for_past_the_dist_timeout(model: Path, tmp_path: Path) -> None:
    """Starting a rank is not a step: a worker frozen before it joins for longer than --dist-timeout
    (as on a loaded machine) still joins when it goes on, and the node serves."""
    server = start_server(model, 2, tmp_path / "serve.log", "--dist-timeout", "2")
    try:
        worker = poll(lambda: _stop_rank(server.proc.pid), lambda pid: pid is not None, "rank 1 spawned", 60,
                      interval_s=0.005)  # stopped before it reached the rendezvous
        time.sleep(HELD_FOR_S)  # the fault's length (past the 2 s timeout), not a wait for readiness
        os.kill(worker, signal.SIGCONT)
        server.wait_healthy()
        assert _stream_in_background(server).wait(60), "no token streamed"
    finally:
        server.stop()


@pytest.mark.parametrize("lag", [JOIN_LAG, JOINED_LAG], ids=["while-the-groups-form", "before-its-engine"])
def test_a_rank_slow_later_in_its_start_is_waited_for_past_the_dist_timeout(model: Path, tmp_path: Path,
                                                                            lag: str) -> None:
    """Every rank arrived, then rank 1 takes longer than --dist-timeout to form the groups (``join``), or,
    the groups formed, to reach its engine's first collective (``joined``): still the start, so the node
    serves. CI failed once with rank 0's gloo connect given up after the 2 s collective timeout, and twice
    with its pool agreement given up so, a rank stopped in the second window."""
    faults = write_faults(tmp_path / "faults.json", lag={lag: HELD_FOR_S})
    server = start_server(model, 2, tmp_path / "serve.log", "--dist-timeout", "2", env=node_env(faults))
    try:
        server.wait_healthy()
        assert _stream_in_background(server).wait(60), "no token streamed"
    finally:
        server.stop()


def _stop_rank(parent: int) -> int | None:
    """SIGSTOPs the node's one other rank once it exists; None while there is none. A child seen with
    the node's command line that then proves not to be a stopped rank (it ended between the read and
    the signal: a short-lived child that had not yet run another program) is let go, and the next
    read tries again (CI failed once with the rank taken for such a child, gone at SIGCONT)."""
    pids = _worker_pids(parent)
    if len(pids) != 1:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pids[0], signal.SIGSTOP)
        state = poll_settled(lambda: proc_state(pids[0]), lambda s: s in ("T", "Z", ""), 1, interval_s=0.001)
        if state == "T" and cmdline(pids[0]) == cmdline(parent):
            return pids[0]
        os.kill(pids[0], signal.SIGCONT)
    return None


def _worker_pids(parent: int) -> list[int]:
    """The node's other ranks: forked on CPU (``spawn.start_method``), so their command line is the
    node's; the node's other children (a short-lived helper a library runs) are not ranks."""
    node = cmdline(parent)
    return [pid for pid in descendants(parent) if cmdline(pid) == node]


def test_a_tp_size_that_does_not_fit_is_refused(model: Path) -> None:
    """8 attention heads cannot be split over 3 ranks: usage error, the numbers named, no rank started."""
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--model", str(model), "--tp-size", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--tp-size 3" in done.stderr and "8 attention heads" in done.stderr


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_node_roles_refuse_a_tp_size_that_does_not_fit(model: Path, role: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Run in this process (torch is loaded here; a process would spend seconds importing it): the
    status a node's process exits with, as serve's above, is what the command raises."""
    with pytest.raises(SystemExit) as refused:
        main([role, "--model", str(model), "--port", "0", "--tp-size", "3"])
    stderr = capsys.readouterr().err
    assert refused.value.code == 2, stderr
    assert "--tp-size 3" in stderr and "8 attention heads" in stderr
