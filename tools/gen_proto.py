"""Regenerate the checked-in protobuf/gRPC code from proto/ (``--check``: fail on drift).

Two sets, each generated into one package, its gRPC modules importing their messages
package-relative (so each package carries its code without depending on where it sits):

- ``kvstored/v1/kvstored.proto`` into ``client/kvstored_client/contract/proto``, part of the
  contract the SDK and the daemon share (the SDK carries it without importing the daemon);
- the router's ``kvstored/v1/router.proto`` and llm-d's ``indexer/v1/indexer.proto`` into
  ``kvstored/router/proto`` (only the router process serves them).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
# (target package, [proto files relative to proto/])
SETS = [
    (ROOT / "client" / "kvstored_client" / "contract" / "proto", ["kvstored/v1/kvstored.proto"]),
    (ROOT / "kvstored" / "router" / "proto", ["kvstored/v1/router.proto", "indexer/v1/indexer.proto"]),
]


def _outputs(protos: list[str]) -> list[tuple[str, str]]:
    """(path under protoc's output, file name in the package) of every generated file."""
    out = []
    for proto in protos:
        stem = proto.removesuffix(".proto")
        name = stem.rsplit("/", 1)[-1]
        out += [(f"{stem}{suffix}", f"{name}{suffix}") for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return out


def generate(out: Path, protos: list[str]) -> list[str]:
    """Run protoc (from grpcio-tools) into ``out``; raises on a protoc error. Returns the names."""
    from grpc_tools import protoc  # dev dependency only

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                *[str(PROTO_ROOT / p) for p in protos]]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out.mkdir(parents=True, exist_ok=True)
        names = []
        for produced, name in _outputs(protos):
            text = (Path(tmp) / produced).read_text()
            for proto in protos:
                package, _, module = proto.removesuffix(".proto").replace("/", ".").rpartition(".")
                text = text.replace(f"from {package} import {module}_pb2", f"from . import {module}_pb2")
            (out / name).write_text(text)
            names.append(name)
        return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if checked-in code drifted")
    args = parser.parse_args()
    drifted = []
    for target, protos in SETS:
        if not args.check:
            names = generate(target, protos)
            (target / "__init__.py").write_text('"""Generated protobuf/gRPC code (tools/gen_proto.py)."""\n')
            print(f"generated {', '.join(names)} in {target.relative_to(ROOT)}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            names = generate(Path(tmp), protos)
            drifted += [f"{target.relative_to(ROOT)}/{n}" for n in names if not (target / n).exists()
                        or not filecmp.cmp(Path(tmp) / n, target / n, shallow=False)]
    if not args.check:
        return 0
    if drifted:
        print(f"generated code drifted from proto/: {', '.join(drifted)}; run python tools/gen_proto.py",
              file=sys.stderr)
        return 1
    print("generated code matches proto/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
