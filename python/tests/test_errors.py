"""Errors carry the daemon's code and the gRPC status; bad input changes nothing."""
from __future__ import annotations

import os
import pickle
import sys
import types
from typing import Any

import pytest

import vmmd

from conftest import MiB, Daemon


def refused(call, code: str, status: str):  # type: ignore[no-untyped-def]
    with pytest.raises(vmmd.VmmdError) as raised:
        call()
    error = raised.value
    assert (error.code, error.status_name) == (code, status), error
    assert error.message and code in str(error)
    return error


def test_rpc_refusals_carry_code_and_status_and_change_nothing(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    before = daemon.stats()
    error = refused(lambda: client.vmm.create(size=3 * MiB), "NOT_ALIGNED", "INVALID_ARGUMENT")
    assert error.status == 3 and "0x300000" in error.message
    refused(lambda: client.vmm.create(size=0), "ZERO_SIZE", "INVALID_ARGUMENT")
    oom = refused(lambda: client.vmm.create(size=512 * MiB), "OUT_OF_MEMORY", "RESOURCE_EXHAUSTED")
    assert oom.out_of_memory and oom.error_code == 3 and error.error_code == 2
    refused(lambda: client.vmm.release(allocation_id=999999), "UNKNOWN_ALLOCATION", "NOT_FOUND")
    refused(lambda: client.devices.get_memory_info(device=7), "UNKNOWN_DEVICE", "OUT_OF_RANGE")
    refused(lambda: client.vmm.unmap(address=1 << 40, size=2 * MiB), "NOT_MAPPED", "NOT_FOUND")
    refused(lambda: client.stores.open("no-such-store"), "UNKNOWN_STORE", "NOT_FOUND")
    after = daemon.stats()
    assert (after.allocations, after.reservations, after.allocated_bytes) == (before.allocations, before.reservations, before.allocated_bytes)


def test_socket_refusals_carry_the_rpc_code_and_status(client: vmmd.VmmdClient) -> None:
    refused(lambda: client.vmm.allocate(MiB), "NOT_ALIGNED", "INVALID_ARGUMENT")
    refused(lambda: client.vmm.allocate(512 * MiB), "OUT_OF_MEMORY", "RESOURCE_EXHAUSTED")
    refused(lambda: client.session.allocate(-1), "BAD_SIZE", "INVALID_ARGUMENT")


def test_another_sessions_allocation_needs_its_share_key(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    allocation = client.vmm.create(size=2 * MiB)
    with daemon.connect() as other:
        refused(lambda: other.vmm.import_(allocation.id), "NOT_OWNER", "PERMISSION_DENIED")
        refused(lambda: other.vmm.import_(allocation.id, share_key="guess"), "BAD_SHARE_KEY", "PERMISSION_DENIED")
        refused(lambda: other.vmm.share(allocation_id=allocation.id), "NOT_OWNER", "PERMISSION_DENIED")


def test_local_memory_rules(client: vmmd.VmmdClient) -> None:
    memory = client.vmm.allocate(2 * MiB)
    refused(lambda: memory.read(2 * MiB - 1, 2), "BEYOND_ALLOCATION", "OUT_OF_RANGE")
    refused(lambda: memory.write(-1, b"x"), "BEYOND_ALLOCATION", "OUT_OF_RANGE")
    refused(lambda: memory.buffer and memory.view("<f8", (1 << 20,)), "BEYOND_ALLOCATION", "OUT_OF_RANGE")
    view = memory.buffer
    refused(memory.close, "VIEWS_ALIVE", "FAILED_PRECONDITION")
    view.release()
    memory.close()
    refused(lambda: memory.read(0, 1), "CLOSED", "FAILED_PRECONDITION")
    refused(lambda: memory.buffer, "CLOSED", "FAILED_PRECONDITION")
    memory.close()  # twice is fine


def test_read_only_memory_refuses_writes_here_and_in_the_daemon(client: vmmd.VmmdClient) -> None:
    store = client.stores.attach_bytes(b"constant", name="ro-errors", read_only=True)
    refused(lambda: client.stores.open("ro-errors", writable=True), "STORE_READ_ONLY", "FAILED_PRECONDITION")
    with client.stores.open(store.id) as opened:
        refused(lambda: opened.memory.write(0, b"x"), "READ_ONLY", "FAILED_PRECONDITION")
        with pytest.raises(TypeError):
            opened.memory.buffer[0] = 1  # a read-only buffer: refused, never a fault
        refused(lambda: client.stores.write({"store_id": store.id}, b"x"), "STORE_READ_ONLY", "FAILED_PRECONDITION")
        assert opened.memory.read(0, 8) == b"constant"


def test_a_name_is_unique(client: vmmd.VmmdClient) -> None:
    client.stores.attach_bytes(b"one", name="unique-name")
    refused(lambda: client.stores.attach_bytes(b"two", name="unique-name"), "NAME_TAKEN", "ALREADY_EXISTS")


def test_bad_client_options_are_refused_before_connecting(daemon: Daemon) -> None:
    error = refused(lambda: daemon.connect(staging_bytes=1000), "BAD_STAGING_SIZE", "INVALID_ARGUMENT")
    assert "1000" in error.message
    refused(lambda: daemon.connect().vmm.create(size="big"), "BAD_REQUEST", "INVALID_ARGUMENT")


def test_errors_pickle_across_processes() -> None:
    error = vmmd.VmmdError("NOT_ALIGNED", 3, "size 5")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.code, copy.status, copy.message) == ("NOT_ALIGNED", 3, "size 5")


def test_out_of_memory_is_a_memory_error_with_its_code(client: vmmd.VmmdClient) -> None:
    for call in (lambda: client.vmm.allocate(512 * MiB), lambda: client.vmm.create(size=512 * MiB)):
        with pytest.raises(MemoryError) as raised:
            call()
        error = raised.value
        assert isinstance(error, vmmd.OutOfMemoryError) and isinstance(error, vmmd.VmmdError)
        assert (error.code, error.status_name) == ("OUT_OF_MEMORY", "RESOURCE_EXHAUSTED") and error.out_of_memory


def test_an_unreachable_daemon_is_a_connection_error(tmp_path: Any) -> None:
    with pytest.raises(ConnectionError) as raised:
        vmmd.connect(str(tmp_path))
    assert isinstance(raised.value, vmmd.VmmdError) and isinstance(raised.value, vmmd.VmmdConnectionError)
    assert (raised.value.code, raised.value.status_name) == ("DAEMON_UNREACHABLE", "UNAVAILABLE")


def test_errors_of_each_kind_pickle_as_their_kind() -> None:
    for code, status, kind in (("OUT_OF_MEMORY", 8, MemoryError), ("NO_ANSWER", 4, TimeoutError), ("SESSION_LOST", 14, ConnectionError), ("NOT_ALIGNED", 3, vmmd.VmmdError)):
        copy = pickle.loads(pickle.dumps(vmmd.VmmdError(code, status, "m")))
        assert isinstance(copy, kind) and isinstance(copy, vmmd.VmmdError), (code, type(copy))
        assert (copy.code, copy.status, copy.message, str(copy)) == (code, status, "m", f"{code}: m")


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Any:
    """cupy.cuda.memory as far as its OutOfMemoryError goes: a MemoryError whose constructor takes sizes."""

    class OutOfMemoryError(MemoryError):
        def __init__(self, size: int, total: int, limit: int = 0) -> None:
            super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes).")

    memory = types.ModuleType("cupy.cuda.memory")
    memory.OutOfMemoryError = OutOfMemoryError  # type: ignore[attr-defined]
    for name, module in (("cupy", types.ModuleType("cupy")), ("cupy.cuda", types.ModuleType("cupy.cuda")), ("cupy.cuda.memory", memory)):
        monkeypatch.setitem(sys.modules, name, module)
    return memory


