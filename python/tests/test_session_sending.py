"""The session's sending (vmmd/session.py): a daemon that stops reading
fills the socket, and a call then fails within its own timeout with
SESSION_SOCKET_FULL (as the TypeScript client's), where its send used to
block for as long as the daemon did not read."""
from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable, Dict

import pytest

import vmmd

from test_session_reading import FakeDaemon, fake  # noqa: F401 - the fixture


def fill(sock: socket.socket) -> int:
    """Sends until the socket takes no more (the peer reads nothing); returns how many went."""
    sent = 0
    while True:
        try:
            sock.send(b'{"type":"ping","nonce":"x"}', socket.MSG_DONTWAIT)
        except BlockingIOError:
            return sent
        sent += 1


def outcome_within(seconds: float, call: Callable[[], Any]) -> Dict[str, Any]:
    """Runs `call` on a thread; its outcome, or {"stuck": True} when it has none after `seconds` (the thread is left)."""
    result: Dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as error:  # noqa: BLE001 - the outcome is the test's to judge
            result["error"] = error

    side = threading.Thread(target=run, daemon=True)
    side.start()
    side.join(seconds)
    return result if not side.is_alive() else {"stuck": True}


def test_a_call_to_a_daemon_that_stopped_reading_fails_within_its_timeout(fake: FakeDaemon) -> None:
    fill(fake.session._sock)
    started = time.monotonic()
    outcome = outcome_within(5, lambda: fake.session.release(5, timeout=0.3))
    took = time.monotonic() - started
    assert "error" in outcome, outcome
    error = outcome["error"]
    assert isinstance(error, vmmd.VmmdError)
    assert error.code == "SESSION_SOCKET_FULL"
    assert error.status == vmmd.errors.STATUS["UNAVAILABLE"]
    assert "has not read for" in str(error) and "nothing was sent" in str(error)
    assert took < 2.0, took
    # The session is not lost: once the daemon reads again, calls go through.
    fake.end.setblocking(False)
    while True:
        try:
            fake.end.recv(8192)
        except BlockingIOError:
            break
    fake.end.settimeout(5)
    side = fake.serve(lambda request: fake.send({"type": "released", "request": request["request"], "freed": True, "handleReferences": 0, "mappingCount": 0}))
    assert fake.session.release(5, timeout=5)["type"] == "released"
    side.join(5)


def test_a_ping_to_a_daemon_that_stopped_reading_fails_within_its_timeout(fake: FakeDaemon) -> None:
    fill(fake.session._sock)
    started = time.monotonic()
    outcome = outcome_within(5, lambda: fake.session.ping(timeout=0.3))
    assert "error" in outcome, outcome
    assert getattr(outcome["error"], "code", None) == "SESSION_SOCKET_FULL"
    assert time.monotonic() - started < 2.0
