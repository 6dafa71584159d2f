"""Drives a workload against an endpoint: arrivals, the concurrency cap, round barriers, progress.

Every session runs as its own coroutine: it waits for its arrival, then sends its requests one
after another, each through one FIFO semaphore (the cap on requests in flight). asyncio's
semaphore wakes waiters in order, so a conversation's next round queues behind the requests that
were already waiting, and the rounds of many clients interleave as in SGLang's multi-turn bench.

Modes: ``closed`` (every session ready at once, ``clients`` requests in flight: N closed-loop
clients), ``poisson`` (sessions start at Poisson arrivals of ``rate`` per second) and ``trace``
(sessions start at the trace's times multiplied by ``time_scale``); both open-loop modes take an
optional ``max_concurrency``. A failed request ends its session (its history has no answer).
After the last request, the run computes its ideal hit rate (``bench.ideal``) from the prompts it
sent; that takes no part in the timings."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from tierserve.bench.classes import RequestClass, assign
from tierserve.bench.client import ClientConfig, discover_model, send
from tierserve.bench.ideal import DEFAULT_PAGE_SIZE, fill_ideal
from tierserve.bench.records import Prompt, RequestRecord, RequestSpec
from tierserve.bench.report import Report
from tierserve.bench.server_metrics import Samples, ScrapeError, scrape, server_figures
from tierserve.bench.workloads import Session, Workload

Mode = Literal["closed", "poisson", "trace"]
MODES: tuple[Mode, ...] = ("closed", "poisson", "trace")
SETTLE_S = 5.0  # after the run, how long the servers' counters get to count its last requests


@dataclass
class BenchOptions:
    """How to load the endpoint. ``time_scale`` multiplies trace arrival offsets (0.1 replays ten
    times faster); ``barrier`` holds every conversation's round r+1 until all finished round r;
    ``model`` None asks the server's /v1/models. ``extra_body`` goes into every request.
    ``page_size`` is the server's KV page size, for the ideal hit rate. ``metrics_urls``: the servers'
    ``/metrics`` read before and after the run for their own figures (``Report.server``); empty: none."""

    mode: Mode = "closed"
    clients: int = 8
    rate: float = 1.0
    time_scale: float = 1.0
    max_concurrency: int | None = None
    barrier: bool = False
    timeout_s: float = 300.0
    seed: int = 0
    progress: bool = True
    model: str | None = None
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    page_size: int = DEFAULT_PAGE_SIZE
    metrics_urls: tuple[str, ...] = ()
    classes: tuple[RequestClass, ...] = ()  # priorities and deadlines, by share of the sessions

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "closed" and self.clients < 1:
            raise ValueError("closed-loop mode needs at least one client")
        if self.mode == "poisson" and self.rate <= 0:
            raise ValueError("poisson mode needs a rate above 0")
        if self.page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {self.page_size}")

    @property
    def concurrency(self) -> int | None:
        return self.clients if self.mode == "closed" else self.max_concurrency


def arrivals(workload: Workload, options: BenchOptions) -> list[float]:
    """Each session's start, in seconds from the start of the run (deterministic given the seed)."""
    if options.mode == "closed":
        return [0.0] * len(workload.sessions)
    if options.mode == "trace":
        return [(s.arrival or 0.0) * options.time_scale for s in workload.sessions]
    rng, t, out = random.Random(f"{options.seed}:arrivals"), 0.0, []
    for _ in workload.sessions:
        out.append(t)
        t += rng.expovariate(options.rate)
    return out


def run_bench(endpoint: str, workload: Workload, options: BenchOptions | None = None) -> Report:
    """Runs ``workload`` against ``endpoint`` (``http://host:port``) and returns the report. Blocks;
    from async code await ``run_bench_async`` instead."""
    return asyncio.run(run_bench_async(endpoint, workload, options or BenchOptions()))


async def run_bench_async(endpoint: str, workload: Workload, options: BenchOptions,
                          transport: httpx.AsyncBaseTransport | None = None) -> Report:
    """``run_bench`` for a running event loop; ``transport`` replaces the network (unit tests)."""
    config = ClientConfig(endpoint, options.model, options.api_key, options.timeout_s, options.temperature,
                          options.ignore_eos, dict(options.extra_body))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=options.concurrency or 256)
    async with httpx.AsyncClient(limits=limits, transport=transport) as client:
        if config.model is None:
            config.model = await discover_model(client, config)
        before = await scrape(client, list(options.metrics_urls))  # ScrapeError: no run
        run = _Run(client, config, options, workload)
        started = time.time()
        await run.all(arrivals(workload, options))
        server = await _server_view(client, options, before, sum(r.ok for r in run.records))
        ideal = await fill_ideal(client, config, run.records, run.prompts, options.page_size)
    meta = {"endpoint": endpoint, "model": config.model, "started": started, "workload": workload.name,
            "workload_params": workload.params, "options": _options_json(options), "ideal": ideal}
    return Report(sorted(run.records, key=lambda r: r.index), run.duration, meta, server)


