"""The Python client across a restart of the daemon, under vmmd's keeper: it
resumes its session by itself (same session, same objects, memory mapped
throughout), calls made meanwhile wait, and a session reclaimed past the
grace ends with a clear SESSION_LOST, not a hang."""
from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from typing import Any, List, cast

import pytest

import vmmd
from conftest import MiB, Daemon, eventually


def _serving_pid(keeper: int) -> Any:
    children = open(f"/proc/{keeper}/task/{keeper}/children").read().split()
    return int(children[0]) if children else None


def _kill_serving(daemon: Daemon) -> None:
    before = _serving_pid(daemon.process.pid)
    os.kill(before, signal.SIGKILL)
    eventually(lambda: (lambda pid: pid if pid is not None and pid != before else None)(_serving_pid(daemon.process.pid)), 30, "the keeper to start the daemon again")


def _allocations(client: vmmd.VmmdClient) -> List[Any]:
    return sorted((o.id, o.owner_session, o.size) for o in client.admin.list_objects().objects if o.kind == "allocation")


@pytest.fixture
def keeper(request: Any) -> Any:
    daemon = Daemon(["--keeper", "on", "--quota-per-uid", "64MiB", "--parked-grace-ms", str(getattr(request, "param", 60000))])
    yield daemon
    daemon.stop()


def test_a_sigkilled_daemon_the_client_resumes_owning_what_it_owned(keeper: Daemon) -> None:
    client = keeper.connect()
    try:
        assert client.session.resume_token is not None and len(client.session.resume_token) == 64
        memory = client.vmm.allocate(4 * MiB)
        memory.write(0, bytes(range(256)) * (4 * MiB // 256))
        digest = hashlib.sha256(memory.read()).hexdigest()
        key = client.vmm.share(allocation_id=memory.allocation_id).share_key
        before = _allocations(client)
        quotas = client.admin.get_report()["quotas"]
        _kill_serving(keeper)
        # Calls made while the daemon is away wait for the session, then go.
        results: List[Any] = []
        calls = [
            threading.Thread(target=lambda: results.append(client.vmm.allocate(2 * MiB))),
            threading.Thread(target=lambda: results.append(client.devices.get_granularity())),
            threading.Thread(target=lambda: results.append(client.vmm.share(allocation_id=memory.allocation_id).share_key)),
        ]
        for call in calls:
            call.start()
        # The memory mapped here stays valid meanwhile.
        assert hashlib.sha256(memory.read()).hexdigest() == digest
        for call in calls:
            call.join(60)
        assert len(results) == 3 and key in results
        assert not client.lost
        second = next(r for r in results if isinstance(r, vmmd.ImportedMemory))
        after = _allocations(client)
        assert [a for a in after if a[0] != second.allocation_id] == before
        assert next(a for a in after if a[0] == second.allocation_id)[1] == int(client.session.id)
        second.close()
        client.vmm.release(allocation_id=second.allocation_id)
        assert client.admin.get_report()["quotas"] == quotas
        assert hashlib.sha256(memory.read()).hexdigest() == digest
        memory.close()
        client.vmm.release(allocation_id=memory.allocation_id)
        assert _allocations(client) == []
    finally:
        client.close()


@pytest.mark.parametrize("keeper", [0], indirect=True)
def test_a_session_reclaimed_past_the_grace_ends_with_session_lost(keeper: Daemon) -> None:
    client = keeper.connect()
    lost: List[vmmd.VmmdError] = []
    client.on_session_lost.append(lost.append)
    try:
        memory = client.vmm.allocate(2 * MiB)
        _kill_serving(keeper)
        eventually(lambda: lost or None, 30, "the client to hear")
        assert lost[0].code == "SESSION_LOST"
        assert "SESSION_RECLAIMED" in str(lost[0]) and "memory mapped in this process stays valid" in str(lost[0])
        with pytest.raises(vmmd.VmmdError) as raised:
            client.vmm.allocate(2 * MiB)
        assert raised.value.code == "SESSION_LOST"
        memory.write(0, b"still mapped")
        assert memory.read(0, 12) == b"still mapped"
        memory.close()
    finally:
        client.close()


def test_no_resume_where_the_daemon_parks_nothing(daemon: Daemon) -> None:
    client = daemon.connect()
    try:
        assert client.session.resume_token is None
    finally:
        client.close()


def test_resume_wait_is_checked() -> None:
    with pytest.raises(vmmd.VmmdError) as raised:
        vmmd.connect("/nonexistent", resume_wait_s=-1)
    assert raised.value.code == "BAD_OPTION"
    started = time.monotonic()
    assert time.monotonic() - started < 1


def test_a_release_sent_again_of_an_allocation_gone_answers_a_release_response_freed() -> None:
    """The answer a resent release gets when the daemon freed the allocation before it went: the Release RPC's
    own ReleaseResponse (a field it does not have made the resent release fail in the client)."""
    from vmmd._resuming import Resumable

    response, fd = cast(Any, Resumable._released_before("UNKNOWN_ALLOCATION")).take()
    assert (response.freed, response.handle_references, response.mapping_count, fd) == (True, 0, 0, -1)


def test_a_release_sent_again_finding_the_sessions_reference_gone_answers_not_freed() -> None:
    """The answer where the first release gave back the session's reference before the daemon went and a store or
    another session holds the allocation still: not freed; any other refusal goes to the caller."""
    from vmmd._resuming import Resumable

    response, fd = cast(Any, Resumable._released_before("NO_REFERENCE")).take()
    assert (response.freed, response.handle_references, response.mapping_count, fd) == (False, 0, 0, -1)
    for code in ("NOT_OWNER", "ALREADY_RELEASED", "SESSION_LOST"):
        assert Resumable._released_before(code) is None
