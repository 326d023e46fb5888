"""The package's contract is generated from proto/ and nothing else."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT


def test_the_checked_in_descriptor_set_matches_proto() -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools generates the contract (pip install 'vmmd[test]')")
    script = os.path.join(ROOT, "python", "gen_proto.py")
    result = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_service_of_proto_is_loaded() -> None:
    from vmmd import _proto

    names = sorted(n[:-6] for n in os.listdir(os.path.join(ROOT, "proto", "vmmd", "v1")) if n.endswith(".proto"))
    services = []
    for name in names:
        with open(os.path.join(ROOT, "proto", "vmmd", "v1", f"{name}.proto")) as f:
            services += [line.split()[1] for line in f if line.startswith("service ")]
    assert sorted(services) == ["Admin", "Devices", "Stores", "VirtualMemory"]
    for service in services:
        assert _proto.methods(service)
