"""Several client processes: reclaim when a Python client is SIGKILLed,
stores shared between two Python processes, and TypeScript and Python
clients sharing one allocation."""
from __future__ import annotations

import hashlib
import os
import signal

import pytest

import vmmd

from conftest import MiB, Daemon, NodePeer, PythonPeer, eventually


def test_a_sigkilled_python_client_loses_its_lease(daemon: Daemon) -> None:
    before = daemon.stats()
    peer = PythonPeer(daemon)
    session = int(peer.hello["session"])
    peer.run("memories['a'] = client.vmm.allocate(4 << 20); client.vmm.reserve(size=2 << 20); client.stores.attach_bytes(b'x' * 4096, name='killed-store'); result = 1")
    during = daemon.stats()
    assert during.allocations >= before.allocations + 1 and during.reservations == before.reservations + 1
    os.kill(peer.process.pid, signal.SIGKILL)
    peer.process.wait()
    def reclaimed() -> bool:
        stats = daemon.stats()
        return stats.allocations == before.allocations and stats.reservations == before.reservations and stats.sessions == before.sessions
    eventually(reclaimed, what="the daemon to reclaim the killed client's objects")
    with daemon.connect() as client:
        assert all(s.id != session for s in client.admin.list_sessions().sessions)
        assert all(s.name != "killed-store" for s in client.stores.list())


def test_a_store_is_shared_between_two_python_processes(daemon: Daemon) -> None:
    data = os.urandom(3 * MiB)
    writer = PythonPeer(daemon)
    reader = PythonPeer(daemon)
    try:
        writer.run(
            "import os\n"
            "m = client.vmm.allocate(4 << 20)\n"
            f"m.write(0, bytes.fromhex('{data[:64].hex()}') * ({len(data)} // 64))\n"
            f"s = client.stores.create_store(allocation_id=m.allocation_id, name='two-processes', size={len(data)})\n"
            "memories['m'] = m\n"
            "result = int(s.id)"
        )
        expected = hashlib.sha256(data[:64] * (len(data) // 64)).hexdigest()
        digest = reader.run(
            "import hashlib\n"
            "o = client.stores.open('two-processes')\n"
            "memories['o'] = o\n"
            "result = [hashlib.sha256(o.memory.buffer[:o.size]).hexdigest(), o.memory.read_only]"
        )
        assert digest == [expected, True]
        # A write in one process is seen by the other (the same pages).
        writer.run("memories['m'].write(0, b'changed')")
        assert reader.run("result = memories['o'].memory.read(0, 7).decode()") == "changed"
        # The reader cannot write through its read-only open.
        with pytest.raises(vmmd.VmmdError) as raised:
            reader.run("memories['o'].memory.write(0, b'x')")
        assert raised.value.code == "READ_ONLY"
    finally:
        writer.close()
        reader.close()


def test_typescript_and_python_clients_share_one_allocation(daemon: Daemon) -> None:
    node = NodePeer(daemon)
    try:
        node.send(op="connect")
        # Python allocates and shares; TypeScript imports, writes; Python reads.
        with daemon.connect() as client:
            memory = client.vmm.allocate(2 * MiB)
            memory.write(0, b"from python")
            key = client.vmm.share(allocation_id=memory.allocation_id).share_key
            handle = node.send(op="import", allocationId=str(memory.allocation_id), shareKey=key)["handle"]
            assert node.send(op="peek", handle=handle, offset=0, length=11)["text"] == "from python"
            node.send(op="fill", handle=handle, offset=100, text="from typescript")
            assert memory.read(100, 15) == b"from typescript"
            # TypeScript creates and shares; Python imports it.
            created = node.send(op="call", api="vmm", method="create", args={"size": str(2 * MiB)})
            theirs = node.send(op="call", api="vmm", method="share", args={"allocationId": created["id"]})
            other = node.send(op="import", allocationId=created["id"])["handle"]
            node.send(op="fill", handle=other, offset=0, text="typescript-made")
            with client.vmm.import_(int(created["id"]), share_key=theirs["shareKey"]) as mapped:
                assert mapped.read(0, 15) == b"typescript-made"
                mapped.write(0, b"TYPESCRIPT")
            assert node.send(op="peek", handle=other, offset=0, length=15)["text"] == "TYPESCRIPT-made"
            # A store made in Python, opened in TypeScript, checksummed there (of memory never shared by key:
            # a share key's holder gets a writable descriptor, so shared memory cannot be sealed read-only).
            weights = client.vmm.allocate(2 * MiB)
            weights.write(0, b"store from python")
            store = client.stores.create_store(allocation_id=weights.allocation_id, name="mixed", read_only=True)
            opened = node.send(op="storeOpen", name="mixed")
            assert opened["id"] == str(store.id)
            assert node.send(op="storeChecksum", handle=opened["handle"])["sha256"] == hashlib.sha256(weights.read(0, weights.size)).hexdigest()
            node.send(op="storeClose", handle=opened["handle"])
            memory.close()
    finally:
        node.close()
