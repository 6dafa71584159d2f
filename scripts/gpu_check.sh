#!/bin/bash
# The GPU check, in two halves (docs/mooncake.md, "On a GPU").
#   bash scripts/gpu_check.sh bundle   # here (pip works): packs what the GPU machine lacks into .gpu/
#   bash scripts/gpu_check.sh run      # there (no registry): unpacks it and runs the `gpu` tests
# The GPU machine has Python 3.12 with torch (CUDA 13) but none of our other dependencies, and
# carries at most 64 MiB: the CUDA Mooncake wheel (98 MB) travels stripped of what we never load
# (its process group, EP kernels, benchmarks, store client) and xz-compressed with the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types
        annotated-doc typing-inspection==0.4.5 typing_extensions==4.16.0 uvicorn==0.54.0 anyio==4.16.0
        pyzmq==27.3.0 grpcio==1.85.3 grpcio-health-checking==1.85.1 protobuf==7.36.2 gguf
        openai==3.57.0 jiter==0.19.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 sniffio==1.3.1
        llguidance==1.9.1 opentelemetry-api==1.45.2 importlib-metadata nvidia-cuda-runtime-cu12 mooncake-transfer-engine==0.3.13.post1)
UNUSED=(libmooncake_pg.so transfer_engine_bench libmooncake_ep_device.so mooncake_client 'pg_*.so' '_ep*.so'
        libmooncake_pg_device.so)

bundle() {
    local tmp; tmp=$(mktemp -d)
    local plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
    for p in manylinux_2_{17,24,27,28,31,34}_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
        plat+=(--platform "$p"); done
    .venv/bin/python -m pip download -q --no-deps "${plat[@]}" -d "$tmp/w" "${WHEELS[@]}"
    mkdir -p "$tmp/site" "$tmp/lib"
    for f in "$tmp"/w/*.whl; do unzip -qo "$f" -d "$tmp/site"; done
    mv "$tmp"/site/nvidia/cuda_runtime/lib/libcudart.so.12 "$tmp/lib/" && rm -rf "$tmp/site/nvidia"
    (cd "$tmp/site/mooncake" && for u in "${UNUSED[@]}"; do rm -f $u; done)
    for l in libibverbs.so.1 libmlx5.so.1 libnuma.so.1; do
        cp -L "$(ldconfig -p | grep -m1 "$l " | awk '{print $NF}')" "$tmp/lib/"; done
    mkdir -p .gpu && grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    tar -C "$tmp" -cf - site lib | xz -T2 -6 > .gpu/bundle.tar.xz
    rm -rf "$tmp" && ls -l .gpu/bundle.tar.xz
}

run() {
    export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/g/site:$PWD/src:$PWD/tests
    export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/tmp/g/lib  # the machine's own libraries win
    mkdir -p /tmp/g && tar -xJf .gpu/bundle.tar.xz -C /tmp/g
    nvidia-smi -L
    python3 -c "import torch; print('torch', torch.__version__, 'devices', torch.cuda.device_count())"
    timeout 400 python3 -m pytest -m gpu tests/test_gpu.py tests/test_gpu_tp.py -v -p no:cacheprovider \
        --timeout=240 -rA 2>&1 | tee "${OUT:-/tmp}/gpu.log"
}

"${1:?bundle or run}"
