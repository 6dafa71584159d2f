"""What starting a multi-rank node costs, by how rank 0 starts the other ranks: ``fork`` (the CPU
default, ``engine/procs/spawn.py`` ``start_method``) against ``spawn`` (CUDA's), side by side,
alternating, on a tiny model: seconds until ``/health`` answers and CPU seconds of the node's
processes by then (the node and its ranks). Usage:
``python benchmarks/rank_start.py --tp-size 2 --rounds 3``"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' tiny-model maker

from helpers.tiny_models import make_tiny_model  # noqa: E402

from tierserve.launch import free_port, http_ok  # noqa: E402

START = ("import sys, tierserve.engine.procs.spawn as s; s.start_method = lambda device: sys.argv[1]; "
         "from tierserve.cli.main import main; sys.exit(main(sys.argv[2:]))")


def cpu_seconds(pid: int) -> float:
    """The process's and its live children's CPU time (rank processes are the node's children)."""
    pids = [pid] + [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                      text=True).stdout.split()]
    total = 0.0
    for p in pids:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / 100
    return total


def start_once(method: str, model: Path, tp: int) -> tuple[float, float]:
    port = free_port()
    args = ["serve", "--model", str(model), "--port", str(port), "--device", "cpu", "--tp-size", str(tp)]
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", START, method, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while not http_ok(f"http://127.0.0.1:{port}/health"):
            if proc.poll() is not None:
                raise RuntimeError(f"the node exited with {proc.returncode}")
            time.sleep(0.05)
        return time.monotonic() - started, cpu_seconds(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model("llama", Path(tmp))
        runs: dict[str, list[tuple[float, float]]] = {"fork": [], "spawn": []}
        for r in range(args.rounds):
            for method in ("fork", "spawn") if r % 2 == 0 else ("spawn", "fork"):
                runs[method].append(start_once(method, model, args.tp_size))
    for method, got in runs.items():
        wall, cpu = statistics.median(w for w, _ in got), statistics.median(c for _, c in got)
        print(f"{method:5s}: ready {wall:5.2f} s, CPU {cpu:5.2f} s "
              f"(medians of {len(got)}: {[(round(w, 2), round(c, 2)) for w, c in got]})")
    f, s = (statistics.median(c for _, c in runs[m]) for m in ("fork", "spawn"))
    print(f"fork / spawn CPU to ready: {f / s:.2f}")


if __name__ == "__main__":
    main()
