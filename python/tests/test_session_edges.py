"""The session's reading (vmmd/_reading.py, vmmd/session.py) at its edges:
a request nested in a callback and an interrupt after its leave, an
allocate answered and then interrupted as it leaves the socket, timeouts of
-inf and inf, and the main thread's last look at its deadline. (Each case
failed when written.)"""
from __future__ import annotations

import math
import os
import signal
import threading
import time
from typing import Any, List

import pytest

import vmmd

from test_session_hazards import Interrupted, interrupt  # noqa: F401 - the fixture
from test_session_reading import FakeDaemon, client_request, daemon_frame, fake, in_thread  # noqa: F401 - the fixture


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_an_interrupt_after_a_nested_leave_does_not_release_the_outer_take(fake: FakeDaemon) -> None:
    """The main thread alone reads everything, so an on_daemon_error callback
    runs on it while it holds the socket; a request from the callback takes it
    again (depth 2). A signal handler's exception (SIGALRM's TimeoutError)
    right after the nested leave completed would make a repeated leave leave a
    second time: depth 0, the socket free, while the outer call still reads
    (the callback's error is only a warning). The reader thread may then read
    beside it."""
    if threading.active_count() != 2:
        pytest.skip(f"other Python threads run here ({threading.active_count()})")
    reading = fake.session._reading
    main = threading.main_thread()
    fired: List[bool] = []

    def handler(signum: int, frame: Any) -> None:
        raise TimeoutError("the caller's own alarm")

    real_leave = reading.leave_to

    def leave(depth: int) -> None:
        nested = threading.current_thread() is main and reading.holds() and reading._depth >= 2
        real_leave(depth)
        if nested and not fired:
            fired.append(True)
            signal.pthread_kill(main.ident, signal.SIGUSR2)  # the handler runs here: the first leave is done

    reading.leave_to = leave  # type: ignore[method-assign]
    held: List[bool] = []

    def on_error(message: Any) -> None:
        try:
            fake.session.ping(timeout=5)
        except TimeoutError:
            pass
        held.append(reading.holds())  # the outer ping still reads: the socket must still be its own

    fake.session.on_daemon_error.append(on_error)
    previous = signal.signal(signal.SIGUSR2, handler)
    try:
        # The daemon's side in a child process: a thread would make the main thread careful.
        child = os.fork()
        if child == 0:
            code = 1
            try:
                outer = client_request(fake.end.recv(8192))
                fake.end.send(daemon_frame({"type": "error", "code": "FIRST", "status": 13, "message": "x"}))
                inner = client_request(fake.end.recv(8192))
                fake.end.send(daemon_frame({"type": "pong", "request": inner["request"]}))
                fake.end.send(daemon_frame({"type": "pong", "request": outer["request"]}))
                code = 0
            finally:
                os._exit(code)
        fake.session.ping(timeout=5)
        _, status = os.waitpid(child, 0)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert fired
    assert held == [True], "a repeated leave after an interrupt released the outer call's take"


def test_an_interrupt_in_the_leave_after_an_answered_allocate_leaks_no_descriptor(fake: FakeDaemon, interrupt: Any) -> None:
    """_request's finally (its leave) re-raises an interrupt that came as
    it left, after _await had the answer: the allocate fails, and the
    descriptor in its _Pending is closed by no one (the except that abandons
    covers the try only)."""
    reading = fake.session._reading
    real_leave = reading.leave_to
    fired: List[bool] = []

    def leave(depth: int) -> None:
        real_leave(depth)
        if not fired and threading.current_thread() is threading.main_thread():
            fired.append(True)
            interrupt()

    reading.leave_to = leave  # type: ignore[method-assign]
    baseline = open_fds()
    read, write = os.pipe()

    side = fake.serve(lambda request: fake.allocated(request, read))
    with pytest.raises(Interrupted):
        fake.session.allocate(4096, timeout=5)
    side.join(5)
    os.close(read)
    os.close(write)
    assert fired
    assert open_fds() == baseline, "the allocation's descriptor leaked"


def test_a_timeout_of_minus_infinity_does_not_wait_for_ever(fake: FakeDaemon) -> None:
    """_await turns any infinite timeout into None (no limit): -inf too."""
    thread, out = in_thread(lambda: fake.session.ping(timeout=-math.inf))
    thread.join(3)
    assert not thread.is_alive(), "ping(timeout=-inf) waits without limit"
    assert isinstance(out.get("error"), vmmd.VmmdError) and out["error"].code == "NO_ANSWER"


def test_take_transfer_with_an_infinite_timeout_waits(fake: FakeDaemon) -> None:
    """Condition.wait(inf) raises OverflowError: take_transfer(timeout=inf) fails at once."""
    thread, out = in_thread(lambda: fake.session.take_transfer("3", timeout=math.inf))
    time.sleep(0.2)
    read, write = os.pipe()
    try:
        fake.send({"type": "transfer", "id": "3"}, read)
        thread.join(5)
    finally:
        os.close(read)
        os.close(write)
    assert not thread.is_alive()
    assert "error" not in out, repr(out.get("error"))
    os.close(out["value"])


def test_the_main_thread_at_its_deadline_finds_its_answer_behind_another_message(fake: FakeDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """With other threads running the main thread takes only its own answer.
    Its last look at the deadline ("an answer already here is not a
    timeout") stops at any other message in front (a transfer for another
    thread's RPC): drain says YIELDED, read_until says TIMED_OUT, and the call
    fails NO_ANSWER with its answer in the socket (release_many after its
    deadline likewise fails every release left). Here the caller is held up
    (descheduled) in its first wait, past its deadline, while both messages come."""

    class SlowPoll:
        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.calls = 0

        def poll(self, timeout: Any = None) -> Any:
            self.calls += 1
            if self.calls == 1:
                time.sleep(0.6)  # the daemon's side sends both messages meanwhile
                return []
            return self.inner.poll(timeout)

    fake.session._reading._caller_poll = SlowPoll(fake.session._reading._caller_poll)  # type: ignore[assignment]
    read, write = os.pipe()

    side = fake.serve(lambda request: (fake.send({"type": "transfer", "id": "8"}, read), fake.pong(request)))
    done = threading.Event()
    other = threading.Thread(target=done.wait, daemon=True)  # another thread of the program, alive throughout
    other.start()
    try:
        try:
            fake.session.ping(timeout=0.2)
        except vmmd.VmmdError as error:
            pytest.fail(f"the answer was in the socket at the deadline: {error}")
        side.join(5)
        os.close(fake.session.take_transfer("8", timeout=5))
    finally:
        done.set()
        other.join(5)
        os.close(read)
        os.close(write)
