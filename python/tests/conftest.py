"""Fixtures: a real daemon (host backend) on a temporary socket directory,
started as the e2e harness does (node bin/vmmd.js --backend host ...), and
client processes (Python ones, and the TypeScript test peer)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional

import grpc
import pytest

import vmmd
from vmmd import _proto

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DAEMON = os.path.join(ROOT, "bin", "vmmd.js")
PEER = os.path.join(ROOT, "dist", "test", "e2e", "fixtures", "peer.js")
MiB = 1 << 20


class Daemon:
    """A vmmd process on its own socket directory, and a sessionless gRPC channel (as grpcurl)."""

    def __init__(self, extra: Optional[List[str]] = None, backend: str = "host", capacity: str = "256MiB") -> None:
        self.dir = tempfile.mkdtemp(prefix="vmmd-py-")
        node = os.environ.get("VMMD_NODE", "node")
        args = [node, DAEMON, "--backend", backend, "--socket-dir", self.dir, "--log-level", "warn"]
        if backend == "host":
            args += ["--host-capacity", capacity]
        self.log = open(os.path.join(self.dir, "daemon.log"), "w+")
        self.process = subprocess.Popen(args + (extra or []), stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.channel = grpc.insecure_channel(f"unix://{self.dir}/vmmd.sock")
        self.raw = {name: _proto.stub(self.channel, name) for name in ("Devices", "VirtualMemory", "Stores", "Admin")}
        deadline = time.monotonic() + 20
        while True:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"vmmd exited with {self.process.returncode}: {self.log.read()}")
            try:
                self.raw["Devices"]["ListDevices"](_proto.message("ListDevicesRequest")(), timeout=1)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise RuntimeError("vmmd did not serve within 20 s")
                time.sleep(0.05)

    def stats(self) -> Any:
        return self.raw["Admin"]["GetStats"](_proto.message("GetStatsRequest")(), timeout=10)

    def connect_admin(self) -> Any:
        """The Admin service, sessionless (as vmmctl)."""
        from vmmd.client import AdminApi, _Service

        return AdminApi(_Service(self.channel, "Admin", lambda: [], 10.0))

    def connect(self, **options: Any) -> vmmd.VmmdClient:
        return vmmd.connect(self.dir, **options)

    def env(self) -> Dict[str, str]:
        return {**os.environ, "VMMD_SOCKET_DIR": self.dir}

    def stop(self) -> None:
        self.channel.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def eventually(check: Any, timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = Daemon()
    yield d
    d.stop()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[vmmd.VmmdClient]:
    c = daemon.connect()
    yield c
    c.close()


class PythonPeer:
    """A Python client process driven by code sent on stdin (one line of JSON
    {"code": ...} each, run with `client` bound); answers one JSON line."""

    SCRIPT = r'''
import json, sys, vmmd
client = vmmd.connect()
memories = {}
print(json.dumps({"ok": True, "result": {"session": client.session.id}}), flush=True)
for line in sys.stdin:
    scope = {"client": client, "memories": memories, "vmmd": vmmd}
    try:
        exec(json.loads(line)["code"], scope)
        print(json.dumps({"ok": True, "result": scope.get("result")}), flush=True)
    except vmmd.VmmdError as error:
        print(json.dumps({"ok": False, "code": error.code, "status": error.status, "message": error.message}), flush=True)
'''

    def __init__(self, daemon: Daemon) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", self.SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=daemon.env(), text=True)
        self.hello = self._answer()["result"]

    def _answer(self) -> Any:
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"python peer exited with {self.process.wait()}")
        return json.loads(line)

    def run(self, code: str) -> Any:
        self.process.stdin.write(json.dumps({"code": code}) + "\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]
        answer = self._answer()
        if not answer["ok"]:
            raise vmmd.VmmdError(answer["code"], answer["status"], answer["message"])
        return answer["result"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # type: ignore[union-attr]
            self.process.wait(10)


class NodePeer:
    """The TypeScript test peer (test/e2e/fixtures/peer.ts): the TypeScript client in another process."""

    def __init__(self, daemon: Daemon) -> None:
        if not os.path.exists(PEER):
            pytest.fail(f"{PEER} is missing: run `npm run build` first (npm test does)")
        node = os.environ.get("VMMD_NODE", "node")
        self.process = subprocess.Popen([node, PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=daemon.env(), text=True, cwd=ROOT)

    def send(self, **command: Any) -> Any:
        self.process.stdin.write(json.dumps(command) + "\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]
        answer = json.loads(self.process.stdout.readline())  # type: ignore[union-attr]
        if not answer["ok"]:
            raise AssertionError(f"peer {command['op']} failed: {answer['error']}")
        return answer["result"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # type: ignore[union-attr]
            self.process.wait(10)
