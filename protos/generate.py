"""Regenerate the committed gRPC code: `python -m protos.generate` (needs grpcio-tools 1.78.0).

The generated files are committed so that installing pdserve needs no code generation;
tests/test_protos.py regenerates into a temp dir and checks the committed files are current.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO = "protos/pdserve.proto"
GENERATED = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc with the repo root as include path, so the stubs import `protos.pdserve_pb2`."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{REPO}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(REPO / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return [out_dir / "protos" / name for name in GENERATED]


def main() -> int:
    paths = generate(REPO)
    print("generated " + ", ".join(str(p.relative_to(REPO)) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
