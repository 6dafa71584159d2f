"""The campaign's experiments. Each sends its load, injects its fault, and returns a ``Row`` of
counts; ``settle`` then checks that every node gave its pages back."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
from faults import overload
from faults.bad_inputs import cases, check
from faults.cluster import Cluster
from faults.load import Outcome, Request, Result, is_error_shape, send, send_all
from faults.workload import Reference, requests

SETTLE_S = 10.0  # pages must be back this long after an experiment
GRACE_S = 40.0  # the decode nodes' --reservation-grace: how long quarantined pages stay


@dataclass
class Row:
    name: str
    sent: int = 0
    ok: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # "result status" -> count
    wrong: int = 0
    held_pages: dict[str, dict[str, float]] = field(default_factory=dict)  # node -> what it still holds
    rss_growth_mb: float = 0.0
    recovery_s: float | None = None
    quarantine_freed_s: float | None = None  # when only quarantined pages were held: all freed after this
    notes: list[str] = field(default_factory=list)


Experiment = Callable[[Cluster, Reference], Awaitable[Row]]


def tally(row: Row, outcomes: list[Outcome], reference: Reference) -> Row:
    row.sent += len(outcomes)
    row.ok += sum(o.result is Result.OK for o in outcomes)
    failed = Counter(f"{o.result.value} {o.status}" for o in outcomes if o.result is not Result.OK)
    row.failed = dict(Counter(row.failed) + failed)
    wrong = {i: n for i, o in enumerate(outcomes) if (n := reference.wrong(o))}
    row.wrong += sum(wrong.values())
    row.notes += [reference.describe(outcomes[i]) for i in list(wrong)[:5]]
    return row


async def loaded(cluster: Cluster, reference: Reference, row: Row, wanted: list[Request], concurrency: int,
                 fault: Callable[[], Awaitable[None]] | None = None, after_s: float = 1.0) -> Row:
    """Runs ``wanted`` at ``concurrency``; ``fault`` fires ``after_s`` into the load."""
    await reference.learn(wanted)
    load = asyncio.create_task(send_all(cluster.url, cluster.model, wanted, concurrency, timeout_s=180))
    if fault is not None:
        await asyncio.sleep(after_s)  # the fault must land while requests are in flight
        await fault()
    return tally(row, await load, reference)


async def soak(cluster: Cluster, reference: Reference) -> Row:
    return await loaded(cluster, reference, Row("soak: 2,000 requests"), requests(2000, seed=1), 16)


async def soak_again(cluster: Cluster, reference: Reference) -> Row:
    """The soak once more after every fault: its RSS growth tells a leak from the first growth of
    a process that served its first burst (allocator arenas, caches)."""
    return await loaded(cluster, reference, Row("soak again, after the faults"), requests(2000, seed=13), 16)


def kill_node(role: str, what: str, seed: int) -> Experiment:
    async def experiment(cluster: Cluster, reference: Reference) -> Row:
        row, name = Row(f"kill -9 {what} under 32 concurrent"), cluster.first(role)
        stopped = 0.0

        async def fault() -> None:
            nonlocal stopped
            cluster.kill(name, signal.SIGKILL)
            stopped = time.monotonic()
            if role == "decode":
                row.notes.append(f"router stopped using it after {await cluster.unused_after(name):.2f} s")

        row = await loaded(cluster, reference, row, requests(300, seed=seed), 32, fault)
        row.recovery_s = await cluster.wait_back(name) - stopped
        return row

    experiment.__name__ = f"kill_{role}"
    return experiment


async def freeze_decode(cluster: Cluster, reference: Reference) -> Row:
    row, name = Row("SIGSTOP of a decode node for 20 s"), cluster.first("decode")

    async def fault() -> None:
        cluster.kill(name, signal.SIGSTOP)
        await asyncio.sleep(20)  # the length of the freeze is the experiment
        cluster.kill(name, signal.SIGCONT)

    return await loaded(cluster, reference, row, requests(300, seed=7), 16, fault)


def kill_rank(role: str, rank: int, what: str, seed: int) -> Experiment:
    """SIGKILL of one rank of the first ``role`` node: the rank's death takes its node down (every rank
    leaves), the router retries what had not streamed, ``up`` restarts the node."""
    async def experiment(cluster: Cluster, reference: Reference) -> Row:
        row, name = Row(f"kill -9 {what} under 32 concurrent"), cluster.first(role)
        stopped = 0.0

        async def fault() -> None:
            nonlocal stopped
            os.kill(cluster.rank_pid(name, rank), signal.SIGKILL)
            stopped = time.monotonic()
            row.notes.append(f"{what}: the router stopped using the node after "
                             f"{await cluster.unused_after(name):.2f} s")

        row = await loaded(cluster, reference, row, requests(300, seed=seed), 32, fault)
        row.recovery_s = await cluster.wait_back(name) - stopped
        return row

    experiment.__name__ = f"kill_{role}_rank{rank}"
    return experiment


def freeze_rank(role: str, rank: int, what: str, seed: int) -> Experiment:
    """SIGSTOP of one rank of the first ``role`` node for 20 s (within ``--dist-timeout``): rank 0's step
    is overdue, the node says it is unhealthy (docs/ranks.md, the step watchdog), the router sends
    elsewhere, and SIGCONT brings the node back."""
    async def experiment(cluster: Cluster, reference: Reference) -> Row:
        row, name = Row(f"SIGSTOP of {what} for 20 s"), cluster.first(role)

        async def fault() -> None:
            pid, frozen = cluster.rank_pid(name, rank), time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            try:
                row.notes.append(f"{what} frozen: the router stopped using the node after "
                                 f"{await cluster.unused_after(name):.2f} s")
                await asyncio.sleep(20 - (time.monotonic() - frozen))  # the length of the freeze is the experiment
            finally:
                os.kill(pid, signal.SIGCONT)

        return await loaded(cluster, reference, row, requests(300, seed=seed), 16, fault)

    experiment.__name__ = f"freeze_{role}_rank{rank}"
    return experiment


async def transfer_failures(cluster: Cluster, reference: Reference) -> Row:
    row = Row(f"{cluster.transfer_fault_rate:.0%} injected transfer failures")
    return await loaded(cluster, reference, row, requests(1000, seed=8), 16)


async def disconnects(cluster: Cluster, reference: Reference) -> Row:
    row, wanted = Row("100 clients leave mid-stream"), [Request(p, 64, stream=True) for p in _prompts(100, 9)]
    async with httpx.AsyncClient(base_url=cluster.url, timeout=None) as client:
        outcomes = await asyncio.gather(*(send(client, cluster.model, r, 120, leave_after_chunks=2) for r in wanted))
    row.sent = len(outcomes)
    row.ok = sum(o.result is Result.DISCONNECTED for o in outcomes)  # leaving as planned is success here
    row.failed = dict(Counter(f"{o.result.value} {o.status}" for o in outcomes if o.result is not Result.DISCONNECTED))
    return row


async def burst(cluster: Cluster, reference: Reference) -> Row:
    """300 requests at once over the router's admission limits, plus one 300-prompt x n=128 request."""
    row = await loaded(cluster, reference, Row("burst of 300 + n=128 fan-out"), requests(300, seed=10), 300)
    fan_out = Request("fan out", 4, n=128)
    async with httpx.AsyncClient(base_url=cluster.url, timeout=None) as client:
        body = fan_out.body(cluster.model) | {"prompt": _prompts(300, 11)}
        reply = await client.post("/v1/completions", json=body, timeout=600)
    row.sent += 1
    refused = reply.status_code == 429 and is_error_shape(reply.json())
    row.ok += reply.status_code == 200 or refused  # 38,400 choices over the limits: a clean 429 is the answer
    if refused:
        row.notes.append(f"the {len(body['prompt'])}-prompt x n={fan_out.n} request: 429 in the OpenAI error shape "
                         f"({reply.json()['error']['message'][:80]})")
    elif reply.status_code != 200:
        key = f"fan-out {reply.status_code}"
        row.failed[key] = row.failed.get(key, 0) + 1
    return row


