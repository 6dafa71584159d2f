"""Child processes of ``tierserve up``: started in their own session, their output relayed line by
line with their name, stopped newest first. A child can be started again from its spec."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tierserve.launch.plan import ChildSpec

# Run by a child before it execs its command: Linux sends it SIGTERM if ``tierserve up`` dies (even by
# SIGKILL), so no node outlives the command that started it; if up died already, it does not start.
# Not a ``preexec_fn``: that makes Python fork (not vfork), and gRPC's fork handlers, with up's gRPC
# probes running, can abort the child before its exec (SIGABRT in ev_epoll1_linux.cc: a router that
# died at start in CI; grpc/grpc issue 43055).
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):  # not Linux: Ctrl-C and SIGTERM still stop everything
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""
STOP_GRACE_S = 15.0  # a node drains for 5 s and unmounts its L3 segment before it exits


@dataclass(eq=False)
class Child:
    """One child: its spec, the current process (None before the first start), and what the
    supervisor keeps about its deaths."""

    spec: ChildSpec
    proc: subprocess.Popen | None = None
    restarts: int = 0
    deaths: deque[float] = field(default_factory=deque)  # monotonic times, within the restart window
    restart_at: float | None = None  # set while dead and waiting for its next start

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        """The running process's id; None while dead."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def spawn(self) -> None:
        """Starts the process; must run on the thread that stays alive as long as ``up`` (the
        parent-death signal is tied to the thread that forked)."""
        self.proc = subprocess.Popen(_dying_with_us(self.spec.argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1,
                                     start_new_session=True)  # Ctrl-C reaches us only; we stop in order
        threading.Thread(target=_relay, args=(self.name, self.proc, self.spec.hidden), daemon=True).start()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``STOP_GRACE_S``; returns once the process is gone."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def exit_description(returncode: int | None) -> str:
    """``code 1`` or ``signal SIGKILL`` (Popen gives a signal as a negative code)."""
    if returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-returncode).name}"
    return f"code {returncode}"


class Cluster:
    """The children, in start order; ``stop`` ends them in reverse."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.stopping = threading.Event()

    def launch(self, spec: ChildSpec) -> Child:
        child = Child(spec)
        self.children.append(child)
        child.spawn()
        return child

    def start(self, name: str, args: Sequence[str]) -> Child:
        """A process that is no part of an ``up`` cluster (benchmarks start their own)."""
        return self.launch(ChildSpec(name, None, tuple(args)))

    def dead(self) -> Child | None:
        return next((c for c in self.children if c.exited()), None)

    def stop(self) -> None:
        """Stops the children one by one, newest first, so each can still reach what it depends on
        while it shuts down (the nodes unmount their L3 segments from the master last)."""
        self.stopping.set()
        for child in reversed(self.children):
            child.stop()


def _dying_with_us(argv: Sequence[str]) -> list[str]:
    """``argv`` behind a bare interpreter that sets the parent-death signal, then execs it (same PID)."""
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


def _relay(name: str, proc: subprocess.Popen, hidden: tuple[str, ...] = ()) -> None:
    """Copies a child's output to ours, each line prefixed by its name, but for lines containing
    one of ``hidden`` (known noise, ``ChildSpec.hidden``)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if any(text in line for text in hidden):
            continue
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()
