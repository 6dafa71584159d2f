"""Real processes on loopback for integration tests: ``mooncake_master`` and tierserve nodes.
Every start polls readiness against a deadline; every stop waits for the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from helpers.forked import Started, start_cli
from helpers.polling import wait_until
from tierserve.cache.storage.mooncake import MooncakeStorage
from tierserve.launch import free_port, grpc_serving, http_ok, tcp_open


def stop(proc: Started) -> None:
    """SIGTERM, then SIGKILL if it is still running after 20 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def stop_all(procs: Iterable[Started]) -> None:
    """``stop`` for several processes at once: SIGTERM to each, then waits for each, so that their
    shutdowns overlap instead of following one another."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.terminate()
    for proc in running:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class MasterProcess:
    """A real ``mooncake_master`` on loopback ports; ``kill`` and ``start`` keep the same ports."""

    def __init__(self, log: Path) -> None:
        self.binary = str(Path(sys.executable).parent / "mooncake_master")
        self.log, self.rpc_port, self.metrics_port = log, free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def start(self, deadline_s: float = 10.0) -> MasterProcess:
        args = [self.binary, f"--rpc_port={self.rpc_port}", f"--metrics_port={self.metrics_port}"]
        with open(self.log, "ab") as log:  # a file, not a pipe: a chatty process would block on a full pipe
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._ready, "mooncake_master", deadline_s, self.proc, self.log)
        return self

    def _ready(self) -> bool:
        return tcp_open(self.rpc_port) and http_ok(f"http://127.0.0.1:{self.metrics_port}/health")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@contextmanager
def master_running(log: Path) -> Iterator[MasterProcess]:
    """A started ``mooncake_master`` for the block, killed after it."""
    master = MasterProcess(log).start()
    try:
        yield master
    finally:
        master.kill()


@contextmanager
def store_client(master: MasterProcess) -> Iterator[MooncakeStorage]:
    """A client of ``master``'s L3 that lends it no memory (it only asks what is there, or removes)."""
    client = MooncakeStorage(master.address, global_segment_size=0, local_buffer_size=16 << 20)
    try:
        yield client
    finally:
        client.close()


class NodeProcess:
    """``tierserve prefill|decode`` in its own process, ready once its gRPC health says SERVING."""

    def __init__(self, role: str, args: list[str], log: Path, env: dict[str, str] | None = None,
                 port: int | None = None) -> None:
        self.role, self.port, self.log = role, port or free_port(), log
        self.proc = start_cli([role, "--port", str(self.port), *args], log, env)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, deadline_s: float = 120.0) -> NodeProcess:
        wait_until(self._serving, f"{self.role} node", deadline_s, self.proc, self.log)
        return self

    def _serving(self) -> bool:
        return grpc_serving(self.address)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen node cannot act on SIGTERM
        stop(self.proc)


# Tests of the prefill/decode path run it for every request: conditional disaggregation would serve
# their short prompts on the decode node alone. Its own tests (and benchmarks) pass a threshold.
ALWAYS_PD = ["--disaggregation-threshold", "0"]


class RouterProcess:
    """``tierserve router`` in its own process, ready once ``/readiness`` answers 200 (a healthy
    pair) or, with ``need_workers=False``, once ``/health`` does. Always through a prefill node
    unless ``args`` name another ``--disaggregation-threshold``."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port, self.log = free_port(), log
        self.proc = start_cli(["router", "--port", str(self.port), *ALWAYS_PD, *args], log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, need_workers: bool = True, deadline_s: float = 60.0) -> RouterProcess:
        path = "/readiness" if need_workers else "/health"
        wait_until(lambda: self._ok(path), "router", deadline_s, self.proc, self.log)
        return self

    def _ok(self, path: str) -> bool:
        return http_ok(self.url + path)

    def stop(self) -> None:
        stop(self.proc)


class ServeProcess:
    """``tierserve serve`` in its own process, ready once ``/health`` answers 200."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port, self.log = free_port(), log
        self.proc = start_cli(["serve", "--port", str(self.port), "--quiet-access-log", *args], log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, deadline_s: float = 180.0) -> ServeProcess:
        wait_until(lambda: http_ok(self.url + "/health"), "serve", deadline_s, self.proc, self.log)
        return self

    def stop(self) -> None:
        stop(self.proc)


@contextmanager
def node_running(role: str, args: list[str], log: Path) -> Iterator[NodeProcess]:
    """A ready ``tierserve prefill|decode`` for the block, stopped after it."""
    node = NodeProcess(role, args, log)
    try:
        yield node.wait_ready()
    finally:
        node.stop()


@contextmanager
def router_over_pair(model: Path, prefill_args: list[str], decode_args: list[str], router_args: list[str],
                     logs: Path) -> Iterator[tuple[RouterProcess, NodeProcess, NodeProcess]]:
    """A ready prefill node, decode node and a router over them (each given ``--model model`` and
    its own flags; logs in ``logs``) for the block; all three stopped after it."""
    model_flag = ["--model", str(model)]
    prefill = NodeProcess("prefill", [*model_flag, *prefill_args], logs / "prefill.log")
    decode = NodeProcess("decode", [*model_flag, *decode_args], logs / "decode.log")
    router = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        router = RouterProcess([*model_flag, "--prefill", prefill.address, "--decode", decode.address, *router_args],
                               logs / "router.log").wait_ready()
        yield router, prefill, decode
    finally:
        for proc in (router, prefill, decode):
            if proc is not None:
                proc.stop()


def start_up(port: int, *flags: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, list[str]]:
    """``tierserve up`` with ``flags`` (always through a prefill node unless they name another
    ``--disaggregation-threshold``), once it printed its banner; its output lines so far. ``env``
    adds to the test's environment, for ``up`` and so for every node it starts
    (``helpers.injected_faults.node_env``)."""
    cmd = [sys.executable, "-m", "tierserve.cli", "up", "--port", str(port), "--device", "cpu", *ALWAYS_PD, *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("tierserve is up"):
                up.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 300
    while not up.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("tierserve up did not come up:\n" + "".join(lines[-40:]))
    return proc, lines


@contextmanager
def running_up(port: int, *flags: str, env: dict[str, str] | None = None) -> Iterator[list[str]]:
    """``start_up``'s cluster for the block, then stopped with Ctrl-C; yields its output lines
    (they grow while it runs). The output is printed when the block fails; when it passed, ``up``
    must exit cleanly (0) within a minute of the signal."""
    proc, lines = start_up(port, *flags, env=env)
    try:
        yield lines
    except BaseException:
        print("".join(lines[-60:]))
        raise
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, "tierserve up did not exit cleanly on Ctrl-C:\n" + "".join(lines[-40:])


def cmdline(pid: int) -> bytes:
    """The process's command line as /proc holds it (NUL-separated); b"" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def proc_state(pid: int) -> str:
    """The process's state letter (``T``: stopped, ``Z``: ended, not yet reaped); "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def alive(pid: int) -> bool:
    """Running (not a zombie waiting for its parent to reap it)."""
    return proc_state(pid) not in ("", "Z")
