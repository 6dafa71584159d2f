"""Kubernetes service discovery for the router's worker registry (``docs/router.md``).

One LIST + WATCH loop per role's label selector over the pods API. A pod is a worker while it is
Running, has a pod IP, is not terminating (no deletionTimestamp) and its Ready condition is True;
``events()`` yields ADDED when a pod starts being one and REMOVED when it stops. After a 410 Gone,
an ERROR event or a dropped connection the loop re-LISTs, yields the difference against what it had
told the consumer, and watches again, with jittered exponential backoff on failures. It never
raises to the consumer: while the API server is unreachable the last known workers stay (the
router's health checks and circuit breakers judge them), and discovery resumes when it is back.
No torch here: the router imports this.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import httpx

from tierserve.router.roles import Role

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
GRPC_PORT_NAME = "grpc"
LIST_PAGE_SIZE = 500
# A watch that ends cleanly sooner than this (and saw nothing) counts as a failure, so an API
# server that closes every watch at once cannot make us spin.
MIN_HEALTHY_WATCH_S = 1.0
# Read timeout beyond the server-side watch timeout: a silently dead connection is noticed.
WATCH_READ_SLACK_S = 30.0

Pod = Mapping[str, Any]


class DiscoveryKind(StrEnum):
    ADDED = "added"
    REMOVED = "removed"


@dataclass(frozen=True)
class DiscoveryEvent:
    """A worker appeared (ADDED) or must no longer get traffic (REMOVED); ``address`` is host:port."""

    kind: DiscoveryKind
    role: Role
    address: str
    pod: str


class _Gone(Exception):
    """The resourceVersion (or list continue token) expired: only a fresh LIST can resume."""


class _ApiError(Exception):
    """The API answered with an error status or an ERROR watch event other than 410."""


def pod_address(pod: Pod, default_port: int) -> str | None:
    """``podIP:port`` (``[ip]:port`` for IPv6) if the pod may take traffic now, else None.

    The port is the container port named "grpc" if any container declares one, else ``default_port``.
    """
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ip = status.get("podIP")
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not ip or not _is_ready(status):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"{host}:{_grpc_port(pod) or default_port}"


def _is_ready(status: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def _grpc_port(pod: Pod) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == GRPC_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return None


class _Backoff:
    """Exponential delays with equal jitter (half fixed, half random): spreads the routers' retries
    after an API server restart without ever retrying at once."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self._initial, self._max, self._failures = initial_s, max_s, 0

    def next_delay(self) -> float:
        delay = min(self._max, self._initial * 2 ** self._failures)
        self._failures = min(self._failures + 1, 32)
        return delay / 2 + random.uniform(0, delay / 2)

    def reset(self) -> None:
        self._failures = 0


@dataclass
class _Api:
    """The pods endpoint of one namespace over a shared client; auth is read per request so a
    rotated service-account token is picked up."""

    client: httpx.AsyncClient
    url: str
    token: str | None
    token_file: Path | None
    watch_timeout_s: int

    def headers(self) -> dict[str, str]:
        token = self.token
        if self.token_file is not None:
            with contextlib.suppress(OSError):  # mid-rotation: keep the last good one
                self.token = token = self.token_file.read_text().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def get_json(self, params: Mapping[str, str]) -> dict[str, Any]:
        response = await self.client.get(self.url, params=params, headers=self.headers())
        _raise_for_status(response.status_code, response.text)
        return response.json()

    @contextlib.asynccontextmanager
    async def watch_lines(self, params: Mapping[str, str]) -> AsyncIterator[AsyncIterator[str]]:
        """Yields the stream's lines (newline-delimited JSON watch events)."""
        timeout = httpx.Timeout(self.client.timeout.connect, read=self.watch_timeout_s + WATCH_READ_SLACK_S)
        async with self.client.stream("GET", self.url, params=params, headers=self.headers(),
                                      timeout=timeout) as response:
            if response.status_code != 200:
                _raise_for_status(response.status_code, (await response.aread()).decode(errors="replace"))
            yield response.aiter_lines()


def _raise_for_status(code: int, body: str) -> None:
    if code == 410:
        raise _Gone(body[:200])
    if code != 200:
        raise _ApiError(f"HTTP {code}: {body[:200]}")


