"""The session's sending (vmmd/session.py): a daemon that stops reading
fills the socket, and a call then fails within its own timeout with
SESSION_SOCKET_FULL (as the TypeScript client's), where its send used to
block for as long as the daemon did not read."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Any, Callable, Dict, List

import pytest

import vmmd
from vmmd import _frames

from test_session_reading import FakeDaemon, fake  # noqa: F401 - the fixture


def fill(sock: socket.socket) -> int:
    """Sends until the socket takes no more (the peer reads nothing); returns how many went."""
    sent = 0
    while True:
        try:
            sock.send(_frames.encode(request=1, ping={"nonce": "x"}), socket.MSG_DONTWAIT)
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
    assert fake.session.release(5, timeout=5).freed
    side.join(5)


def test_a_ping_to_a_daemon_that_stopped_reading_fails_within_its_timeout(fake: FakeDaemon) -> None:
    fill(fake.session._sock)
    started = time.monotonic()
    outcome = outcome_within(5, lambda: fake.session.ping(timeout=0.3))
    assert "error" in outcome, outcome
    assert getattr(outcome["error"], "code", None) == "SESSION_SOCKET_FULL"
    assert time.monotonic() - started < 2.0


def test_a_call_behind_a_waiting_sender_still_fails_within_its_own_timeout(fake: FakeDaemon) -> None:
    """A sender waiting for room holds _send_lock; a second call's timeout must still hold."""
    fill(fake.session._sock)
    r, w = os.pipe()
    try:
        # send_descriptor waits up to SEND_WAIT_S (30 s) for room, holding the send lock.
        first = threading.Thread(target=lambda: outcome_within(40, lambda: fake.session.send_descriptor(r)), daemon=True)
        first.start()
        time.sleep(0.2)
        started = time.monotonic()
        outcome = outcome_within(3, lambda: fake.session.ping(timeout=0.3))
        took = time.monotonic() - started
        assert "stuck" not in outcome, f"ping(timeout=0.3) still waiting after {took:.1f} s: blocked on _send_lock behind send_descriptor"
        assert getattr(outcome.get("error"), "code", None) == "SESSION_SOCKET_FULL"
    finally:
        fake.session.close()  # ends the first sender (SESSION_LOST)
        os.close(r)
        os.close(w)


def test_a_call_behind_a_sender_with_no_limit_is_not_held_forever(fake: FakeDaemon) -> None:
    fill(fake.session._sock)
    waiting = threading.Thread(target=lambda: outcome_within(60, lambda: fake.session.release(5, timeout=None)), daemon=True)
    waiting.start()
    time.sleep(0.2)
    outcome = outcome_within(3, lambda: fake.session.release(6, timeout=0.3))
    fake.session.close()
    assert "stuck" not in outcome, "release(timeout=0.3) blocked behind release(timeout=None) for as long as the daemon does not read"


def test_close_while_a_sender_waits_fails_it_promptly(fake: FakeDaemon) -> None:
    fill(fake.session._sock)
    result: dict = {}
    side = threading.Thread(target=lambda: result.update(outcome_within(10, lambda: fake.session.ping(timeout=None))), daemon=True)
    side.start()
    time.sleep(0.2)
    started = time.monotonic()
    fake.session.close()
    side.join(5)
    assert getattr(result.get("error"), "code", None) == "SESSION_LOST", result
    assert time.monotonic() - started < 2.0


def lock_is_free(lock: Any) -> bool:
    """Whether another thread could take `lock` now."""
    got: List[bool] = []

    def attempt() -> None:
        if lock.acquire(False):
            lock.release()
            got.append(True)

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join(5)
    return got == [True]


def test_an_interrupt_while_waiting_for_room_sends_nothing_and_forgets_the_request(fake: FakeDaemon) -> None:
    fill(fake.session._sock)
    main = threading.get_ident()
    timer = threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        fake.session.ping(timeout=5)
    assert fake.session._requests == {}
    assert not fake.session._reading.holds()
    assert lock_is_free(fake.session._send_lock)
