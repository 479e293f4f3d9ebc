"""Regenerate the checked-in protobuf/gRPC code from proto/ (``--check``: fail on drift).

The generated modules live in ``client/kvstored_client/contract/proto``, part of the contract the
SDK and the daemon share (the SDK carries them without importing the daemon); the gRPC module
imports its messages package-relative for that reason.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTOS = ["kvstored/v1/kvstored.proto"]
TARGET = ROOT / "client" / "kvstored_client" / "contract" / "proto"
GENERATED = ["kvstored_pb2.py", "kvstored_pb2.pyi", "kvstored_pb2_grpc.py"]


def generate(out: Path) -> None:
    """Run protoc (from grpcio-tools) into ``out``; raises on a protoc error."""
    from grpc_tools import protoc  # dev dependency only

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(PROTO_ROOT / p) for p in PROTOS],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            text = (Path(tmp) / "kvstored" / "v1" / name).read_text()
            text = text.replace("from kvstored.v1 import kvstored_pb2", "from . import kvstored_pb2")
            (out / name).write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if checked-in code drifted")
    args = parser.parse_args()
    if not args.check:
        generate(TARGET)
        (TARGET / "__init__.py").write_text('"""Generated protobuf/gRPC code (tools/gen_proto.py)."""\n')
        print(f"generated {', '.join(GENERATED)} in {TARGET.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        drifted = [n for n in GENERATED if not (TARGET / n).exists()
                   or not filecmp.cmp(Path(tmp) / n, TARGET / n, shallow=False)]
    if drifted:
        print(f"generated code drifted from proto/: {', '.join(drifted)}; run python tools/gen_proto.py",
              file=sys.stderr)
        return 1
    print("generated code matches proto/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