class _RoleWatcher:
    """LIST + WATCH for one role's selector; ``known`` is what the consumer was told (pod -> address)."""

    def __init__(self, api: _Api, role: Role, selector: str, port: int, backoff: _Backoff) -> None:
        self.api, self.role, self.selector, self.port, self.backoff = api, role, selector, port, backoff
        self.known: dict[str, str] = {}
        self.resource_version = ""

    async def run(self, emit: Callable[[DiscoveryEvent], None]) -> None:
        """Runs until cancelled; every failure is logged and retried, never raised."""
        while True:
            try:
                await self._relist(emit)
                await self._watch(emit)
            except _Gone as exc:
                log.info("k8s %s watch: resourceVersion expired (%s); re-listing", self.role.value, exc)
            except Exception as exc:  # never crash the router: log, back off, re-list
                log.warning("k8s %s discovery failed (%s: %s); re-listing", self.role.value, type(exc).__name__, exc)
            await asyncio.sleep(self.backoff.next_delay())

    async def _relist(self, emit: Callable[[DiscoveryEvent], None]) -> None:
        """Brings ``known`` to the listed state, emitting the difference, and sets the resourceVersion."""
        pods, self.resource_version = await self._list()
        fresh = {name: addr for pod in pods if (name := _name(pod)) and (addr := pod_address(pod, self.port))}
        for name in sorted(self.known.keys() - fresh.keys()):
            self._update(name, None, emit)
        for name, address in fresh.items():
            self._update(name, address, emit)
        log.debug("k8s %s: listed %d pods, %d ready", self.role.value, len(pods), len(fresh))

    async def _list(self) -> tuple[list[Pod], str]:
        params = {"labelSelector": self.selector, "limit": str(LIST_PAGE_SIZE)}
        pods: list[Pod] = []
        while True:  # pages of one consistent snapshot; an expired continue token is a 410
            body = await self.api.get_json(params)
            pods += body.get("items") or []
            meta = body.get("metadata") or {}
            if not meta.get("continue"):
                return pods, str(meta.get("resourceVersion") or "")
            params = {**params, "continue": meta["continue"]}

    async def _watch(self, emit: Callable[[DiscoveryEvent], None]) -> None:
        """Watches from the current resourceVersion; re-watches when a watch ends cleanly (the
        server-side timeout). Returns never; raises on errors so ``run`` re-lists."""
        while True:
            started = time.monotonic()
            saw_events = await self._watch_once(emit)
            if not saw_events and time.monotonic() - started < MIN_HEALTHY_WATCH_S:
                await asyncio.sleep(self.backoff.next_delay())

    async def _watch_once(self, emit: Callable[[DiscoveryEvent], None]) -> bool:
        params = {"labelSelector": self.selector, "watch": "1", "resourceVersion": self.resource_version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(self.api.watch_timeout_s)}
        saw_events = False
        async with self.api.watch_lines(params) as lines:
            async for line in lines:
                if line.strip():
                    self._apply(json.loads(line), emit)
                    saw_events = True
                    self.backoff.reset()  # the API is healthy again
        return saw_events

    def _apply(self, event: Mapping[str, Any], emit: Callable[[DiscoveryEvent], None]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone(obj.get("message", "Gone"))
            raise _ApiError(f"watch ERROR {obj.get('code')}: {obj.get('message')}")
        name = _name(obj)
        if kind in ("ADDED", "MODIFIED") and name:
            self._update(name, pod_address(obj, self.port), emit)
        elif kind == "DELETED" and name:
            self._update(name, None, emit)
        elif kind != "BOOKMARK":
            log.debug("k8s %s: ignoring watch event %r", self.role.value, kind)
        # Bookmarks exist only to advance this, so a re-watch does not replay or hit 410.
        self.resource_version = str((obj.get("metadata") or {}).get("resourceVersion") or self.resource_version)

    def _update(self, name: str, address: str | None, emit: Callable[[DiscoveryEvent], None]) -> None:
        """Moves pod ``name`` to ``address`` (None: not a worker), emitting only real changes, so a
        DELETED after a terminating MODIFIED yields one REMOVED. Events are per address, as the
        registry keys workers: a pod IP reused while the old pod is still known (events can lag)
        yields no second ADDED, and no REMOVED while another known pod still has it."""
        old = self.known.get(name)
        if old == address:
            return
        if old is not None:
            del self.known[name]
            if old not in self.known.values():
                emit(DiscoveryEvent(DiscoveryKind.REMOVED, self.role, old, name))
        if address is not None:
            if address not in self.known.values():
                emit(DiscoveryEvent(DiscoveryKind.ADDED, self.role, address, name))
            self.known[name] = address


def _name(pod: Pod) -> str:
    return str((pod.get("metadata") or {}).get("name") or "")


class KubernetesDiscovery:
    """Watches the pods matching each role's label selector in one namespace.

    ``port`` is the default worker port (one for all roles, or per role) used when a pod declares
    no container port named "grpc". ``token`` is a bearer token; ``token_file``, if given, is
    re-read before each request (service-account tokens are rotated). ``ca_file`` is the CA bundle
    of the API server; ``verify=False`` disables TLS verification (tests, kind clusters only).
    """

    def __init__(self, api_base: str, namespace: str, selectors: Mapping[Role, str], port: int | Mapping[Role, int],
                 token: str | None = None, ca_file: str | None = None, verify: bool = True, *,
                 token_file: str | Path | None = None, watch_timeout_s: int = 300, request_timeout_s: float = 10.0,
                 backoff_initial_s: float = 0.5, backoff_max_s: float = 30.0) -> None:
        if not selectors:
            raise ValueError("KubernetesDiscovery needs at least one role selector")
        self.api_base = api_base.rstrip("/")
        self.namespace = namespace
        self.selectors = {Role(role): selector for role, selector in selectors.items()}
        self.ports = {role: port if isinstance(port, int) else port[role] for role in self.selectors}
        self.token, self.token_file = token, Path(token_file) if token_file else None
        self.ca_file, self.verify = ca_file, verify
        self.watch_timeout_s, self.request_timeout_s = watch_timeout_s, request_timeout_s
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s

    @classmethod
    def in_cluster(cls, selectors: Mapping[Role, str], port: int | Mapping[Role, int], *,
                   namespace: str | None = None, sa_dir: str | Path = SERVICE_ACCOUNT_DIR,
                   env: Mapping[str, str] | None = None, **kwargs: Any) -> KubernetesDiscovery:
        """From the pod's service account (token, ca.crt, namespace under ``sa_dir``) and the
        KUBERNETES_SERVICE_HOST/PORT variables; ``namespace`` overrides the pod's own.
        Raises RuntimeError when not running in a cluster."""
        env = os.environ if env is None else env
        sa_dir = Path(sa_dir)
        host, api_port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not (sa_dir / "token").is_file():
            raise RuntimeError(f"not in a Kubernetes pod: KUBERNETES_SERVICE_HOST unset or no {sa_dir / 'token'}")
        host = f"[{host}]" if ":" in host else host
        if namespace is None:
            namespace = (sa_dir / "namespace").read_text().strip()
        ca = sa_dir / "ca.crt"
        return cls(f"https://{host}:{api_port}", namespace, selectors, port, token=None,
                   ca_file=str(ca) if ca.is_file() else None, verify=True, token_file=sa_dir / "token", **kwargs)

    async def events(self) -> AsyncIterator[DiscoveryEvent]:
        """Yields worker changes forever (initial LIST first, then WATCH); never raises.

        Each call starts from nothing: its first events are ADDED for every ready pod. Close it
        (``contextlib.aclosing``, or cancel the consuming task) to stop its watches.
        """
        queue: asyncio.Queue[DiscoveryEvent] = asyncio.Queue()
        async with httpx.AsyncClient(verify=self._tls(), timeout=self.request_timeout_s) as client:
            api = _Api(client, f"{self.api_base}/api/v1/namespaces/{self.namespace}/pods",
                       self.token, self.token_file, self.watch_timeout_s)
            watchers = [_RoleWatcher(api, role, selector, self.ports[role],
                                     _Backoff(self.backoff_initial_s, self.backoff_max_s))
                        for role, selector in self.selectors.items()]
            tasks = [asyncio.create_task(w.run(queue.put_nowait), name=f"k8s-discovery-{w.role.value}")
                     for w in watchers]
            try:
                while True:
                    yield await queue.get()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def _tls(self) -> ssl.SSLContext | bool:
        if not self.verify:
            return False
        return ssl.create_default_context(cafile=self.ca_file) if self.ca_file else True