async def _server_view(client: httpx.AsyncClient, options: BenchOptions, before: dict[str, Samples],
                       answered: int) -> dict[str, Any] | None:
    """``server_figures`` once the API has counted the ``answered`` requests (it counts each as its
    response ends, which the client may see first), or after ``SETTLE_S``; {"error": why} when a
    server no longer answers."""
    if not options.metrics_urls:
        return None
    deadline = time.monotonic() + SETTLE_S
    while True:
        try:
            after = await scrape(client, list(options.metrics_urls))
        except ScrapeError as exc:
            return {"error": str(exc)}
        figures = server_figures(before, after)
        if figures["requests"] >= answered or time.monotonic() > deadline:
            return figures
        await asyncio.sleep(0.1)


class _Run:
    """The state of one run: the records (and the prompt each sent), the semaphore, the barrier and
    the progress bar."""

    def __init__(self, client: httpx.AsyncClient, config: ClientConfig, options: BenchOptions,
                 workload: Workload) -> None:
        from tqdm.auto import tqdm

        self.client, self.config, self.options = client, config, options
        self.records: list[RequestRecord] = []
        self.prompts: dict[int, Prompt] = {}  # by record index: the ideal hit rate replays them
        limit = options.concurrency
        self.gate = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()
        self.barrier = RoundBarrier(len(workload.sessions)) if options.barrier else None
        self.sessions = workload.sessions
        self.classes = assign(options.classes, len(workload.sessions), options.seed)
        self.bar = tqdm(total=workload.planned, disable=not options.progress, unit="req", desc=workload.name)
        self.t0 = time.perf_counter()
        self.duration = 0.0

    async def all(self, starts: list[float]) -> None:
        self.t0 = time.perf_counter()
        try:
            await asyncio.gather(*(self.session(s, at, c)
                                   for s, at, c in zip(self.sessions, starts, self.classes, strict=True)))
        finally:
            self.duration = time.perf_counter() - self.t0
            self.bar.close()

    async def session(self, session: Session, start: float, klass: RequestClass | None) -> None:
        await asyncio.sleep(max(0.0, start - (time.perf_counter() - self.t0)))
        spec: RequestSpec | None = session.first()
        sent, scheduled = 0, start
        while spec is not None:
            if klass is not None:
                spec = dataclasses.replace(spec, priority=klass.priority, deadline_ms=klass.deadline_ms)
            record = await self.request(spec, scheduled)
            sent += 1
            if not record.ok:
                break
            spec = session.next(record)
            if spec is not None and self.barrier is not None:
                await self.barrier.wait(sent - 1)
            scheduled = time.perf_counter() - self.t0
        if self.barrier is not None:
            self.barrier.leave()
        if sent < session.planned:  # ended early: the bar's total shrinks, so it still reaches 100%
            self.bar.total -= session.planned - sent
            self.bar.refresh()

    async def request(self, spec: RequestSpec, scheduled: float) -> RequestRecord:
        record = RequestRecord(index=len(self.records), tags=dict(spec.tags), scheduled_at=scheduled,
                               priority=spec.priority, deadline_ms=spec.deadline_ms)
        self.records.append(record)
        self.prompts[record.index] = spec.prompt
        async with self.gate:
            try:
                await send(self.client, self.config, spec, record, self.t0)
            except Exception as exc:  # a bug or a server speaking another protocol: counted, not fatal
                record.ok, record.error = False, f"{type(exc).__name__}: {exc}"
        self.bar.update(1)
        return record


class RoundBarrier:
    """Releases round r's waiters once every session still running has finished round r. A session
    that ends calls ``leave`` so nobody waits for it."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.arrived: dict[int, int] = defaultdict(int)
        self.events: dict[int, asyncio.Event] = defaultdict(asyncio.Event)

    async def wait(self, round_: int) -> None:
        self.arrived[round_] += 1
        self._check()
        await self.events[round_].wait()

    def leave(self) -> None:
        self.parties -= 1
        self._check()

    def _check(self) -> None:
        for r, n in self.arrived.items():
            if n >= self.parties:
                self.events[r].set()


def _options_json(options: BenchOptions) -> dict[str, Any]:
    out = dataclasses.asdict(options)
    out.pop("api_key", None)  # never write a secret into a report file
    return out
