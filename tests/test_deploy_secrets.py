"""deploy/'s secrets (docs/tenancy.md): in every overlay the nodes and the
router take the node token and the TLS files from Kubernetes Secrets, at the paths their flags name.
Helpers from helpers/k8s_manifests.py; the cpu-demo run in test_deploy.py uses such a Secret's files."""

from __future__ import annotations

import re

import pytest
from helpers.k8s_manifests import (
    OVERLAYS,
    WORKLOAD_KINDS,
    command_line,
    container_env,
    flag_value,
    needs_kubectl,
    of_kind,
    pod_fields,
    pod_spec,
    render,
    role,
)
from helpers.local_k8s import TLS_VOLUME

TLS_SECRET = "tierserve-tls"
TLS_FILES = {"--tls-cert": "tls.crt", "--tls-key": "tls.key", "--tls-ca": "ca.crt"}  # keys of the Secret


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nodes_and_router_take_the_token_and_tls_from_secrets(overlay: str) -> None:
    """Every gRPC server and its one client (the router) get the node token and the TLS files from
    the Secrets, the files at the paths their flags name; the router checks the nodes' certificates
    for the configured DNS name; the kubelet probes the nodes without gRPC (it cannot speak TLS)."""
    objects = render(overlay)
    assert not [o for o in of_kind(objects, "Secret") if o["metadata"]["name"] == TLS_SECRET], "made by hand"
    for workload in (w for w in of_kind(objects, *WORKLOAD_KINDS) if role(w) != "mooncake-master"):
        main = pod_spec(workload)["containers"][0]
        env = container_env(main, objects, pod_fields(workload, "10.1.2.3"))
        argv = command_line(main, env)
        # cpu-demo generates that Secret, which gives it a content-hash suffix
        assert re.fullmatch(r"secret-tierserve-node-token(-\w+)?-token", env["TIERSERVE_NODE_TOKEN"]), role(workload)
        mount = _tls_mount(workload, main)
        assert {flag: flag_value(argv, flag) for flag in TLS_FILES} == \
            {flag: f"{mount}/{key}" for flag, key in TLS_FILES.items()}, role(workload)
        if role(workload) == "router":
            assert flag_value(argv, "--tls-server-name") == env["TIERSERVE_TLS_SERVER_NAME"] != ""
        else:
            probes = [main[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in main]
            assert probes and not any("grpc" in p for p in probes), role(workload)


def _tls_mount(workload: dict, container: dict) -> str:
    volume = next(v for v in pod_spec(workload)["volumes"] if v["name"] == TLS_VOLUME)
    assert volume["secret"]["secretName"] == TLS_SECRET
    mounts = [m for m in container["volumeMounts"] if m["name"] == TLS_VOLUME]
    assert len(mounts) == 1 and mounts[0].get("readOnly"), container["name"]
    return mounts[0]["mountPath"]
