"""``python -m tierserve.cli ...`` for the tests, forked from an interpreter that has already imported
torch: the same entry point, arguments, environment, working folder and output file as a fresh
process, without paying the imports again. A node's start was ~5 s of CPU, most of it importing
torch and FastAPI; the suite starts hundreds on two cores, so that was a third of its CPU time.

The forking interpreter is multiprocessing's forkserver (one per test worker, started at the first
use, single-threaded when it forks). Only third-party modules are preloaded: tierserve's own are
imported by each child, after its environment is set, as in a fresh process. A started process is a
``ForkedProcess``, which answers what the tests ask of a ``subprocess.Popen``."""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # its exit handler registers first, so ours (below) runs before it
import os
import signal
import subprocess
import sys
from pathlib import Path

# What a node imports that does not read our environment at import: torch (~2.5 s of CPU), numpy,
# FastAPI/pydantic/uvicorn (~0.7 s). Not Mooncake: its libraries start threads at load, and a fork
# keeps only the forking thread.
PRELOAD = ["torch", "numpy", "fastapi", "pydantic", "uvicorn", "tokenizers"]

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)
_started: list[ForkedProcess] = []


class ForkedProcess:
    """A started ``python -m tierserve.cli`` with ``subprocess.Popen``'s ``pid``, ``args``,
    ``returncode`` (negative: the signal that ended it), ``poll``, ``wait`` (``TimeoutExpired`` past
    ``timeout``), ``send_signal``, ``terminate`` and ``kill``."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None, append: bool) -> None:
        self.args = [sys.executable, "-m", "tierserve.cli", *argv]
        spec = (argv, str(log), append, {**os.environ, **(env or {})}, os.getcwd())
        self._process = _context.Process(target=_run_cli, args=spec, name=f"tierserve {argv[0]}")
        self._process.start()
        self.pid = self._process.pid
        _started.append(self)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Started = subprocess.Popen | ForkedProcess  # what a test's process helpers accept, however it was started


def start_cli(argv: list[str], log: Path, env: dict[str, str] | None = None, append: bool = True) -> ForkedProcess:
    """Starts ``tierserve <argv>`` with stdout and stderr to ``log`` (appended to, or truncated with
    ``append=False``); ``env`` adds to the test's environment."""
    return ForkedProcess(argv, log, env, append)


def _run_cli(argv: list[str], log: str, append: bool, env: dict[str, str], cwd: str) -> None:
    """In the child: the fresh process's surroundings, then the console script's ``__main__``. Its
    ``SystemExit`` is the exit status; exit handlers run as at a normal interpreter exit."""
    import runpy

    os.environ.clear()
    os.environ.update(env)
    _thread_count(env)
    os.chdir(cwd)
    _redirect_output(log, append)
    sys.argv = ["tierserve", *argv]
    try:
        runpy.run_module("tierserve.cli", run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()


def _thread_count(env: dict[str, str]) -> None:
    """torch read ``OMP_NUM_THREADS`` once, in the forkserver, with the environment of the first process
    started: a child whose own says otherwise (a benchmark's node of two threads beside one of one) gets its
    count as a fresh process would (unset: one per core, torch's default here)."""
    import torch

    threads = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else os.cpu_count() or 1)


def _redirect_output(log: str, append: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(log, flags, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


@atexit.register
def _kill_leftovers() -> None:
    """A process a failed test left running is killed when the worker exits: multiprocessing would
    otherwise wait for it (registered after multiprocessing's own exit handler, so it runs first)."""
    for proc in _started:
        proc.kill()
