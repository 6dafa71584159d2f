"""Regenerates the Python stubs of the control-plane contract from ``tierserve.proto``.

    python -m tierserve.proto.generate [--out DIR]

Needs ``grpcio-tools`` (a dev dependency). The stubs are committed; a test checks that
regenerating them gives no difference.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SRC = Path(__file__).resolve().parents[2]  # the folder holding the `tierserve` package
PROTO = "tierserve/proto/tierserve.proto"


def generate(out: Path) -> list[Path]:
    """Writes tierserve_pb2.py, tierserve_pb2.pyi and tierserve_pb2_grpc.py under ``out``
    (mirroring the package path) and returns them."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{SRC}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", str(SRC / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    folder = out / "tierserve" / "proto"
    return [folder / n for n in ("tierserve_pb2.py", "tierserve_pb2.pyi", "tierserve_pb2_grpc.py")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SRC, help="root folder for the generated package path")
    for path in generate(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