def test_out_of_memory_is_cupys_out_of_memory_where_cupy_is_loaded(client: vmmd.VmmdClient, fake_cupy: Any) -> None:
    with pytest.raises(fake_cupy.OutOfMemoryError) as raised:
        client.vmm.allocate(512 * MiB)
    error = raised.value
    assert isinstance(error, vmmd.OutOfMemoryError) and isinstance(error, MemoryError)
    assert (error.code, error.status_name) == ("OUT_OF_MEMORY", "RESOURCE_EXHAUSTED")
    assert str(error).startswith("OUT_OF_MEMORY: ")
def test_codes_and_shared_constants_come_from_the_declarations() -> None:
    # python/src/vmmd/_declared.py is generated from common/error-codes.ts and common/client-constants.ts.
    from vmmd import _declared, client, errors, session

    assert errors.CODES["SESSION_LOST"][0] == "UNAVAILABLE"
    assert errors.CODES["NOT_ALIGNED"] == ("INVALID_ARGUMENT", "daemon", errors.CODES["NOT_ALIGNED"][2])
    assert all(status in errors.STATUS for status, _, _ in errors.CODES.values())
    assert errors.ERROR_CODE_KEY == _declared.ERROR_CODE_KEY == "vmmd-error-code"
    assert client.SESSION_METADATA_KEY == _declared.SESSION_METADATA_KEY
    assert (client.STAGED_MIN_BYTES, client.DEFAULT_STAGING_BYTES) == (_declared.STAGED_MIN_BYTES, _declared.DEFAULT_STAGING_BYTES)
    assert session.DEFAULT_BUSY_POLL_US == _declared.DEFAULT_BUSY_POLL_US