async def bad_input(cluster: Cluster, reference: Reference) -> Row:
    row = Row("bad input")
    async with httpx.AsyncClient(base_url=cluster.url, timeout=None) as client:
        verdicts = [await check(client, case, cluster.admin_key) for case in cases(cluster.model, cluster.vocab)]
    row.sent, row.ok = len(verdicts), sum(v.passed for v in verdicts)
    row.failed = {f"{v.case.name}: {v.status}{'' if v.shaped else ' (not the error shape)'}": 1
                  for v in verdicts if not v.passed}
    row.notes.append(f"{len(verdicts)} bad requests, each answered 4xx in the OpenAI error shape unless listed as "
                     "failed (1,000 stop strings may also be served), then 20 good ones")
    return await loaded(cluster, reference, row, requests(20, seed=12), 4)  # and the cluster still serves


def _prompts(count: int, seed: int) -> list[str]:
    return [r.prompt for r in requests(count, seed)]


async def settle(cluster: Cluster, row: Row) -> Row:
    """Waits up to ``SETTLE_S`` for every node to hold nothing for a request; records what is
    still held then. Quarantined pages (a writer that may still land, ``docs/faults.md``) are bounded by the decode
    nodes' grace: their end is waited for and timed too."""
    started = time.monotonic()
    while (held := cluster.held_pages()) and time.monotonic() - started < SETTLE_S:
        await asyncio.sleep(0.25)  # poll interval
    row.held_pages = held
    while _only_quarantine(held) and held and time.monotonic() - started < SETTLE_S + GRACE_S:
        await asyncio.sleep(0.25)  # poll interval
        held = cluster.held_pages()
    quarantine_only = bool(row.held_pages) and _only_quarantine(row.held_pages)
    row.quarantine_freed_s = time.monotonic() - started if quarantine_only and not held else None
    return row


