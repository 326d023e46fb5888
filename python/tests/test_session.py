"""Sessions and the descriptor inbox (docs/PROTOCOL.md), from Python."""
from __future__ import annotations

import os
import re
import socket
import threading
from typing import Any

import grpc
import pytest

import vmmd
from vmmd import _frames, _proto
from vmmd._greeting import greet
from vmmd.session import ClientSession

from conftest import MiB, Daemon, eventually


def test_hello_gives_a_session_with_a_token_and_this_process_credentials(daemon: Daemon) -> None:
    with daemon.connect() as client:
        assert re.fullmatch(r"[0-9a-f]{64}", client.session.token)
        assert client.session.pid == os.getpid()
        sessions = {s.id: s for s in client.admin.list_sessions().sessions}
        assert sessions[int(client.session.id)].pid == os.getpid()
        assert client.backend == "host"
        # From the capabilities in the daemon's hello: connect() asked no RPC for it.
        assert client.session.capabilities == {"CAPABILITY_MEMFD_DESCRIPTORS", "CAPABILITY_READ_ONLY_DESCRIPTORS"}


def test_ping_round_trips_on_the_session_socket(client: vmmd.VmmdClient) -> None:
    assert 0 < client.session.ping() < 5


def test_objects_belong_to_the_session_and_go_with_it(daemon: Daemon) -> None:
    before = daemon.stats()
    client = daemon.connect()
    allocation = client.vmm.create(size=2 * MiB)
    assert allocation.owner_session == int(client.session.id)
    client.vmm.reserve(size=4 * MiB)
    assert daemon.stats().allocations == before.allocations + 1
    token = client.session.token
    client.close()
    eventually(lambda: daemon.stats().allocations == before.allocations and daemon.stats().reservations == before.reservations, what="reclaim")
    # The token of a closed session names no session any more.
    with pytest.raises(grpc.RpcError) as raised:
        daemon.raw["Devices"]["ListDevices"](_proto.message("ListDevicesRequest")(), metadata=[("vmmd-session-token", token)], timeout=5)
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_call_without_a_session_cannot_receive_descriptors(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    allocation = client.vmm.create(size=2 * MiB)
    key = client.vmm.share(allocation_id=allocation.id).share_key
    with pytest.raises(grpc.RpcError) as raised:
        daemon.raw["VirtualMemory"]["Export"](_proto.message("ExportRequest")(allocation_id=allocation.id, share_key=key), timeout=5)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert ("vmmd-error-code", "NO_SESSION") in raised.value.trailing_metadata()


def test_exported_descriptors_wait_in_the_inbox_until_claimed(client: vmmd.VmmdClient) -> None:
    allocation = client.vmm.create(size=2 * MiB)
    exported = client.vmm.export(allocation_id=allocation.id)
    eventually(lambda: str(exported.transfer_id) in client.session.pending_transfers(), what="the descriptor")
    fd = client.session.take_transfer(exported.transfer_id)
    try:
        assert os.fstat(fd).st_size == 2 * MiB
    finally:
        os.close(fd)
    assert str(exported.transfer_id) not in client.session.pending_transfers()
    # Claimed once: a second claim waits for a descriptor that never comes.
    with pytest.raises(vmmd.VmmdError) as raised:
        client.session.take_transfer(exported.transfer_id, timeout=0.2)
    assert (raised.value.code, raised.value.status_name) == ("TRANSFER_NOT_RECEIVED", "DEADLINE_EXCEEDED")


def test_a_descriptor_sent_by_the_client_becomes_an_allocation(client: vmmd.VmmdClient) -> None:
    fd = vmmd.sealed_memfd("test", 2 * MiB)
    try:
        os.pwrite(fd, b"from python", 0)
        allocation = client.vmm.import_descriptor(fd, size=2 * MiB)
    finally:
        os.close(fd)
    assert allocation.imported and allocation.owner_session == int(client.session.id)
    with client.vmm.import_(allocation.id) as memory:
        assert memory.read(0, 11) == b"from python"


def test_transfer_ids_rise_and_a_replayed_id_is_refused(daemon: Daemon) -> None:
    """A raw session: the daemon refuses a transfer id that is not above every id sent before."""
    with daemon.connect() as client:
        errors: list = []
        client.session.on_daemon_error.append(errors.append)
        first = client.session.send_descriptor(vmmd.sealed_memfd("a", 2 * MiB))
        assert first == "1" and client.session.send_descriptor(vmmd.sealed_memfd("b", 2 * MiB)) == "2"
        fd = vmmd.sealed_memfd("replay", 2 * MiB)
        socket.send_fds(client.session._sock, [_frames.encode(transfer={"id": 1})], [fd])
        os.close(fd)
        eventually(lambda: errors, what="the daemon's error message")
        assert errors[0].code == "TRANSFER_USED"
        # The session stays open.
        assert client.session.ping() > 0


def test_bad_messages_are_answered_and_change_nothing(daemon: Daemon) -> None:
    with daemon.connect() as client:
        errors: list = []
        client.session.on_daemon_error.append(errors.append)
        before = daemon.stats()
        # Not protobuf (a length past the frame), and an allocate without a request id.
        client.session._sock.send(bytes([0x12, 0x05, 0x01]))
        client.session._sock.send(_frames.encode(allocate={"size": 2 * MiB}))
        eventually(lambda: len(errors) == 2, what="two error messages")
        assert [e.code for e in errors] == ["BAD_MESSAGE", "BAD_MESSAGE"]
        assert daemon.stats().allocations == before.allocations
        assert client.session.ping() > 0


def test_allocate_on_the_session_socket_maps_memory_here(client: vmmd.VmmdClient) -> None:
    memory = client.vmm.allocate(4 * MiB)
    assert memory.size == 4 * MiB
    memory.write(4 * MiB - 3, b"end")
    properties = client.vmm.get_properties(allocation_id=memory.allocation_id)
    assert properties.owner_session == int(client.session.id) and properties.size == 4 * MiB
    # The daemon sees the same pages (its Read of a mapping of the allocation).
    reservation = client.vmm.reserve(size=4 * MiB)
    client.vmm.map(address=reservation.address, size=4 * MiB, allocation_id=memory.allocation_id)
    client.vmm.set_access(address=reservation.address, size=4 * MiB, descriptors=[{"location": {"type": "LOCATION_TYPE_DEVICE"}, "flags": "ACCESS_FLAGS_READWRITE"}])
    assert client.vmm.read(reservation.address + 4 * MiB - 3, 3) == b"end"
    memory.close()


def test_release_share_export_and_open_take_the_session_socket_with_the_rules_of_their_rpcs(daemon: Daemon) -> None:
    with daemon.connect() as owner, daemon.connect() as other:
        before = daemon.stats()
        memory = owner.vmm.allocate(2 * MiB)
        memory.write(100, b"shared")
        # Export and share on the socket: another session needs the key.
        with pytest.raises(vmmd.VmmdError) as refused:
            other.session.export(memory.allocation_id)
        assert refused.value.code == "NOT_OWNER" and refused.value.status == grpc.StatusCode.PERMISSION_DENIED.value[0]
        key = owner.vmm.share(allocation_id=memory.allocation_id).share_key
        assert key == owner.session.share(memory.allocation_id)
        seen = other.vmm.import_(memory.allocation_id, share_key=key)
        assert seen.read(100, 6) == b"shared"
        seen.close()
        # Open a store on the socket: the Store message as the RPC gives it (of memory never shared by key).
        unshared = owner.vmm.allocate(2 * MiB)
        unshared.write(100, b"shared")
        store = owner.stores.create_store(allocation_id=unshared.allocation_id, name="py-socket-open", read_only=True)
        with pytest.raises(vmmd.VmmdError) as refused:
            other.stores.open("py-socket-open", writable=True)
        assert refused.value.code == "STORE_READ_ONLY"
        with pytest.raises(vmmd.VmmdError) as refused:
            other.stores.open("no-such-store")
        assert refused.value.code == "UNKNOWN_STORE"
        opened = other.stores.open("py-socket-open")
        assert opened.store.id == store.id and opened.store.read_only and opened.store.opens == 1
        assert opened.memory.read(100, 6) == b"shared"
        opened.close()
        # Release on the socket: a ReleaseResponse, and the RPC's refusals.
        with pytest.raises(vmmd.VmmdError) as refused:
            other.vmm.release(allocation_id=memory.allocation_id)
        assert refused.value.code == "NOT_OWNER"
        memory.close()
        owner.stores.detach("py-socket-open")
        unshared.close()
        owner.vmm.release(allocation_id=unshared.allocation_id)
        answer = owner.vmm.release(allocation_id=memory.allocation_id)
        assert answer.handle_references == 0
        with pytest.raises(vmmd.VmmdError) as refused:
            owner.vmm.release(allocation_id=424242)
        assert refused.value.code == "UNKNOWN_ALLOCATION" and refused.value.status == grpc.StatusCode.NOT_FOUND.value[0]
        eventually(lambda: daemon.stats().allocations == before.allocations, what="the allocation to be freed")


def test_the_daemon_going_away_ends_the_session(tmp_path: object) -> None:
    daemon = Daemon()
    try:
        client = daemon.connect()
        lost: list = []
        client.on_session_lost.append(lost.append)
        memory = client.vmm.allocate(2 * MiB)
        memory.write(0, b"kept")
        daemon.process.kill()
        daemon.process.wait()
        eventually(lambda: lost, what="session-lost")
        assert lost[0].code == "SESSION_LOST" and client.lost
        with pytest.raises(vmmd.VmmdError) as raised:
            client.session.ping()
        assert raised.value.code == "SESSION_LOST"
        # Memory mapped here stays valid.
        assert memory.read(0, 4) == b"kept"
        memory.close()
        client.close()
    finally:
        daemon.stop()


def test_connect_to_no_daemon_is_unavailable(tmp_path: object) -> None:
    with pytest.raises(vmmd.VmmdError) as raised:
        vmmd.connect(str(tmp_path))
    assert (raised.value.code, raised.value.status, raised.value.status_name) == ("DAEMON_UNREACHABLE", 14, "UNAVAILABLE")
    assert str(tmp_path) in raised.value.message


def test_socket_dir_comes_from_the_environment(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMMD_SOCKET_DIR", daemon.dir)
    assert vmmd.default_socket_dir() == daemon.dir
    with vmmd.connect() as client:
        assert client.socket_dir == daemon.dir
    monkeypatch.delenv("VMMD_SOCKET_DIR")
    assert vmmd.default_socket_dir({"XDG_RUNTIME_DIR": "/nonexistent"}) in ("/run/vmmd", f"/tmp/vmmd-{os.getuid()}", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"vmmd-{os.getuid()}"))


def test_a_hello_come_late_taken_for_protocol_1_connects_again(tmp_path: Any) -> None:
    """A daemon that took this client's late hello for the silence of a client of protocol 1 refuses it in JSON,
    naming its own protocol: the client connects again and gets its session; when every try comes late it fails
    HELLO_LATE with the daemon's words, not "upgrade the daemon"."""
    path = str(tmp_path / "vmmd.session.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(8)
    refusal = b'{"type":"error","code":"PROTOCOL_VERSION","status":9,"protocol":2,"message":"vmmd speaks session protocol 2 and this client sent no hello within 1000 ms"}'
    hello = _frames.DaemonFrame(hello={"protocol": 2, "session": 1, "token": "f" * 64, "pid": 1, "uid": 0, "gid": 0, "capabilities": ["CAPABILITY_MEMFD_DESCRIPTORS"]}).SerializeToString()

    def daemon(late: int, answered: int) -> None:
        for attempt in range(late + answered):
            peer, _ = listener.accept()
            if attempt < late:
                peer.send(refusal)
            else:
                peer.recv(4096)
                peer.send(hello)
            peer.close()

    side = threading.Thread(target=daemon, args=(2, 1), daemon=True)
    side.start()
    try:
        sock, greeted = greet(path, 5)
        sock.close()
        assert greeted.session == 1
    finally:
        side.join(5)
    side = threading.Thread(target=daemon, args=(3, 0), daemon=True)
    side.start()
    try:
        with pytest.raises(vmmd.VmmdError) as raised:
            greet(path, 5)
        assert (raised.value.code, raised.value.status) == ("HELLO_LATE", 14)
        assert "no hello within 1000 ms" in raised.value.message and "3 tries" in raised.value.message
    finally:
        side.join(5)
        listener.close()


def test_a_daemon_of_protocol_1_is_refused_naming_both_protocols(tmp_path: Any) -> None:
    """A daemon of protocol 1 speaks first, in JSON: the client fails PROTOCOL_VERSION, not a vague greeting error."""
    path = str(tmp_path / "vmmd.session.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)

    def old_daemon() -> None:
        peer, _ = listener.accept()
        peer.send(b'{"type":"hello","protocol":1,"session":"1","token":"ff","pid":1,"uid":0,"gid":0,"backend":"host"}')
        peer.recv(4096)
        peer.close()

    side = threading.Thread(target=old_daemon, daemon=True)
    side.start()
    try:
        with pytest.raises(vmmd.VmmdError) as raised:
            ClientSession.open(path, timeout=5)
        assert raised.value.code == "PROTOCOL_VERSION"
        assert "speaks session protocol 1; this client speaks 2" in raised.value.message
    finally:
        side.join(5)
        listener.close()
