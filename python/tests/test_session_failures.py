"""The session's reading (vmmd/_reading.py, vmmd/session.py) when the daemon
or the program misbehaves around it: an interrupt as a caller leaves the
socket or waits for an allocate, a malformed answer, an on_close callback
that raises, a batch of releases larger than the daemon can queue, a request
made from an on_daemon_error callback. (Each case failed when written.)"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, List

import pytest

import vmmd
from vmmd import _reading as reading_module

from conftest import Daemon
from test_session_hazards import Interrupted, interrupt  # noqa: F401 - the fixture
from test_session_reading import FakeDaemon, fake, in_thread  # noqa: F401 - the fixture


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("where", ["before the holder is cleared", "after the holder is cleared"])
def test_an_interrupt_as_the_caller_leaves_the_socket_does_not_wedge_the_reader(fake: FakeDaemon, interrupt: Any, where: str) -> None:
    """Every call leaves the socket in a finally, but the finally itself can
    be interrupted (CPython runs a handler between any two bytecodes, e.g.
    right after `threading.get_ident()` returns in leave()). Before
    `holder = None` the main thread holds the socket for good: the reader
    thread waits for it for ever, other threads' calls time out, transfers and
    the hang-up go unread. After it, the reader thread's epoll still watches
    only the hang-up (and is not notified): transfers go unread until some
    caller's take/leave."""
    reading = fake.session._reading
    fired: List[bool] = []
    main = threading.main_thread()
    if where == "before the holder is cleared":
        real_leave = reading.leave_to

        def leave(depth: int) -> None:
            if not fired and threading.current_thread() is main and reading.holds():
                fired.append(True)
                interrupt()  # the handler runs here, before the real leave's first line
            real_leave(depth)

        reading.leave_to = leave  # type: ignore[method-assign]
    else:
        real_watch_for = reading._watch_for

        def watch_for(mask: int) -> None:
            if not fired and mask == reading_module._WATCH_ALL and threading.current_thread() is main:
                fired.append(True)
                interrupt()  # leave() has set holder = None; the handler runs before the epoll is switched back
            real_watch_for(mask)

        reading._watch_for = watch_for  # type: ignore[method-assign]
    side = threading.Thread(target=lambda: fake.pong(fake.request()), daemon=True)
    side.start()
    try:
        fake.session.ping(timeout=5)
    except Interrupted:
        pass  # Ctrl-C in a REPL or notebook: the program goes on with its session
    side.join(5)
    assert fired
    # A descriptor the daemon sends for a gRPC call (Export, the Allocate RPC, Stores.Open): only the reader thread can take it.
    read, write = os.pipe()
    try:
        fake.send({"type": "transfer", "id": "9"}, read)
        try:
            fd = fake.session.take_transfer("9", timeout=2)
            os.close(fd)
        except vmmd.VmmdError as error:
            pytest.fail(f"the reader thread no longer reads after an interrupted leave(): {error}")
    finally:
        os.close(read)
        os.close(write)


def test_an_answer_with_a_malformed_status_fails_only_its_call(fake: FakeDaemon) -> None:
    """_dispatch claims never to raise for what the daemon sent, and the
    reading no longer catches anything around it (the old reader loop did).
    An error answer whose `status` is no gRPC status must still fail the
    call with a VmmdError (UNKNOWN), never a bare error out of _dispatch that
    leaves its request registered for ever."""
    thread, out = in_thread(lambda: fake.session.allocate(4096, timeout=3))
    request = fake.request()
    fake.send({"type": "error", "request": request["request"], "code": "OUT_OF_MEMORY", "status": 99, "message": "no room"})
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(out.get("error"), vmmd.VmmdError), f"the caller got {out.get('error')!r}"
    assert fake.session._requests == {}


def test_a_malformed_answer_read_by_the_reader_thread_does_not_end_the_session(fake: FakeDaemon) -> None:
    """The same answer read by the reader thread (the main thread, looking
    first, left it there: it answers another thread's call) raises out of
    reader_loop: the reader thread dies and finishes the session
    (SESSION_LOST for everyone, on_close callbacks: the client is marked lost)
    over one bad message."""
    lost: List[bool] = []
    fake.session.on_close.append(lambda: lost.append(True))

    def daemon_side() -> None:
        mine = fake.request()  # the main thread's ping: it holds the socket from before it sent
        other_box.append(in_thread(lambda: fake.session.allocate(4096, timeout=1)))
        other = fake.request()  # the other thread's allocate: its take failed, it waits on its event
        fake.send({"type": "error", "request": other["request"], "code": "OUT_OF_MEMORY", "status": 4000000000, "message": "no room"})
        time.sleep(0.2)
        fake.pong(mine)

    other_box: List[Any] = []
    side = threading.Thread(target=daemon_side, daemon=True)
    side.start()
    try:
        fake.session.ping(timeout=5)
    except vmmd.VmmdError:
        pass
    side.join(10)
    other_box[0][0].join(10)
    time.sleep(0.1)
    assert not lost and not fake.session.closed, "one malformed answer ended the session"
    assert fake.session._reader.is_alive()


