"""Do two L3 readers side by side read a prompt's pages faster than one? (issue 28, from L3 at CP=2)

Raw Mooncake Store clients, no tierserve code in the path: a real ``mooncake_master`` on loopback and
six client processes, each mounting a segment as a node's rank does. ``W1`` puts one prompt's 2048 pages
(8 KiB each: the long-context benchmark's tiny model, 16-token pages); ``W2a`` and ``W2b`` put another's,
every other page each (a CP=2 writer's ranks). Then, in alternating order, ``R1`` reads all of the first
prompt (a CP=1 reader) and ``R2a`` and ``R2b`` read their halves of the second at the same time (a CP=2
reader's ranks), in calls of ``--calls`` pages, fresh keys every repetition. Reported: medians of the
wall time and of the readers' and holders' CPU time (``/proc``).

``--nice N`` lowers the readers' calling threads (``os.setpriority``) for the experiment: the store client
waits for a transfer by polling its status in a loop (``TransferEngineOperationState::wait_for_completion``
without ``USE_EVENT_DRIVEN_COMPLETION``), so each reader's calling thread is busy for its whole read and,
on few cores, takes CPU from the transfer engine's own threads.

    .venv/bin/python benchmarks/l3_readers.py [--calls 16 64] [--repeats 5] [--nice 19]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from l3_store import start_master

PAGE_BYTES = 8192
PAGES = 2048
ROLES = ("W1", "W2a", "W2b", "R1", "R2a", "R2b")


def client(role: str, master: str, jobs: mp.Queue, done: mp.Queue, nice: int) -> None:
    """One store client with a segment and a registered arena of ``PAGES`` pages; runs ``(op, names,
    call)`` jobs (``put`` or ``get`` in calls of ``call`` names) and answers each with its seconds."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    if store.setup("127.0.0.1", "P2PHANDSHAKE", 256 << 20, 64 << 20, "tcp", "", master) != 0:
        raise SystemExit(f"{role}: store setup failed")
    arena = ctypes.create_string_buffer(PAGES * PAGE_BYTES)
    base = ctypes.addressof(arena)
    store.register_buffer(base, PAGES * PAGE_BYTES)
    if nice and role.startswith("R"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)  # this (calling) thread only
    done.put(role)
    while (job := jobs.get()) is not None:
        op, names, call = job
        started = time.perf_counter()
        for at in range(0, len(names), call):
            chunk = names[at : at + call]
            ptrs, sizes = [base + (at + i) * PAGE_BYTES for i in range(len(chunk))], [PAGE_BYTES] * len(chunk)
            got = (store.batch_put_from if op == "put" else store.batch_get_into)(chunk, ptrs, sizes)
            if op == "get" and any(n != PAGE_BYTES for n in got):
                raise SystemExit(f"{role}: a read failed: {got[:4]}")
        done.put(time.perf_counter() - started)
    store.close()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Cluster:
    def __init__(self, master: str, nice: int) -> None:
        self.jobs = {role: mp.Queue() for role in ROLES}
        self.done: mp.Queue = mp.Queue()
        self.procs = {role: mp.Process(target=client, args=(role, master, self.jobs[role], self.done, nice))
                      for role in ROLES}
        for proc in self.procs.values():
            proc.start()
        for _ in ROLES:
            self.done.get(timeout=60)

    def run(self, jobs: dict[str, tuple[str, list[str], int]]) -> tuple[float, float, float]:
        """Runs the jobs at once; wall seconds, and the CPU seconds of the readers and the writers."""
        before = {role: cpu_seconds(p.pid) for role, p in self.procs.items()}
        started = time.perf_counter()
        for role, job in jobs.items():
            self.jobs[role].put(job)
        for _ in jobs:
            self.done.get(timeout=120)
        wall = time.perf_counter() - started
        spent = {role: cpu_seconds(p.pid) - before[role] for role, p in self.procs.items()}
        return wall, sum(v for r, v in spent.items() if r.startswith("R")), sum(v for r, v in spent.items()
                                                                              if r.startswith("W"))

    def stop(self) -> None:
        for queue in self.jobs.values():
            queue.put(None)
        for proc in self.procs.values():
            proc.join(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nice", type=int, default=0)
    args = parser.parse_args()
    master, address = start_master(Path(tempfile.mkdtemp(prefix="l3-readers-")) / "master.log")
    cluster = Cluster(address, args.nice)
    print("| pages per call | readers | wall (ms) | readers' CPU (ms) | holders' CPU (ms) |\n|---:|---|---:|---:|---:|")
    try:
        for call in args.calls:
            times: dict[str, list[tuple[float, float, float]]] = {"one": [], "two": []}
            for rep in range(args.repeats):
                a = [f"A/{call}/{rep}/{i:05d}" for i in range(PAGES)]
                b = [f"B/{call}/{rep}/{i:05d}" for i in range(PAGES)]
                cluster.run({"W1": ("put", a, 1024)})
                cluster.run({"W2a": ("put", b[0::2], 1024), "W2b": ("put", b[1::2], 1024)})
                order = ["one", "two"] if rep % 2 == 0 else ["two", "one"]
                for which in order:
                    jobs = {"R1": ("get", a, call)} if which == "one" else \
                        {"R2a": ("get", b[0::2], call), "R2b": ("get", b[1::2], call)}
                    times[which].append(cluster.run(jobs))
            for which, label in (("one", "one, all pages"), ("two", "two side by side, half each")):
                wall, readers, holders = (statistics.median(t[i] for t in times[which]) for i in range(3))
                print(f"| {call} | {label} | {wall * 1e3:.1f} | {readers * 1e3:.0f} | {holders * 1e3:.0f} |",
                      flush=True)
    finally:
        cluster.stop()
        master.kill()


if __name__ == "__main__":
    main()
