"""Migration under a decode node's death or drain (issue 17): concurrent greedy streams through the
router, their decode node SIGKILLed or SIGTERMed midway, every request continued on a spare decode
node. Reports, per fault and over several runs (medians): requests completed and identical to the
uninterrupted run, the longest gap between two tokens of a stream (against the same streams with no
fault), and where the re-prefill (prompt + tokens produced so far) came from: L3, the prefill
node's own L1/L2, or computed. ``--flush-prefill`` empties the prefill node's L1 and L2 just before
the fault, as when another prefill node takes the re-prefill.

    PYTHONPATH=src .venv/bin/python benchmarks/migration.py [--runs 3] [--concurrent 16]

Real processes on loopback (``tests/helpers/processes.py``): a mooncake_master, one prefill node (the only L3
segment: the decode nodes are store clients, so a dead decode node takes nothing of L3 with it), a
spare decode node, and per run a victim decode node and a router that knows only the victim until
just before the fault."""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' node and stream helpers, reused

import helpers.migration_streams as mh  # noqa: E402
from helpers.processes import MasterProcess, NodeProcess, RouterProcess  # noqa: E402

from tierserve.core.sampling import SamplingParams  # noqa: E402
from tierserve.engine.config import EngineConfig  # noqa: E402
from tierserve.engine.engine import Engine  # noqa: E402
from tierserve.proto import tierserve_pb2 as pb  # noqa: E402
from tierserve.proto import tierserve_pb2_grpc as pb_grpc  # noqa: E402

ADMIN = {"Authorization": "Bearer k"}


@dataclass(frozen=True)
class Setup:
    concurrent: int
    prompt: int
    max_tokens: int
    cut: int  # tokens every stream got before the fault


@dataclass
class Run:
    fault: str
    completed: int
    identical: int
    longest_gap_s: float  # over every stream
    median_stream_gap_s: float  # median over streams of each one's longest gap
    reprefill_tokens: int
    by_tier: dict[str, int]

    def share(self, tier: str) -> float:
        return self.by_tier.get(tier, 0) / max(1, self.reprefill_tokens)

    @property
    def cached_share(self) -> float:
        return sum(self.by_tier.values()) / max(1, self.reprefill_tokens)


class Bench:
    def __init__(self, model: Path, logs: Path, setup: Setup) -> None:
        self.model, self.logs, self.setup = model, logs, setup
        self.master = MasterProcess(logs / "master.log").start()
        self.prefill = self._node("prefill", "prefill", 1 << 30)
        self.spare = self._node("decode", "spare", 0)
        self.engine = Engine(EngineConfig(model, device="cpu", dtype="float32", page_size=mh.PAGE,
                                          max_total_tokens=16384))  # the uninterrupted reference
        self.runs = 0

    def _node(self, role: str, name: str, segment: int) -> NodeProcess:
        args = ["--model", str(self.model), *mh.ARGS, *mh.l3_args(self.master.address, segment)]
        return NodeProcess(role, args, self.logs / f"{name}.log").wait_ready()

    def close(self) -> None:
        for proc in (self.prefill, self.spare):
            proc.stop()
        self.master.kill()

    def run(self, fault: str, flush: bool) -> Run:
        """One run on prompts of its own (the prefill node caches what earlier runs re-prefilled)."""
        self.runs += 1
        batch = mh.prompts(self.setup.concurrent, self.setup.prompt, seed=self.runs)
        expected = self.engine.generate(batch, SamplingParams(max_tokens=self.setup.max_tokens, temperature=0,
                                                              ignore_eos=True))
        victim = self._node("decode", f"victim{self.runs}", 0)
        router = RouterProcess(["--model", str(self.model), "--prefill", self.prefill.address, "--decode",
                                victim.address, "--admin-api-key", "k", "--health-check-interval", "0.5"],
                               self.logs / f"router{self.runs}.log").wait_ready()
        try:
            streams = self._streams(router, victim, batch, fault, flush)
            state = httpx.get(f"{router.url}/debug/state").json()
        finally:
            router.stop()
            victim.stop()
        return _summary(fault, streams, expected, state["recent_migrations"])

    def _streams(self, router: RouterProcess, victim: NodeProcess, batch: list[list[int]], fault: str,
                 flush: bool) -> list[mh.Stream]:
        s = self.setup
        streams = [mh.Stream({"prompt": p, "max_tokens": s.max_tokens, "temperature": 0, "ignore_eos": True,
                           "stream": True}) for p in batch]
        threads = mh.start_all(router.url, streams)
        if fault != "none":
            mh.wait_streaming(streams, s.cut)
            httpx.post(f"{router.url}/workers", json={"role": "decode", "address": self.spare.address},
                       headers=ADMIN).raise_for_status()
            if flush:
                asyncio.run(_flush(self.prefill.address))
            victim.signal(signal.SIGKILL if fault == "sigkill" else signal.SIGTERM)
        for thread in threads:
            thread.join(600)
        return streams


async def _flush(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await pb_grpc.NodeServiceStub(channel).FlushCache(pb.FlushCacheRequest(device=True, host=True))


def _summary(fault: str, streams: list[mh.Stream], expected: list[list[int]], moves: list[dict]) -> Run:
    completed = sum(s.status == 200 and not s.errors and s.finish_reason == "length" for s in streams)
    identical = sum(s.tokens == e for s, e in zip(streams, expected, strict=True))
    gaps = [s.longest_gap() for s in streams]
    tiers: dict[str, int] = {}
    for m in moves:
        for tier, n in m.get("cached_by_tier", {}).items():
            tiers[tier] = tiers.get(tier, 0) + n
    return Run(fault, completed, identical, max(gaps), statistics.median(gaps),
               sum(m["reprefill_tokens"] for m in moves), tiers)


def _median(runs: list[Run], value) -> float:
    return statistics.median(value(r) for r in runs)


def report(name: str, runs: list[Run], n: int) -> str:
    return (f"| {name} | {min(r.completed for r in runs)}/{n} | {min(r.identical for r in runs)}/{n} | "
            f"{_median(runs, lambda r: r.longest_gap_s) * 1000:.0f} | "
            f"{_median(runs, lambda r: r.median_stream_gap_s) * 1000:.0f} | "
            f"{_median(runs, lambda r: r.reprefill_tokens / n):.0f} | "
            f"{_median(runs, lambda r: r.share('storage')) * 100:.1f} | "
            f"{_median(runs, lambda r: r.share('device') + r.share('host')) * 100:.1f} | "
            f"{_median(runs, lambda r: r.cached_share) * 100:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--cut", type=int, default=200)
    args = parser.parse_args()
    setup = Setup(args.concurrent, args.prompt, args.max_tokens, args.cut)
    with tempfile.TemporaryDirectory() as tmp:
        model = mh.model_with_words(Path(tmp) / "model")
        bench = Bench(model, Path(tmp), setup)
        rows = []
        try:
            cases = [("none", False), ("sigkill", False), ("sigterm", False), ("sigkill", True), ("sigterm", True)]
            for fault, flush in cases:
                runs = [bench.run(fault, flush) for _ in range(args.runs)]
                rows.append(report(fault + (", prefill flushed" if flush else ""), runs, setup.concurrent))
                print(rows[-1], flush=True)
        finally:
            bench.close()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {setup}, {args.runs} runs, medians")
    print("| fault | completed | identical | longest gap ms | median per-stream longest gap ms | re-prefill "
          "tokens | from L3 % | prefill node's L1+L2 % | not recomputed % |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
