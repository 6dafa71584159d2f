"""Wrong outputs on the multi-rank cluster (issue 31): the reliability campaign's rank layout (prefill
TP 2 x CP 2, decode PP 2, L3 on Mooncake) under its soak's prompts, every request greedy and
non-streaming (so each answer carries its cache report), each compared with the no-cache reference.
Each wrong one is written to ``WORKDIR/wrong.jsonl`` with its cache report and the router's routes of
its prompt length (``/debug/state``); each node's ``/metrics`` is saved at the end.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/faults/wrong_outputs.py --workdir /tmp/w --rounds 4 \\
        [--extra=--handoff-integrity]

Round r sends the non-``max_tokens`` 1 requests of ``requests(--count, seed=--seed + r)`` at 16 concurrent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

import httpx
from faults.cluster import Cluster
from faults.load import Request
from faults.workload import Reference, make_model, requests
from reliability import NODE_FLAGS, RANK_LAYOUT, ROUTER_ARGS, start_reference

from tierserve.model.fetch import fetch_builtin_model

ROUTES_EVERY_S = 0.5  # the router keeps its last 256 routes: polled this often, none is missed at this load


async def _one(client: httpx.AsyncClient, model: str, r: Request) -> dict:
    body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0.0, "ignore_eos": True}
    reply = await client.post("/v1/completions", json=body)
    if reply.status_code != 200:
        return {"status": reply.status_code, "body": reply.text[:200]}
    answer = reply.json()
    return {"status": 200, "text": answer["choices"][0]["text"], "usage": answer.get("usage")}


async def _routes(client: httpx.AsyncClient, admin_key: str, into: list[dict]) -> None:
    """Collects the router's recent routes until cancelled."""
    while True:
        state = (await client.get("/debug/state", headers={"Authorization": f"Bearer {admin_key}"})).json()
        into += [r for r in state.get("routes", []) if r not in into]
        await asyncio.sleep(ROUTES_EVERY_S)


async def _round(cluster: Cluster, wanted: list[Request], routes: list[dict], concurrency: int = 16) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as client:
        poller = asyncio.create_task(_routes(client, cluster.admin_key, routes))

        async def gated(r: Request) -> dict:
            async with gate:
                return await _one(client, cluster.model, r)

        try:
            return await asyncio.gather(*(gated(r) for r in wanted))
        finally:
            poller.cancel()


def _save_metrics(cluster: Cluster, workdir: Path) -> None:
    for child in cluster.children():
        if child.get("metrics_port") and child["role"] != "mooncake_master":
            url = f"http://127.0.0.1:{child['metrics_port']}/metrics"
            (workdir / f"metrics-{child['name']}.txt").write_text(httpx.get(url, timeout=10).text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--seed", type=int, default=19)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--extra", default="", help="more `tierserve up` flags, e.g. --extra=--handoff-integrity")
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = make_model(args.workdir / "tiny-llama", fetch_builtin_model(progress=False))
    ref_proc, ref_url = start_reference(model, args.workdir)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    flags = [*NODE_FLAGS, "--router-args", ROUTER_ARGS, *RANK_LAYOUT, *shlex.split(args.extra)]
    (args.workdir / "cluster").mkdir(exist_ok=True)
    cluster = Cluster(model, args.workdir / "cluster", vocab, flags, 0.0)
    total = wrong = failed = 0
    try:
        cluster.wait_ready()
        reference = Reference(ref_url, model.name)
        with (args.workdir / "wrong.jsonl").open("a") as log:
            for n in range(args.rounds):
                wanted = [r for r in requests(args.count, seed=args.seed + n) if r.max_tokens > 1]
                asyncio.run(reference.learn(wanted))
                started, routes = time.monotonic(), []
                for r, got in zip(wanted, asyncio.run(_round(cluster, wanted, routes)), strict=True):
                    total, failed = total + 1, failed + (got["status"] != 200)
                    want = reference.texts[r.prompt, r.max_tokens]
                    if got["status"] == 200 and got["text"] != want:
                        wrong += 1
                        tokens = got["usage"]["prompt_tokens"] if got["usage"] else -1
                        log.write(json.dumps({"round": n, "seed": args.seed + n, "length": len(r.prompt),
                                              "ending": r.prompt[-30:], "max_tokens": r.max_tokens,
                                              "got": got["text"], "want": want, "usage": got["usage"],
                                              "routes": [x for x in routes if x.get("prompt_tokens") == tokens]})
                                  + "\n")
                print(f"round {n}: {len(wanted)} in {time.monotonic() - started:.0f} s; total {total}, "
                      f"wrong {wrong}, failed {failed}", flush=True)
        _save_metrics(cluster, args.workdir)
    finally:
        cluster.stop()
        ref_proc.terminate()
        ref_proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
