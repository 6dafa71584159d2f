"""Keeps a started cluster running: a dead child is started again, with the same flags and ports,
after an exponential backoff, while the router fails over to the other nodes and its health checks
pick the node up again. A child that keeps dying is a crash loop, which stops ``up``."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from tierserve.launch.plan import RestartPolicy
from tierserve.launch.process import Child, Cluster, exit_description


class CrashLoop(RuntimeError):
    """One child died ``max_deaths`` times within the restart window."""


class Supervisor:
    """Called on ``up``'s main thread (``tick``), which must be the thread that started the
    children: a restart forks from it. ``changed`` runs after every death and restart (it
    rewrites the state file)."""

    def __init__(self, cluster: Cluster, policy: RestartPolicy, changed: Callable[[], None]) -> None:
        self.cluster, self.policy, self.changed = cluster, policy, changed

    def tick(self, now: float | None = None) -> None:
        """Notices deaths and starts the children whose delay has passed; raises ``CrashLoop``."""
        now = time.monotonic() if now is None else now
        for child in self.cluster.children:
            if child.restart_at is None and child.exited():
                self._died(child, now)
            elif child.restart_at is not None and now >= child.restart_at:
                self._restart(child)

    def _died(self, child: Child, now: float) -> None:
        deaths = self._record_death(child, now)
        how = exit_description(child.returncode)
        if deaths >= self.policy.max_deaths:
            raise CrashLoop(f"{child.name} died {deaths} times within {self.policy.window_s:g} s (last: {how}): "
                            "a crash loop")
        delay = self.policy.delay(deaths)
        child.restart_at = now + delay
        _say(f"{child.name} (pid {child.proc.pid}) exited with {how}; restarting in {delay:.1f} s "
             f"(death {deaths} of {self.policy.max_deaths} allowed within {self.policy.window_s:g} s)")
        self.changed()

    def _record_death(self, child: Child, now: float) -> int:
        """Deaths of this child within the window, this one included."""
        child.deaths.append(now)
        while child.deaths and child.deaths[0] <= now - self.policy.window_s:
            child.deaths.popleft()
        return len(child.deaths)

    def _restart(self, child: Child) -> None:
        child.restart_at = None
        child.restarts += 1
        child.spawn()
        _say(f"{child.name} restarted as pid {child.proc.pid} (same flags and ports)")
        self.changed()


def _say(message: str) -> None:
    print(f"tierserve up: {message}", file=sys.stderr, flush=True)
