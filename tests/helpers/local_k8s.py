"""The cpu-demo overlay run as local processes (``LocalCluster``): what a cluster would provide
mapped onto loopback by rewriting the rendered values, never by editing the manifests."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.k8s_manifests import (
    DEPLOY,
    DISCOVERY_FLAGS,
    VENV_BIN,
    WORKLOAD_KINDS,
    command_line,
    container_env,
    containers,
    missing,
    named_port,
    of_kind,
    pod_fields,
    pod_spec,
    role,
    selects,
)
from helpers.polling import wait_until
from helpers.processes import free_port

# ---- the TLS Secret's files ------------------------------------------------------------------

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


# ---- the manifests as processes ------------------------------------------------------------------

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
