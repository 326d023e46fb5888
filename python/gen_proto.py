#!/usr/bin/env python3
"""Generates src/vmmd/vmmd.binpb from ../proto with grpcio-tools' protoc.

The package builds its message classes and service calls from this descriptor
set at import (vmmd._proto), so the contract comes from proto/ alone, never a
hand copy, and works with any protobuf runtime from 4.21 on (generated _pb2
modules pin the runtime to the generator's major version). Run it after a
change to proto/; tests/test_proto.py fails while the checked-in file is stale.

    python3 python/gen_proto.py [--check]
"""
from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.join(os.path.dirname(HERE), "proto")
TARGET = os.path.join(HERE, "src", "vmmd", "vmmd.binpb")


def generate(out: str) -> None:
    from grpc_tools import protoc  # grpcio-tools, a build and test dependency only

    files = sorted(
        os.path.join("vmmd", "v1", name)
        for name in os.listdir(os.path.join(PROTO_ROOT, "vmmd", "v1"))
        if name.endswith(".proto")
    )
    code = protoc.main(["protoc", f"-I{PROTO_ROOT}", "--include_imports", f"--descriptor_set_out={out}", *files])
    if code != 0:
        raise SystemExit(f"gen_proto: protoc failed with {code}")


def main() -> int:
    if "--check" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = os.path.join(tmp, "vmmd.binpb")
            generate(fresh)
            with open(fresh, "rb") as a, open(TARGET, "rb") as b:
                if a.read() != b.read():
                    print(f"gen_proto: {TARGET} is stale: run python3 python/gen_proto.py", file=sys.stderr)
                    return 1
        return 0
    generate(TARGET)
    print(f"gen_proto: wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
