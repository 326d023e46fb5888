"""Every public call of the client takes `timeout=`; a daemon that stopped
(SIGSTOP) makes calls fail by their timeout with a TimeoutError that is a
VmmdError, and once it runs again nothing is owned by nobody: the answers
that came too late are released."""
from __future__ import annotations

import inspect
import os
import signal
import time
import types
from typing import Any, Callable, Iterator

import grpc
import pytest

import vmmd
from vmmd.client import AdminApi, DevicesApi, StoresApi, VirtualMemoryApi

from conftest import MiB, Daemon, eventually

# Calls that never reach the daemon.
LOCAL = {"close_staging"}


@pytest.mark.parametrize("api", [DevicesApi, AdminApi, VirtualMemoryApi, StoresApi, vmmd.ClientSession, "vmmd.weights"])
def test_every_public_call_takes_a_timeout(api: Any) -> None:
    if isinstance(api, str):
        import vmmd.weights

        # The calls of vmmd.weights that reach the daemon (the as_* views are local).
        api = types.SimpleNamespace(__name__="vmmd.weights", load_file=vmmd.weights.load_file, open_store=vmmd.weights.open_store)
    missing = []
    for name, member in inspect.getmembers(api, inspect.isfunction):
        if name.startswith("_") or name in LOCAL or name in ("close", "fileno", "pending_transfers", "orphans", "disown", "forget_after_fork"):
            continue
        if "timeout" not in inspect.signature(member).parameters:
            missing.append(name)
    assert not missing, f"{api.__name__}: no timeout= on {missing}"


@pytest.fixture
def stoppable() -> Iterator[Daemon]:
    d = Daemon()
    yield d
    os.kill(d.process.pid, signal.SIGCONT)
    d.stop()


def fails_by_its_timeout(call: Callable[[], Any], timeout: float) -> vmmd.VmmdError:
    started = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        call()
    took = time.monotonic() - started
    assert took < timeout + 1.5, f"took {took:.2f} s for a {timeout} s timeout"
    error = raised.value
    assert isinstance(error, vmmd.VmmdError) and isinstance(error, vmmd.VmmdTimeoutError)
    assert error.status_name == "DEADLINE_EXCEEDED" and error.code, error
    return error


def test_a_stopped_daemon_fails_calls_by_their_timeout_and_leaves_nothing_owned_by_nobody(stoppable: Daemon) -> None:
    client = stoppable.connect()
    try:
        client.admin.get_stats()  # the channel connected before the daemon stops
        store = client.stores.attach_bytes(b"x" * 4096, name="opened-late")
        assert stoppable.stats().allocations == 0
        os.kill(stoppable.process.pid, signal.SIGSTOP)
        try:
            assert fails_by_its_timeout(lambda: client.vmm.allocate(2 * MiB, timeout=0.5), 0.5).code == "NO_ANSWER"
            fails_by_its_timeout(lambda: client.session.allocate(2 * MiB, timeout=0.3), 0.3)
            fails_by_its_timeout(lambda: client.devices.list_devices(timeout=0.5), 0.5)
            fails_by_its_timeout(lambda: client.stores.open("opened-late", timeout=0.5), 0.5)
            fails_by_its_timeout(lambda: client.session.ping(timeout=0.3), 0.3)
        finally:
            os.kill(stoppable.process.pid, signal.SIGCONT)
        # What the answers that came too late made is undone by the session: nothing is left to nobody.
        def settled() -> bool:
            client.session.ping(timeout=5)
            opens = [s.opens for s in client.stores.list(timeout=5) if s.id == store.id]
            return stoppable.stats().allocations == 0 and opens == [0] and not client.session.orphans()
        eventually(settled, what="what the late answers made to be undone")
        memory = client.vmm.allocate(2 * MiB, timeout=5)
        assert stoppable.stats().allocations == 1
        client.vmm.release(allocation_id=memory.allocation_id, timeout=5)
    finally:
        client.close()


def test_a_timeout_must_be_seconds_above_zero(client: vmmd.VmmdClient) -> None:
    for bad in (0, -1, "1", True):
        with pytest.raises(vmmd.VmmdError) as raised:
            client.devices.list_devices(timeout=bad)
        assert (raised.value.code, raised.value.status_name) == ("BAD_TIMEOUT", "INVALID_ARGUMENT")


class _RefusedFuture(grpc.RpcError, grpc.Future):  # type: ignore[misc]
    """A Close the channel could not take (it was reconnecting after the daemon stalled)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the channel is reconnecting"

    def result(self, timeout: Any = None) -> Any:
        raise self

    def exception(self, timeout: Any = None) -> Any:
        return self

    def add_done_callback(self, fn: Any) -> None:
        fn(self)

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def traceback(self, timeout: Any = None) -> Any:
        return None


def test_an_open_nobody_took_is_closed_even_when_the_first_close_is_refused(client: vmmd.VmmdClient) -> None:
    store = client.stores.attach_bytes(b"x" * 4096, name="closed-again")
    _, fd = client.session.open_store({"id": int(store.id)}, timeout=5)
    os.close(fd)
    calls = client.stores._service._calls
    real = calls["Close"]
    refused = []

    class CloseRefusedOnce:
        def future(self, *args: Any, **kwargs: Any) -> Any:
            if not refused:
                refused.append(True)
                return _RefusedFuture()
            return real.future(*args, **kwargs)

    calls["Close"] = CloseRefusedOnce()
    try:
        # As an answer that came after its caller gave up leaves it: the open is the session's to close.
        client.session._orphans.append(("close", str(store.id)))

        def closed() -> bool:
            client.session.ping(timeout=5)
            return [s.opens for s in client.stores.list(timeout=5) if s.id == store.id] == [0] and not client.session.orphans()

        eventually(closed, what="the refused close to be sent again")
        assert refused == [True]
    finally:
        calls["Close"] = real