def test_every_code_the_python_client_raises_is_declared_with_that_status() -> None:
    import pathlib
    import re

    texts = [path.read_text() for path in pathlib.Path(errors_module_dir()).glob("*.py")]
    raised = {(code, status) for text in texts for code, status in re.findall(r'VmmdError\(\s*"([A-Z_]+)",\s*(?:STATUS\["([A-Z_]+)"\])?', text)}
    assert raised and sorted(code for code, _ in raised if code not in vmmd.errors.CODES) == []
    # LOCAL_MAP_FAILED's status follows the errno of the failed map, in both clients.
    other = sorted(f"{code} {status}" for code, status in raised if status and code != "LOCAL_MAP_FAILED" and vmmd.errors.CODES[code][0] != status)
    assert other == []


def errors_module_dir() -> str:
    import os

    return os.path.dirname(vmmd.errors.__file__)


def test_an_unreachable_daemon_says_where_else_one_may_be_and_how_to_point_there(tmp_path: Any) -> None:
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "vmmd.session.sock").touch()
    closed = tmp_path / "closed"
    closed.mkdir()
    (closed / "vmmd.session.sock").touch()
    closed.chmod(0o700)
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "VMMD_SOCKET_DIR": ""}
    message = vmmd.paths.where_else(str(tmp_path / "nothing"), env, candidates=[str(other), str(closed)])
    assert f"a daemon's sockets are in {other}" in message
    assert message.endswith("set VMMD_SOCKET_DIR (or connect(socket_dir=...)) to the directory of the daemon's sockets")
    with pytest.raises(ConnectionError) as raised:
        vmmd.connect(str(tmp_path / "nothing"))
    assert "set VMMD_SOCKET_DIR" in str(raised.value)


def test_a_directory_this_user_may_not_look_in_is_named_with_its_owner() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to act as another uid")
    import tempfile

    parent = tempfile.mkdtemp(prefix="vmmd-where-")
    try:
        os.chmod(parent, 0o755)
        closed = os.path.join(parent, "closed")
        os.mkdir(closed, 0o700)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                message = vmmd.paths.where_else("/nonexistent", {}, candidates=[closed])
                code = 0 if f"{closed} exists, but uid 65534 may not look in it (owner uid 0, group 0: join that group)" in message else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        import shutil

        shutil.rmtree(parent)