@pytest.mark.filterwarnings("ignore:vmmd. an on_close callback failed")
def test_an_on_close_callback_that_raises_leaks_no_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the daemon goes away the reader thread runs _finish(), whose
    on_close callbacks (VmmdClient's, which calls the user's
    on_session_lost callbacks) may raise; `_read_loop` then never reaches
    `self._reading.close()`: the epoll and the eventfd leak, two descriptors
    per lost session."""
    failed: List[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failed.append(args.exc_value))
    raised: List[int] = []
    baseline = open_fds()
    for _ in range(5):
        made = FakeDaemon()

        def raising() -> None:
            raised.append(1)
            raise RuntimeError("a user's on_session_lost callback failed")

        made.session.on_close.append(raising)
        reader = made.session._reader
        made.end.close()  # the daemon goes away
        reader.join(5)
        assert not reader.is_alive()
        made.session.close()
    assert len(raised) == 5  # the callbacks did raise (on the reader thread: a warning now, not the thread's end)
    assert failed == []
    assert open_fds() == baseline, f"{open_fds() - baseline} descriptors leaked by 5 lost sessions"


def test_release_many_of_a_large_batch_gets_every_answer(daemon: Daemon) -> None:
    """release_many takes the socket before it sends and reads nothing until
    every request is sent, and the reader thread may not read meanwhile. The
    daemon answers as the requests come and drops an answer when the
    client's socket is full (SESSION_SOCKET_FULL, server/transport/session/sessions.ts
    trySend): past a few hundred unread answers the rest are lost, and the
    call ends NO_ANSWER although the daemon did every release. Before, the
    reader thread read the answers while the requests went out."""
    with daemon.connect() as client:
        ids = list(range(1 << 40, (1 << 40) + 3000))  # allocations that do not exist: every answer is a refusal
        try:
            results = client.session.release_many(ids, timeout=10)
        except vmmd.VmmdError as error:
            pytest.fail(f"release_many of {len(ids)} ids: {error}")
        assert len(results) == len(ids)
        assert all(isinstance(result, vmmd.VmmdError) and result.code != "NO_ANSWER" for result in results)


def test_a_request_from_an_on_daemon_error_callback_keeps_the_socket_held_by_one_thread(fake: FakeDaemon) -> None:
    """take() is re-entrant without a count: a request made from an
    on_daemon_error callback (which runs on the reading thread, here the
    reader thread) leaves the socket at its end while the outer reading
    goes on. A caller takes it meanwhile; the reader thread's drain then
    ends with `holder = None` over that caller's hold, so the caller's own
    leave() does nothing and the reader thread's epoll stays on the hang-up
    only: a descriptor sent afterwards is never read."""
    caller_box: List[Any] = []

    def on_error(message: Any) -> None:
        if message.code != "FIRST":
            return
        # The reader thread pings from the callback (the daemon side answers it below).
        fake.session.ping(timeout=5)
        # Another thread's call takes the socket as soon as the nested call left it.
        caller_box.append(in_thread(lambda: fake.session.ping(timeout=5)))
        deadline = time.monotonic() + 5
        while not fake.session._requests and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.1)  # the caller has sent its ping (holding the socket, here) and reads by now

    fake.session.on_daemon_error.append(on_error)
    fake.send({"type": "error", "code": "FIRST", "status": 13, "message": "an error the callback answers with a ping"})
    fake.pong(fake.request())  # the callback's ping
    second = fake.request()  # the other thread's ping, sent while it holds the socket
    time.sleep(0.3)  # the callback returns; the reader thread's drain ends
    fake.pong(second)
    caller, out = caller_box[0]
    caller.join(10)
    assert "error" not in out, out.get("error")
    read, write = os.pipe()
    try:
        fake.send({"type": "transfer", "id": "4"}, read)
        try:
            os.close(fake.session.take_transfer("4", timeout=2))
        except vmmd.VmmdError as error:
            pytest.fail(f"the reader thread no longer reads: {error}")
    finally:
        os.close(read)
        os.close(write)


def test_an_interrupted_allocate_leaks_neither_its_request_nor_its_descriptor(fake: FakeDaemon, interrupt: Any) -> None:
    """Ctrl-C (or a SIGALRM handler's TimeoutError) while the main thread
    waits for its allocate: the exception goes through read_until and _await,
    which forget nothing (only NO_ANSWER pops the request and closes a
    descriptor): the request stays registered, and the answer that comes
    next is dispatched into the orphaned _Pending, whose descriptor (the
    allocation's memory) is never closed. (As before the change, through
    Event.wait.)"""
    baseline = open_fds()
    read, write = os.pipe()

    def answer_late(request: Any) -> None:
        interrupt()  # the main thread is in read_until's poll
        time.sleep(0.2)
        fake.allocated(request, read)

    side = fake.serve(answer_late)
    with pytest.raises(Interrupted):
        fake.session.allocate(4096, timeout=5)
    side.join(5)
    time.sleep(0.3)  # the reader thread has dispatched the late answer
    os.close(read)
    os.close(write)
    assert all(pending.abandoned for pending in fake.session._requests.values()), "a caller still waits for the interrupted request"
    assert open_fds() == baseline, "the late answer's descriptor leaked"
    # The allocation the late answer made is nobody's: the session releases it.
    release = fake.request()
    assert (release["type"], release["allocationId"]) == ("release", "5")
