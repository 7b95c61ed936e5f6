"""Generate the Python gRPC stubs in services/podrl/v1 from proto/podrl/v1/*.proto.

``python -m podrl.tools.gen_proto`` (or ``make proto``) rewrites the committed stubs;
``generate(out_dir)`` writes them elsewhere, which the drift test compares against.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
PROTO_ROOT = REPO_ROOT / "proto"
STUB_ROOT = REPO_ROOT / "services"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "podrl" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (grpcio-tools) for every .proto; returns the files written under out_dir."""
    from grpc_tools import protoc  # dev dependency: imported only when generating

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see the messages above")
    return sorted((out_dir / "podrl" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    written = generate(STUB_ROOT)
    print(f"wrote {len(written)} files under {STUB_ROOT / 'podrl' / 'v1'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
