"""The session's reading under what can go wrong around it (vmmd/_reading.py):
signal handlers that raise while a caller reads (TimeoutError from a SIGALRM
timeout, KeyboardInterrupt on Ctrl-C), a timeout longer than poll() takes,
close() from a daemon-error callback, and the reader thread's end. Each runs
on a fake daemon (a SEQPACKET socketpair answered by hand). Where an
exception raised asynchronously is needed at an exact point, the test raises
it where CPython would run the handler: right after a C call returns.
(Every case failed when written.)"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, List

import pytest

import vmmd
from vmmd import _reading as reading_module
from vmmd import session as session_module

from test_session_reading import FakeDaemon, fake, in_thread  # noqa: F401 - the fixture


def count_drains(session: Any) -> List[str]:
    """Records the thread of every drain (every pass over the socket)."""
    calls: List[str] = []
    original = session._reading.drain

    def counting(*args: Any, **kwargs: Any) -> str:
        calls.append(threading.current_thread().name)
        return original(*args, **kwargs)

    session._reading.drain = counting
    return calls


def test_a_signal_handlers_oserror_in_a_reading_caller_propagates(fake: FakeDaemon) -> None:
    """A SIGALRM handler raising TimeoutError (an OSError) while the main
    thread waits in ping(): before the change, Event.wait let it through; now
    _read_until's `except (OSError, ValueError)` takes it for the end of the
    connection, swallows it, and the call waits on until its own timeout."""

    def alarm(signum: int, frame: Any) -> None:
        raise TimeoutError("the caller's own alarm")

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(TimeoutError):
            fake.session.ping(timeout=3)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_signal_handlers_oserror_leaves_no_thread_spinning(fake: FakeDaemon) -> None:
    """The same alarm marks the live connection `_ended`: callers may no
    longer read, and the reader thread skips its epoll wait and drains an
    empty socket in a loop for as long as the session lives (100% CPU)."""
    calls = count_drains(fake.session)

    def alarm(signum: int, frame: Any) -> None:
        raise TimeoutError("the caller's own alarm")

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        try:
            fake.session.ping(timeout=1)
        except (TimeoutError, vmmd.VmmdError):
            pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    fake.pong(fake.request())  # the late answer: one message, then silence
    time.sleep(0.2)
    before = len(calls)
    time.sleep(0.5)
    idle = len(calls) - before
    assert idle < 20, f"{idle} passes over an idle socket in 0.5 s (the reader thread spins)"
    # And the session still serves a caller.
    thread, out = in_thread(lambda: fake.session.ping(timeout=5))
    fake.pong(fake.request())
    thread.join(10)
    assert "error" not in out, out.get("error")


class Interrupted(BaseException):
    """What a signal handler raises here (as SIGINT's raises KeyboardInterrupt, which would stop pytest)."""


@pytest.fixture
def interrupt() -> Any:
    """interrupt(): sends SIGUSR1 to the main thread, whose handler raises
    Interrupted at the next bytecode boundary (right after the call that sent it)."""

    def handler(signum: int, frame: Any) -> None:
        raise Interrupted()

    previous = signal.signal(signal.SIGUSR1, handler)
    main = threading.main_thread().ident
    assert main is not None
    yield lambda: signal.pthread_kill(main, signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, previous)


def test_an_interrupt_in_the_reading_caller_loses_no_other_callers_answer(fake: FakeDaemon, monkeypatch: pytest.MonkeyPatch, interrupt: Any) -> None:
    """The main thread holds the socket (its ping); a second caller's answer
    comes; a signal (Ctrl-C) reaches the main thread just as recvmsg returns.
    The datagram is off the socket and never dispatched: the second caller
    never gets its answer (an allocate's descriptor would leak too; a
    dispatch interrupted after _requests.pop would lose it even to close()).
    Before the change only the reader thread, which signals never interrupt, read."""
    real = reading_module.recv_message
    fired: List[Any] = []

    def recv(sock: Any, flags: int = 0) -> Any:
        got = real(sock, flags)
        if threading.current_thread() is threading.main_thread() and not fired:
            fired.append(got)
            interrupt()
        return got

    monkeypatch.setattr(reading_module, "recv_message", recv)
    second_box: List[Any] = []

    def daemon_side() -> None:
        one = fake.request()  # sent: the main thread took the socket before sending
        second_box.append(in_thread(lambda: fake.session.ping(timeout=3)))
        two = fake.request()
        fake.pong(two)
        second_box[0][0].join(10)
        fake.pong(one)

    driver = threading.Thread(target=daemon_side, daemon=True)
    driver.start()
    try:
        fake.session.ping(timeout=30)
    except Interrupted:
        pass  # the main thread's own call may fail: that is what Ctrl-C is for
    driver.join(15)
    assert not driver.is_alive()
    second, second_out = second_box[0]
    assert not second.is_alive()
    assert "error" not in second_out, f"the second caller's answer was lost: {second_out.get('error')!r}"


def test_an_interrupt_as_a_caller_takes_the_socket_does_not_wedge_the_session(fake: FakeDaemon, interrupt: Any) -> None:
    """A signal handled right after the main thread took the socket (before
    the caller's own code records it) must not leave the socket held for
    ever: no caller could read, the reader thread would wait for the holder,
    and every later request would time out NO_ANSWER (transfers, daemon
    errors and the hang-up unseen too)."""
    reading = fake.session._reading
    real_take = reading.take
    fired: List[bool] = []

    def take(closed: bool, caller: bool = True) -> bool:
        got = real_take(closed, caller)
        if got and not fired and threading.current_thread() is threading.main_thread():
            fired.append(True)
            interrupt()
        return got

    reading.take = take
    try:
        fake.session.ping(timeout=1)
    except (Interrupted, vmmd.VmmdError):
        pass  # the interrupted call itself may fail
    assert fired
    fake.end.settimeout(0.2)
    try:
        while True:
            fake.request()  # whatever the interrupted call sent goes unanswered
    except OSError:
        pass
    fake.end.settimeout(5)
    second, second_out = in_thread(lambda: fake.session.ping(timeout=3))
    fake.pong(fake.request())
    second.join(10)
    assert not second.is_alive()
    assert "error" not in second_out, f"the session no longer reads: {second_out.get('error')!r}"


def test_a_long_timeout_waits_instead_of_overflowing_poll() -> None:
    """poll() takes at most 2^31-1 ms (about 24.8 days); a longer timeout
    (Event.wait took it before the change) raises OverflowError from the
    caller's poll, which _read_until does not catch. busy_poll_us=0 makes the
    first wait a sleeping one; with the default it comes 200 us later."""
    import socket

    from test_session_reading import HELLO, client_request, daemon_frame

    end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    end.settimeout(5)
    session = session_module.ClientSession(client_end, HELLO, busy_poll_us=0)
    try:
        thread, out = in_thread(lambda: session.ping(timeout=30 * 24 * 3600.0))

        request = client_request(end.recv(8192))
        time.sleep(0.05)
        end.send(daemon_frame({"type": "pong", "request": request["request"]}))
        thread.join(10)
        assert not thread.is_alive()
        assert "error" not in out, repr(out.get("error"))
    finally:
        end.close()
        session.close()


def test_close_from_a_daemon_error_callback_returns_at_once(fake: FakeDaemon) -> None:
    """on_daemon_error callbacks now run on whichever caller reads, while it
    holds the socket (counted in _readers). close() from one joins the reader
    thread, which waits for _readers == 0: it returns only after its 5 s
    join times out. On the reader thread (before) it returned at once."""
    took: List[float] = []

    def on_error(message: Any) -> None:
        started = time.monotonic()
        fake.session.close()
        took.append(time.monotonic() - started)

    fake.session.on_daemon_error.append(on_error)
    thread, out = in_thread(lambda: fake.session.ping(timeout=30))
    fake.request()  # the caller holds the socket from before it sent
    fake.send({"type": "error", "code": "FREE_FAILED", "status": 13, "message": "a free failed after its answer"})
    thread.join(15)
    assert not thread.is_alive()
    assert isinstance(out.get("error"), vmmd.VmmdError) and out["error"].code == "SESSION_LOST"
    assert took and took[0] < 2.5, f"close() from the callback took {took[0]:.1f} s"


def test_the_reader_thread_ends_and_leaves_no_descriptor_however_the_session_closes() -> None:
    """close() from a callback on the reading caller, racing the reader
    thread's own wait: the thread must end (a socket closed before it waits
    left nothing in its epoll to wake it) and the session's descriptors go."""
    baseline = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        made = FakeDaemon()
        made.session.on_daemon_error.append(lambda message, made=made: made.session.close())
        thread, out = in_thread(lambda: made.session.ping(timeout=30))
        made.request()
        made.send({"type": "error", "code": "FREE_FAILED", "status": 13, "message": "a free failed after its answer"})
        thread.join(10)
        assert isinstance(out.get("error"), vmmd.VmmdError) and out["error"].code == "SESSION_LOST"
        made.session._reader.join(5)
        assert not made.session._reader.is_alive()
        made.end.close()
    assert len(os.listdir("/proc/self/fd")) == baseline


def test_a_forked_child_cannot_use_its_parents_session_nor_end_it(fake: FakeDaemon) -> None:
    """A child forked while a session is open shares its socket: a request
    from it would take the parent's answers, and its close() (a `with` block
    ending in the child) would shut the parent's session down. The child is
    refused (FORKED), and its close() only drops its own copy."""
    import warnings

    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads running: this child runs no Python thread
        child = os.fork()
    if child == 0:
        code = 1
        try:
            os.close(read)
            turned: List[int] = []
            real_watch_for = fake.session._reading._watch_for
            fake.session._reading._watch_for = lambda mask: (turned.append(mask), real_watch_for(mask))  # type: ignore[method-assign]
            try:
                fake.session.ping(timeout=1)
                os.write(write, b"answered")
            except vmmd.VmmdError as error:
                # Refused before it took the socket: the epoll it shares with its parent was not turned.
                os.write(write, error.code.encode() if not turned else b"turned the parent's epoll")
            fake.session.close()
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(child, 0)
    said = os.read(read, 100).decode()
    os.close(read)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert said == "FORKED"
    thread, out = in_thread(lambda: fake.session.ping(timeout=5))
    fake.pong(fake.request())
    thread.join(10)
    assert "error" not in out, f"the parent's session did not survive its child: {out.get('error')!r}"
