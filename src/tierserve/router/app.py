"""``tierserve router``: the OpenAI-compatible HTTP API over prefill/decode pairs, the worker
registry with its admin API, and the background tasks (health checks, discovery)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tierserve.api import openai as oa
from tierserve.api.admission import AdmissionPolicy
from tierserve.api.app import create_app
from tierserve.api.auth import admin_guard
from tierserve.api.http import run_http
from tierserve.api.metrics import ApiMetrics
from tierserve.api.tenants import TenantKeys
from tierserve.api.tokenizer import try_load
from tierserve.core.model_config import ModelConfig
from tierserve.core.node_auth import TLSFiles
from tierserve.router.backend import PDBackend, RouterOptions
from tierserve.router.cache_view import CacheView
from tierserve.router.policies import PolicyKind, make_policy
from tierserve.router.registry import Registry
from tierserve.router.roles import Role
from tierserve.router.sessions import NodeSessions
from tierserve.tracing import TracingConfig, start_tracing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    model_dir: Path  # for the tokenizer, the chat template and the context length
    prefill: list[str] = field(default_factory=list)  # host:port of gRPC workers
    decode: list[str] = field(default_factory=list)
    served_model_name: str | None = None
    context_length: int | None = None
    keys: TenantKeys | None = None  # API keys naming tenants (None: an open API)
    admin_api_key: str | None = None
    prefill_policy: PolicyKind = PolicyKind.CACHE_AWARE
    decode_policy: PolicyKind = PolicyKind.POWER_OF_TWO
    admission: AdmissionPolicy = AdmissionPolicy.TTFT  # what a request's first-token deadline does
    options: RouterOptions = field(default_factory=RouterOptions)
    health_check_interval_s: float = 2.0
    drain_timeout_s: float = 600.0  # a removed worker's running requests get this long to finish
    node_token: str | None = None  # sent on every call to the nodes (core/node_auth.py)
    tls: TLSFiles | None = None  # TLS to the nodes: their CA, and this router's certificate for mutual TLS
    chat_template: Path | None = None  # --chat-template, --tool-call-parser (docs/agents.md)
    tool_call_parser: str | None = None
    tracing: TracingConfig = field(default_factory=TracingConfig)  # OTLP traces (docs/tracing.md); default: off


Task = Callable[[Registry], Any]  # a background coroutine function run for the app's lifetime


def create_router_app(config: RouterConfig, registry: Registry, tasks: list[Task] | None = None) -> FastAPI:
    model = ModelConfig.from_dir(config.model_dir)
    caches = CacheView(registry)
    backend = PDBackend(registry, make_policy(config.prefill_policy), make_policy(config.decode_policy),
                        config.options, config.context_length or model.max_position, caches.lookup, caches.synced,
                        caches.l3_lookup)
    name = config.served_model_name or config.model_dir.name
    tokenizer = try_load(config.model_dir, config.chat_template, config.tool_call_parser)
    app = create_app(backend, tokenizer, name, ApiMetrics(_RouterCollector(registry, backend, caches)),
                     config.keys, config.admin_api_key, config.admission,
                     start_tracing(config.tracing, "tierserve-router"))
    _add_worker_routes(app, registry, admin_guard(config.admin_api_key, config.keys))
    initial = [(Role.PREFILL, a) for a in config.prefill] + [(Role.DECODE, a) for a in config.decode]
    sessions = NodeSessions(registry)
    app.router.lifespan_context = _lifespan(registry, initial, [Registry.run_checks, caches.run, sessions.run,
                                                                *(tasks or [])])
    return app


def _lifespan(registry: Registry, initial: list[tuple[Role, str]], tasks: list[Task]):
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for role, address in initial:  # gRPC channels belong to the serving event loop
            registry.add(role, address)
        await registry.check_all()  # workers already up get traffic from the first request
        running = [asyncio.create_task(task(registry)) for task in tasks]
        try:
            yield
        finally:
            for task in running:
                task.cancel()
            for task in running:
                with contextlib.suppress(BaseException):
                    await task
            await registry.close()

    return lifespan


def _add_worker_routes(app: FastAPI, registry: Registry, admin: dict[str, Any]) -> None:
    async def list_workers() -> Response:
        return JSONResponse({"workers": [w.describe() for w in registry.listed()]})

    async def add_worker(request: Request) -> Response:
        role, address = _worker_body(await request.body())
        worker = registry.add(role, address)
        await registry.check(worker)
        return JSONResponse(worker.describe(), status_code=201)

    async def remove_worker(request: Request) -> Response:
        role, address = _worker_body(await request.body())
        if not await registry.remove(role, address):
            raise oa.APIError(404, f"no {role.value} worker {address}")
        return JSONResponse({"removed": address})

    app.add_api_route("/workers", list_workers, methods=["GET"], **admin)
    app.add_api_route("/workers", add_worker, methods=["POST"], **admin)
    app.add_api_route("/workers", remove_worker, methods=["DELETE"], **admin)


def _worker_body(raw: bytes) -> tuple[Role, str]:
    try:
        body = json.loads(raw)
        role, address = Role(body["role"]), str(body["address"])
    except (ValueError, KeyError, TypeError):
        raise oa.APIError(400, 'the body must be {"role": "prefill" or "decode", "address": "host:port"}') from None
    if not valid_address(address):
        raise oa.APIError(400, f'address must be "host:port" (IPv6: "[addr]:port", port 1-65535), not {address!r}',
                          param="address")
    return role, address


def valid_address(address: str) -> bool:
    """``host:port`` with a port in 1-65535; an IPv6 host in brackets (``[::1]:7001``)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return False
    if host.startswith("["):
        return host.endswith("]") and len(host) > 2
    return ":" not in host and "]" not in host


