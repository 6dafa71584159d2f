"""KubernetesDiscovery against a loopback stand-in of the Kubernetes pods API.

The stand-in keeps a pod store with resourceVersions and an event log like the API server: LIST
returns the pods matching ``labelSelector`` and the store's resourceVersion; WATCH streams
(chunked, newline-delimited JSON) the logged events after the given resourceVersion, then live
ones; a watch from a compacted resourceVersion gets an ERROR 410 event.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest

from tierserve.router.k8s import DiscoveryEvent, DiscoveryKind, KubernetesDiscovery, pod_address
from tierserve.router.roles import Role

pytestmark = pytest.mark.fakes  # a loopback stand-in of the Kubernetes pods API

NS = "serving"
SELECTORS = {Role.PREFILL: "app.kubernetes.io/name=tierserve,tierserve.io/role=prefill",
             Role.DECODE: "app.kubernetes.io/name=tierserve,tierserve.io/role=decode"}
ADDED, REMOVED = DiscoveryKind.ADDED, DiscoveryKind.REMOVED


def make_pod(name: str, role: str = "prefill", ip: str | None = "10.244.1.7", *, ready: bool = True,
             phase: str = "Running", grpc_port: int | None = 50051, deleting: bool = False) -> dict:
    """A pod object shaped like the API server's (the fields discovery reads, plus typical others)."""
    ports = [{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]
    if grpc_port:
        ports.insert(0, {"name": "grpc", "containerPort": grpc_port, "protocol": "TCP"})
    flag = "True" if ready else "False"
    meta = {"name": name, "namespace": NS, "uid": f"uid-{name}", "creationTimestamp": "2025-05-01T10:00:00Z",
            "labels": {"app.kubernetes.io/name": "tierserve", "tierserve.io/role": role,
                       "pod-template-hash": "7d9f8c6b5"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"tierserve-{role}"}]}
    if deleting:
        meta |= {"deletionTimestamp": "2025-05-01T11:00:00Z", "deletionGracePeriodSeconds": 30}
    status = {"phase": phase, "hostIP": "172.18.0.3", "startTime": "2025-05-01T10:00:01Z",
              "conditions": [{"type": t, "status": "True" if t in ("Initialized", "PodScheduled") else flag,
                              "lastTransitionTime": "2025-05-01T10:00:05Z"}
                             for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")]}
    if ip:
        status |= {"podIP": ip, "podIPs": [{"ip": ip}]}
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "status": status,
            "spec": {"nodeName": "worker-1", "containers": [
                {"name": "tierserve", "image": "tierserve:0.1.0", "ports": ports}]}}


def matches(selector: str, labels: dict[str, str]) -> bool:
    pairs = (term.replace("==", "=").split("=", 1) for term in selector.split(",") if term)
    return all(labels.get(key) == value for key, value in pairs)


class FakeKubeApi:
    """Pods of one namespace. Test-side mutations are thread-safe; watches run in server threads."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.rv = 100
        self.pods: dict[str, dict] = {}
        self.log: list[tuple[int, str, dict]] = []
        self.horizon = 0  # watches from an older resourceVersion get 410
        self.epoch, self.end_mode, self.held, self.closed = 0, "", False, False
        self.list_failures = 0
        self.requests: list[tuple[dict[str, str], str | None]] = []
        self.base = ""

    def _record(self, kind: str, obj: dict) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.log.append((self.rv, kind, copy.deepcopy(obj)))
        self.cond.notify_all()

    def put(self, pod: dict) -> None:
        with self.cond:
            kind = "MODIFIED" if pod["metadata"]["name"] in self.pods else "ADDED"
            self.pods[pod["metadata"]["name"]] = pod
            self._record(kind, pod)

    def delete(self, name: str) -> None:
        with self.cond:
            self._record("DELETED", self.pods.pop(name))

    def bookmark(self) -> int:
        with self.cond:
            self._record("BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": {}})
            return self.rv

    def hold(self) -> None:
        """Open watches stop seeing events: what happens next is lost to them unless they re-list."""
        with self.cond:
            self.held = True

    def end_watches(self, mode: str) -> None:
        """Ends open watches: "gone" compacts the log (ERROR 410), "drop" cuts the socket, "clean" ends
        the stream as the server-side timeout does."""
        with self.cond:
            if mode == "gone":
                self.horizon = self.rv
            self.epoch, self.end_mode, self.held = self.epoch + 1, mode, False
            self.cond.notify_all()

    def watches(self) -> list[dict[str, str]]:
        with self.cond:
            return [q for q, _ in self.requests if q.get("watch")]

    def lists(self) -> list[dict[str, str]]:
        with self.cond:
            return [q for q, _ in self.requests if not q.get("watch")]

    async def wait_watches(self, n: int, timeout: float = 5.0) -> None:
        """Until ``n`` watches were started; waits in a thread so the client's event loop runs on."""
        def wait() -> bool:
            with self.cond:
                return self.cond.wait_for(lambda: len([q for q, _ in self.requests if q.get("watch")]) >= n, timeout)
        assert await asyncio.to_thread(wait), f"fewer than {n} watches within {timeout} s"

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    api: FakeKubeApi

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = dict(parse_qsl(url.query))
        with self.api.cond:  # a watch belongs to the epoch it was counted in (see end_watches)
            self.api.requests.append((query, self.headers.get("Authorization")))
            self.api.cond.notify_all()
            epoch = self.api.epoch
        if url.path != f"/api/v1/namespaces/{NS}/pods":
            return self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
        if query.get("watch") in ("1", "true"):
            return self._watch(query, epoch)
        return self._list(query)

    def _json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _list(self, query: dict[str, str]) -> None:
        api, selector = self.api, query.get("labelSelector", "")
        with api.cond:
            if api.list_failures > 0:
                api.list_failures -= 1
                return self._json(500, {"kind": "Status", "code": 500, "message": "etcdserver: request timed out"})
            items = [copy.deepcopy(p) for p in api.pods.values() if matches(selector, p["metadata"]["labels"])]
            rv = str(api.rv)
        self._json(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": rv}, "items": items})

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _watch(self, query: dict[str, str], epoch: int) -> None:
        api, selector, rv = self.api, query.get("labelSelector", ""), int(query["resourceVersion"])
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with api.cond:
            mode = "gone" if rv < api.horizon else ""
        while not mode:
            with api.cond:
                api.cond.wait_for(lambda rv=rv: api.epoch != epoch or api.closed
                                  or (not api.held and api.log[-1][0] > rv if api.log else False))
                if api.epoch != epoch or api.closed:
                    mode = api.end_mode if api.epoch != epoch else "clean"
                # A clean end delivers what was pending; "gone" and "drop" lose it, as held watches do.
                batch = [e for e in api.log if e[0] > rv] if mode in ("", "clean") and not api.held else []
                rv = batch[-1][0] if batch else rv
            for _, kind, obj in batch:
                if kind == "BOOKMARK" or matches(selector, obj["metadata"]["labels"]):
                    self._chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
        self._end(mode)

    def _end(self, mode: str) -> None:
        if mode == "drop":  # no terminating chunk: the client sees a broken stream
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if mode == "gone":
            status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": "too old resource version", "reason": "Expired", "code": 410}
            self._chunk(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


@pytest.fixture
def kube() -> Iterator[FakeKubeApi]:
    api = FakeKubeApi()
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("BoundHandler", (Handler,), {"api": api}))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    api.base = f"http://127.0.0.1:{server.server_port}"
    yield api
    api.close()
    server.shutdown()
    server.server_close()


class Reader:
    """Takes events from ``events()`` with a deadline."""

    def __init__(self, stream: AsyncIterator[DiscoveryEvent]) -> None:
        self.stream = stream

    async def take(self, n: int, timeout: float = 5.0) -> list[tuple[DiscoveryKind, Role, str, str]]:
        async def collect() -> list[tuple[DiscoveryKind, Role, str, str]]:
            return [(e.kind, e.role, e.address, e.pod) for e in [await anext(self.stream) for _ in range(n)]]
        return await asyncio.wait_for(collect(), timeout)


def run(kube: FakeKubeApi, scenario: Callable[[Reader], Awaitable[None]], **kwargs: object) -> None:
    kwargs = {"selectors": {Role.PREFILL: SELECTORS[Role.PREFILL]}, "port": 8000, "token": "t0ken"} | kwargs

    async def main() -> None:
        discovery = KubernetesDiscovery(kube.base, NS, ca_file=None, verify=True, backoff_initial_s=0.02,
                                        backoff_max_s=0.2, **kwargs)
        async with contextlib.aclosing(discovery.events()) as stream:
            await scenario(Reader(stream))

    asyncio.run(asyncio.wait_for(main(), 12))


def test_list_then_watch_follows_readiness(kube: FakeKubeApi) -> None:
    kube.put(make_pod("p-a", ip="10.244.1.7"))
    kube.put(make_pod("p-b", ip="10.244.1.8", ready=False))
    kube.put(make_pod("p-c", ip=None, phase="Pending", ready=False))

    async def scenario(r: Reader) -> None:
        assert await r.take(1) == [(ADDED, Role.PREFILL, "10.244.1.7:50051", "p-a")]
        # A sentinel first: had p-b been emitted by the LIST, it would come before this.
        kube.put(make_pod("p-s", ip="10.244.1.9"))
        assert await r.take(1) == [(ADDED, Role.PREFILL, "10.244.1.9:50051", "p-s")]
        kube.put(make_pod("p-b", ip="10.244.1.8"))
        assert await r.take(1) == [(ADDED, Role.PREFILL, "10.244.1.8:50051", "p-b")]
        kube.put(make_pod("p-a", ip="10.244.1.7", deleting=True))
        assert await r.take(1) == [(REMOVED, Role.PREFILL, "10.244.1.7:50051", "p-a")]
        kube.delete("p-a")  # already removed: no second REMOVED
        kube.put(make_pod("p-b", ip="10.244.1.8", ready=False))
        assert await r.take(1) == [(REMOVED, Role.PREFILL, "10.244.1.8:50051", "p-b")]
        kube.delete("p-s")
        assert await r.take(1) == [(REMOVED, Role.PREFILL, "10.244.1.9:50051", "p-s")]
        kube.delete("p-b")  # not ready already: nothing
        kube.put(make_pod("p-c", ip="10.244.1.10"))
        assert await r.take(1) == [(ADDED, Role.PREFILL, "10.244.1.10:50051", "p-c")]
        # The IP of p-c reused by p-d before p-c's deletion is seen: one worker, one ADDED/REMOVED.
        kube.put(make_pod("p-d", ip="10.244.1.10"))
        kube.delete("p-c")
        kube.put(make_pod("p-e", ip="10.244.1.11"))
        assert await r.take(1) == [(ADDED, Role.PREFILL, "10.244.1.11:50051", "p-e")]
        kube.delete("p-d")
        assert await r.take(1) == [(REMOVED, Role.PREFILL, "10.244.1.10:50051", "p-d")]

    run(kube, scenario)
    assert [q["labelSelector"] for q in kube.lists()] == [SELECTORS[Role.PREFILL]]
    watch = kube.watches()[0]
    assert watch["allowWatchBookmarks"] == "true" and watch["resourceVersion"] == "103"
    assert {auth for _, auth in kube.requests} == {"Bearer t0ken"}


def test_selectors_route_roles_and_ports(kube: FakeKubeApi) -> None:
    kube.put(make_pod("pre-0", "prefill", "10.244.1.1"))
    kube.put(make_pod("pre-1", "prefill", "10.244.1.2", grpc_port=None))
    kube.put(make_pod("dec-0", "decode", "10.244.2.1", grpc_port=None))
    kube.put(make_pod("other", "router", "10.244.3.1"))

    async def scenario(r: Reader) -> None:
        assert set(await r.take(3)) == {(ADDED, Role.PREFILL, "10.244.1.1:50051", "pre-0"),
                                        (ADDED, Role.PREFILL, "10.244.1.2:7000", "pre-1"),
                                        (ADDED, Role.DECODE, "10.244.2.1:7001", "dec-0")}
        kube.put(make_pod("dec-1", "decode", "fd00::5"))
        assert await r.take(1) == [(ADDED, Role.DECODE, "[fd00::5]:50051", "dec-1")]

    run(kube, scenario, selectors=SELECTORS, port={Role.PREFILL: 7000, Role.DECODE: 7001})
    assert sorted(q["labelSelector"] for q in kube.lists()) == sorted(SELECTORS.values())


def test_gone_relists_and_diffs(kube: FakeKubeApi) -> None:
    kube.put(make_pod("p-a", ip="10.244.1.1"))
    kube.put(make_pod("p-b", ip="10.244.1.2"))

    async def scenario(r: Reader) -> None:
        assert {e[3] for e in await r.take(2)} == {"p-a", "p-b"}
        await kube.wait_watches(1)
        kube.hold()  # the watch misses these, then its resourceVersion is compacted away
        kube.delete("p-b")
        kube.put(make_pod("p-c", ip="10.244.1.3"))
        kube.put(make_pod("p-a", ip="10.244.1.1"))  # unchanged: no event
        kube.end_watches("gone")
        assert set(await r.take(2)) == {(REMOVED, Role.PREFILL, "10.244.1.2:50051", "p-b"),
                                        (ADDED, Role.PREFILL, "10.244.1.3:50051", "p-c")}
        kube.put(make_pod("p-d", ip="10.244.1.4"))
        assert await r.take(1) == [(ADDED, Role.PREFILL, "10.244.1.4:50051", "p-d")]

    run(kube, scenario)
    assert len(kube.lists()) == 2
    assert [w["resourceVersion"] for w in kube.watches()] == ["102", "105"]


def test_dropped_watch_and_failing_lists_recover(kube: FakeKubeApi, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    kube.put(make_pod("p-a", ip="10.244.1.1"))

    async def scenario(r: Reader) -> None:
        assert await r.take(1) == [(ADDED, Role.PREFILL, "10.244.1.1:50051", "p-a")]
        await kube.wait_watches(1)
        kube.hold()
        kube.delete("p-a")
        kube.put(make_pod("p-b", ip="10.244.1.2"))
        kube.list_failures = 3  # the API server is unwell for a while: discovery keeps trying
        token.write_text("rotated\n")
        kube.end_watches("drop")
        assert await r.take(2) == [(REMOVED, Role.PREFILL, "10.244.1.1:50051", "p-a"),
                                   (ADDED, Role.PREFILL, "10.244.1.2:50051", "p-b")]
        await kube.wait_watches(2)

    run(kube, scenario, token=None, token_file=token)
    assert len(kube.lists()) == 5 and kube.list_failures == 0
    assert [auth for _, auth in kube.requests] == ["Bearer first"] * 2 + ["Bearer rotated"] * 5


def test_clean_end_rewatches_from_bookmark_without_relisting(kube: FakeKubeApi) -> None:
    kube.put(make_pod("p-a", ip="10.244.1.1"))

    async def scenario(r: Reader) -> None:
        assert len(await r.take(1)) == 1
        await kube.wait_watches(1)
        bookmark = kube.bookmark()
        kube.end_watches("clean")  # as the server-side timeoutSeconds does
        await kube.wait_watches(2)
        assert kube.watches()[1]["resourceVersion"] == str(bookmark)
        kube.put(make_pod("p-c", ip="10.244.1.3"))
        assert await r.take(1) == [(ADDED, Role.PREFILL, "10.244.1.3:50051", "p-c")]

    run(kube, scenario)
    assert len(kube.lists()) == 1


def test_pod_address_rules() -> None:
    assert pod_address(make_pod("a"), 1) == "10.244.1.7:50051"
    assert pod_address(make_pod("a", grpc_port=None), 1) == "10.244.1.7:1"
    assert pod_address(make_pod("a", phase="Succeeded"), 1) is None
    assert pod_address(make_pod("a", ip=None), 1) is None
    assert pod_address(make_pod("a", ready=False), 1) is None
    assert pod_address(make_pod("a", deleting=True), 1) is None
    assert pod_address({"metadata": {"name": "bare"}}, 1) is None


def test_in_cluster_reads_service_account(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("sa-token\n")
    (tmp_path / "namespace").write_text("serving\n")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "6443"}
    d = KubernetesDiscovery.in_cluster(SELECTORS, 50051, sa_dir=tmp_path, env=env)
    assert (d.api_base, d.namespace, d.ca_file, d.verify) == ("https://10.96.0.1:6443", "serving",
                                                               str(tmp_path / "ca.crt"), True)
    assert d.token_file == tmp_path / "token" and d.ports == {Role.PREFILL: 50051, Role.DECODE: 50051}
    with pytest.raises(RuntimeError, match="not in a Kubernetes pod"):
        KubernetesDiscovery.in_cluster(SELECTORS, 50051, sa_dir=tmp_path, env={})


def test_discovered_pods_join_and_leave_the_router_registry(kube: FakeKubeApi) -> None:
    from tierserve.router.discovery import sync_registry
    from tierserve.router.registry import Registry

    kube.put(make_pod("p-a", ip="10.244.1.7"))

    async def main() -> None:
        registry = Registry()
        discovery = KubernetesDiscovery(kube.base, NS, selectors={Role.PREFILL: SELECTORS[Role.PREFILL]}, port=8000,
                                        backoff_initial_s=0.02, backoff_max_s=0.2)
        task = asyncio.create_task(sync_registry(discovery)(registry))
        try:
            await _until(lambda: (Role.PREFILL, "10.244.1.7:50051") in registry.workers)  # its "grpc" port
            kube.delete("p-a")
            await _until(lambda: not registry.workers)
        finally:
            task.cancel()
            await registry.close()

    asyncio.run(asyncio.wait_for(main(), 12))


async def _until(check: Callable[[], bool]) -> None:
    while not check():
        await asyncio.sleep(0.02)  # poll interval; the caller's wait_for is the deadline
