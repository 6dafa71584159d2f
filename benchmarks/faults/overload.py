"""The campaign's "overload with priorities" experiment (issue 33): two classes at about twice the
cluster's capacity, through a router that admits by predicted TTFT on nodes that schedule by
priority. Counted as every row (5xx, wrong outputs, what the nodes held after); noted: the high
class's p99 TTFT against its unloaded p99, and the requests shed at admission by reason and class
(the router's ``tierserve_requests_shed_total``). A clean 429 (the OpenAI error shape) is an
answer here, as in the burst: shedding what cannot make its deadline is the point."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import replace

import httpx
from faults.cluster import Cluster
from faults.load import Outcome, Result, send, send_all
from faults.workload import Reference, requests

HIGH, LOW = 0, 5
HIGH_SHARE, OVERLOAD = 0.3, 2.0
HIGH_DEADLINE, LOW_DEADLINE = 3.0, 10.0  # x the high class's unloaded p99 TTFT
CAPACITY_REQUESTS, UNLOADED_REQUESTS, OVERLOAD_REQUESTS = 128, 24, 400


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


async def capacity(cluster: Cluster, reference: Reference) -> float:
    """Requests per second of a closed loop of 16 clients (all the campaign's mixed requests, streamed)."""
    wanted = [replace(r, stream=True) for r in requests(CAPACITY_REQUESTS, seed=30)]
    await reference.learn(wanted)
    started = time.monotonic()
    outcomes = await send_all(cluster.url, cluster.model, wanted, 16, timeout_s=180)
    return sum(o.result is Result.OK for o in outcomes) / (time.monotonic() - started)


async def unloaded_p99(cluster: Cluster) -> float:
    """The high class alone, one request at a time: its p99 TTFT (seconds)."""
    wanted = [replace(r, stream=True, priority=HIGH) for r in requests(UNLOADED_REQUESTS, seed=31)]
    outcomes = await send_all(cluster.url, cluster.model, wanted, 1, timeout_s=180)
    return p99([o.first_s for o in outcomes if o.first_s is not None])


async def poisson(cluster: Cluster, wanted: list, rate: float, seed: int) -> list[Outcome]:
    """Each request sent at its Poisson arrival time, whatever is still in flight (an open loop)."""
    rng, at = random.Random(seed), 0.0
    limits = httpx.Limits(max_connections=len(wanted) + 8)
    async with httpx.AsyncClient(base_url=cluster.url, timeout=None, limits=limits) as client:
        start = time.monotonic()

        async def one(delay: float, request) -> Outcome:
            await asyncio.sleep(delay)  # its arrival time
            return await send(client, cluster.model, request, timeout_s=300)

        tasks = []
        for request in wanted:
            at += rng.expovariate(rate)
            tasks.append(one(at - (time.monotonic() - start), request))
        return list(await asyncio.gather(*tasks))


def classes(unloaded: float, seed: int) -> list:
    """The overload's requests: ``HIGH_SHARE`` high priority with a deadline of ``HIGH_DEADLINE`` x
    the unloaded p99, the rest low priority with ``LOW_DEADLINE`` x it; all streamed."""
    rng = random.Random(seed)
    out = []
    for r in requests(OVERLOAD_REQUESTS, seed=seed):
        high = rng.random() < HIGH_SHARE
        factor = HIGH_DEADLINE if high else LOW_DEADLINE
        out.append(replace(r, stream=True, priority=HIGH if high else LOW, deadline_ms=round(unloaded * factor * 1000)))
    return out


def shed_counts(url: str) -> Counter:
    """The router's shed counter by (reason, priority)."""
    counts: Counter = Counter()
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("tierserve_requests_shed_total{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(","))
            counts[labels["reason"].strip('"'), labels["priority"].strip('"')] += float(line.rsplit(" ", 1)[1])
    return counts


def summary(outcomes: list[Outcome], unloaded: float, rate: float, capacity_rps: float) -> list[str]:
    """The row's notes: the classes' TTFT and what was shed, as clients saw it."""
    notes = [f"capacity {capacity_rps:.1f} req/s (16 clients, closed loop); offered {rate:.1f} req/s "
             f"(Poisson, {OVERLOAD:g}x), {HIGH_SHARE:.0%} high priority ({HIGH}), the rest low ({LOW}); deadlines "
             f"{HIGH_DEADLINE:g}x / {LOW_DEADLINE:g}x the high class's unloaded p99 TTFT ({unloaded * 1000:.0f} ms)"]
    for name, prio in (("high", HIGH), ("low", LOW)):
        mine = [o for o in outcomes if o.request.priority == prio]
        ttfts = [o.first_s for o in mine if o.result is Result.OK and o.first_s is not None]
        shed = Counter(o.code for o in mine if o.status == 429)
        late = sum(t * 1000 > o.request.deadline_ms for o in mine if (t := o.first_s) is not None)
        ttft = f"TTFT p50 {sorted(ttfts)[len(ttfts) // 2]:.3f} s, p99 {p99(ttfts):.3f} s " \
               f"(**{p99(ttfts) / unloaded:.2f}x** unloaded p99)" if ttfts else "no first token"
        notes.append(f"{name}: {len(mine)} sent, {len(ttfts)} served, {ttft}, late {late}, "
                     f"shed {sum(shed.values())} ({dict(shed) or 0})")
    return notes