class _RouterCollector:
    """Per-worker state and load, queue size and retries, one snapshot per scrape."""

    def __init__(self, registry: Registry, backend: PDBackend, caches: CacheView) -> None:
        self.registry, self.backend, self.caches = registry, backend, caches

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        load = GaugeMetricFamily("tierserve_worker_load", "Router requests on a worker", labels=["role", "worker"])
        healthy = GaugeMetricFamily("tierserve_worker_available", "1 if the worker gets traffic",
                                    labels=["role", "worker"])
        for w in self.registry.listed():
            load.add_metric([w.role.value, w.address], w.load)
            healthy.add_metric([w.role.value, w.address], float(w.available))
        yield load
        yield healthy
        yield self._indexed()
        yield GaugeMetricFamily("tierserve_router_queued_requests", "Requests waiting for a slot",
                                value=self.backend.queued)
        yield CounterMetricFamily("tierserve_router_retries", "Retries on a new pair", value=self.backend.retries)
        migrations = CounterMetricFamily("tierserve_router_migrations", "Requests continued on another decode "
                                         "node after theirs failed, went silent or drained", labels=["reason"])
        for reason, n in self.backend.migrations.by_reason.items():
            migrations.add_metric([reason], n)
        yield migrations
        yield CounterMetricFamily("tierserve_router_migrations_given_up", "Requests past --max-migrations",
                                  value=self.backend.migrations.given_up)
        served = CounterMetricFamily("tierserve_router_served", "Tries per path: prefill_decode (a prefill node "
                                     "computed the prompt) or decode_only (the decode node did)", labels=["path"])
        for path, count in self.backend.served.items():
            served.add_metric([path.value], count)
        yield served
        yield CounterMetricFamily("tierserve_router_spilled", "decode_only tries of prompts the decode node "
                                  "prefilled as the prefill nodes were backed up (--disaggregation-spill-priority)",
                                  value=self.backend.spilled)

    def _indexed(self) -> GaugeMetricFamily:
        pages = GaugeMetricFamily("tierserve_router_indexed_pages", "Pages the router's KV-event index holds "
                                  "for a worker", labels=["role", "worker", "medium"])
        for w in self.registry.listed():
            held = self.caches.pages(w)
            pages.add_metric([w.role.value, w.address, "device"], held.device)
            pages.add_metric([w.role.value, w.address, "host"], held.host)
        return pages


def serve_router(config: RouterConfig, host: str, port: int, tasks: list[Task] | None = None,
                 on_ready: Callable[[], None] | None = None) -> None:
    registry = Registry(check_interval_s=config.health_check_interval_s, drain_timeout_s=config.drain_timeout_s,
                        node_token=config.node_token, tls=config.tls)
    run_http(create_router_app(config, registry, tasks), host, port, on_ready)
