"""The cluster under test: ``tierserve up`` as a child process, found through its state file
(``docs/cli.md``): every node's PID and ports, so the campaign can kill one, read
its pages from its metrics port, and see ``up`` bring it back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tierserve.core.test_hooks import FAULTS_ENV, FaultSwitch
from tierserve.launch.probes import free_port, grpc_serving, http_ok, tcp_open

HELD_GAUGES = {  # a node at rest holds none of these
    "tierserve_kv_pages_used": "pages", "tierserve_reservations": "reservations",
    "tierserve_reservation_pages_quarantined": "quarantined", "tierserve_handoff_pages_parked": "parked",
    "tierserve_num_requests_running": "running", "tierserve_num_requests_waiting": "waiting",
}


def _handoff_faults(path: Path, rate: float) -> dict[str, str]:
    """The environment entry of a cluster whose prefill nodes fail ``rate`` of their handoffs: a fault
    file at ``path`` (``core/test_hooks.py``; the decode nodes ignore its key); none for 0."""
    if not rate:
        return {}
    path.write_text(json.dumps({FaultSwitch.HANDOFF_FAULTS.value: {"rate": rate}}))
    return {FAULTS_ENV: str(path)}


class Cluster:
    """``tierserve up`` with 2 prefill and 2 decode nodes, L3 and an admin key."""

    admin_key = "reliability-admin"

    def __init__(self, model_dir: Path, workdir: Path, vocab: int, flags: list[str],
                 transfer_fault_rate: float) -> None:
        """``transfer_fault_rate``: that share of the prefill nodes' handoffs fails for real, injected
        through the tests' fault file in ``up``'s environment (``docs/faults.md``: no flag does it)."""
        self.model, self.vocab, self.transfer_fault_rate = model_dir.name, vocab, transfer_fault_rate
        self.state_file, self.log = workdir / "state.json", workdir / "up.log"
        self.url = f"http://127.0.0.1:{free_port()}"
        args = ["--model", str(model_dir), "--port", self.url.rsplit(":", 1)[1], "--prefill-nodes", "2",
                "--decode-nodes", "2", "--admin-api-key", self.admin_key, "--state-file", str(self.state_file),
                *flags]
        env = {**os.environ, **_handoff_faults(workdir / "faults.json", transfer_fault_rate)}
        self.proc = subprocess.Popen([sys.executable, "-m", "tierserve.cli", "up", *args], stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def wait_ready(self, deadline_s: float = 600.0) -> Cluster:
        self._until(lambda: http_ok(f"{self.url}/readiness") and self._all_up(), "the cluster", deadline_s)
        return self

    def _until(self, ready, what: str, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while not ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"tierserve up exited with {self.proc.returncode}; see {self.log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready after {deadline_s:.0f} s; see {self.log}")
            time.sleep(0.1)  # poll interval

    def children(self) -> list[dict]:
        try:
            return json.loads(self.state_file.read_text())["children"]
        except (OSError, ValueError, KeyError):
            return []

    def child(self, name: str) -> dict:
        return next(c for c in self.children() if c["name"] == name)

    def first(self, role: str) -> str:
        """The name of the first child whose name starts with ``role`` (``master``: the master)."""
        return next(c["name"] for c in self.children() if role in c["name"])

    def router_url(self, index: int) -> str:
        """Router ``index``'s URL with ``--routers`` (on ports from the first one's up)."""
        host, port = self.url.rsplit(":", 1)
        return f"{host}:{int(port) + index}"

    def _all_up(self) -> bool:
        children = self.children()
        return bool(children) and all(c["state"] == "running" and c["pid"] for c in children)

    def kill(self, name: str, sig: int) -> None:
        os.kill(self.child(name)["pid"], sig)

    def rank_pid(self, name: str, rank: int) -> int:
        """The PID of rank ``rank`` (>= 1) of node ``name``: its rank processes are its children that are
        not multiprocessing's resource tracker, spawned in rank order (``engine/procs/spawn.py``)."""
        pids = sorted(pid for pid in _descendants(self.child(name)["pid"])
                      if b"resource_tracker" not in _cmdline(pid))
        return pids[rank - 1]

    async def unused_after(self, name: str, deadline_s: float = 10.0) -> float:
        """Seconds from now until the router lists node ``name`` as not available."""
        address, started = f"127.0.0.1:{self.child(name)['grpc_port']}", time.monotonic()
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as client:
            while time.monotonic() - started < deadline_s:
                workers = (await client.get("/workers", headers=self._admin())).json()["workers"]
                if any(w["address"] == address and w["state"] != "healthy" for w in workers):
                    return time.monotonic() - started
                await asyncio.sleep(0.02)  # poll interval
        return float("inf")

    async def wait_back(self, name: str, deadline_s: float = 120.0) -> float:
        """Waits until ``up`` restarted ``name`` and it serves; returns the monotonic time then."""
        def back() -> bool:
            child = self.child(name)
            if child["state"] != "running" or not child["pid"]:
                return False
            if child["role"] == "router":
                return http_ok(f"http://127.0.0.1:{child['http_port']}/readiness")
            port = child["grpc_port"] or child["rpc_port"]
            return grpc_serving(port) if child["grpc_port"] else tcp_open(port)

        await asyncio.to_thread(self._until, back, name, deadline_s)
        await asyncio.to_thread(self._until, lambda: http_ok(f"{self.url}/readiness"), "the router", deadline_s)
        return time.monotonic()

    def _admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def held_pages(self) -> dict[str, dict[str, float]]:
        """Per node, what it still holds for requests (nothing at rest)."""
        held = {}
        for child in self.children():
            if child["metrics_port"] and child["role"] in ("prefill", "decode"):
                values = {k: v for k, v in _gauges(child["metrics_port"]).items() if v}
                if values:
                    held[child["name"]] = values
        return held

    def rss_mb(self) -> float:
        return sum(_rss_mb(c["pid"]) for c in self.children() if c["pid"])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _gauges(port: int) -> dict[str, float]:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {"unreachable": 1.0}
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in HELD_GAUGES:
            values[HELD_GAUGES[name]] = float(value)
    return values


def _rss_mb(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    line = next(x for x in status.splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024



def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended while we read
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