def _only_quarantine(held: dict[str, dict[str, float]]) -> bool:
    """A node's ``pages`` count includes its quarantined ones."""
    return all(set(h) <= {"pages", "quarantined"} and h.get("pages") == h.get("quarantined") for h in held.values())


# on a cluster of multi-rank nodes (``reliability.py``, RANK_LAYOUT): prefill TP 2 x CP 2 (rank (c * 2) + t,
# docs/ranks.md), decode PP 2
async def soak_ranks(cluster: Cluster, reference: Reference) -> Row:
    """No fault: the multi-rank cluster's own baseline (a wrong output here is not a fault's)."""
    return await loaded(cluster, reference, Row("soak: 1,000 requests on the multi-rank cluster"),
                        requests(1000, seed=19), 16)


async def kill_router(cluster: Cluster, reference: Reference) -> Row:
    """Two routers (``up --routers 2``) share the load; the second is killed with kill -9 one second
    in. The row counts the first router's clients, who must see nothing; the killed router's
    clients (their connection breaks: nothing else can happen to them) are in its note. ``settle``
    then checks the nodes freed what the dead router's requests held (its reservations would
    otherwise wait out their 602 s lease: docs/router.md, router sessions)."""
    row, name = Row("kill -9 a router (of 2) under 2 x 16 concurrent"), cluster.first("router-1")
    wanted = requests(300, seed=9)
    await reference.learn(wanted)
    alive = asyncio.create_task(send_all(cluster.url, cluster.model, wanted[:150], 16, timeout_s=180))
    dead = asyncio.create_task(send_all(cluster.router_url(1), cluster.model, wanted[150:], 16, timeout_s=180))
    await asyncio.sleep(1.0)  # the fault must land while requests are in flight
    cluster.kill(name, signal.SIGKILL)
    stopped = time.monotonic()
    tally(row, await alive, reference)
    cut = tally(Row("the killed router's clients"), await dead, reference)
    row.notes.append(f"the killed router's clients (not in the counts): {cut.sent} requests, {cut.ok} answered "
                     f"before the kill ({cut.wrong} wrong), cut: {cut.failed or 0}")
    row.recovery_s = await cluster.wait_back(name) - stopped
    return row


async def overload_priorities(cluster: Cluster, reference: Reference) -> Row:
    """Two classes at twice the capacity (``faults/overload.py``), on a cluster whose nodes
    schedule by priority (``reliability.py``: ``--schedule-policy priority``; the router admits by
    predicted TTFT, its default). Clean 429s are answers, counted as succeeded and noted by reason."""
    capacity_rps = await overload.capacity(cluster, reference)
    unloaded = await overload.unloaded_p99(cluster)
    wanted = overload.classes(unloaded, seed=32)
    await reference.learn(wanted)
    shed_before = overload.shed_counts(cluster.url)
    rate = overload.OVERLOAD * capacity_rps
    outcomes = await overload.poisson(cluster, wanted, rate, seed=33)
    shed = overload.shed_counts(cluster.url) - shed_before
    row = tally(Row(f"overload with priorities: {len(wanted)} requests, 2 classes at "
                    f"{overload.OVERLOAD:g}x capacity"), outcomes, reference)
    clean = [o for o in outcomes if o.status == 429 and o.result is Result.HTTP_ERROR]
    row.ok += len(clean)
    row.failed = {k: v - (len(clean) if k == "http_error 429" else 0) for k, v in row.failed.items()}
    row.failed = {k: v for k, v in row.failed.items() if v}
    row.notes += overload.summary(outcomes, unloaded, rate, capacity_rps)
    row.notes.append("router's shed counter (reason, priority): "
                     + (", ".join(f"{r}/{p} {n:g}" for (r, p), n in sorted(shed.items())) or "0"))
    return row


RANK_EXPERIMENTS: list[Experiment] = [
    soak_ranks,
    freeze_rank("prefill", 1, "a TP rank of a TP2xCP2 prefill node", 20),
    kill_rank("prefill", 1, "a TP rank of a TP2xCP2 prefill node", 21),
    freeze_rank("prefill", 2, "a CP rank of a TP2xCP2 prefill node", 22),
    kill_rank("prefill", 2, "a CP rank of a TP2xCP2 prefill node", 23),
    freeze_rank("decode", 1, "PP stage 1 of a PP2 decode node", 24),
    kill_rank("decode", 1, "PP stage 1 of a PP2 decode node", 25),
]

EXPERIMENTS: list[Experiment] = [
    soak, kill_node("prefill", "a prefill node", 2), kill_node("decode", "a decode node", 3),
    kill_node("master", "mooncake_master", 4), freeze_decode, disconnects, burst, bad_input, soak_again,
]
