"""Regenerate the committed gRPC code: `python -m pdserve.protos.generate` (needs grpcio-tools 1.78.0).

The generated files are committed so that installing pdserve needs no code generation;
tests/protos/test_generated_code.py regenerates into a temp dir and checks the committed files are current.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO = "protos/pdserve.proto"
GENERATED = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on the proto as `pdserve/protos/pdserve.proto` (its installed place), so the stubs
    import `pdserve.protos.pdserve_pb2`; the files land in out_dir itself."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        include, gen = Path(tmp) / "include", Path(tmp) / "out"
        (include / "pdserve" / "protos").mkdir(parents=True)
        gen.mkdir()
        shutil.copy(REPO / PROTO, include / "pdserve" / PROTO)
        args = ["protoc", f"-I{include}", f"--python_out={gen}", f"--pyi_out={gen}",
                f"--grpc_python_out={gen}", str(include / "pdserve" / PROTO)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copy(gen / "pdserve" / "protos" / name, out_dir / name)
    return [out_dir / name for name in GENERATED]


def main() -> int:
    paths = generate(REPO / "protos")
    print("generated " + ", ".join(str(p.relative_to(REPO)) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
