"""Who reads the session socket: a caller waiting for its answer reads it on
its own thread (no hand-off through the reader thread and the GIL), the reader
thread takes what arrives while no caller reads, and neither loses a message,
an answer or the end of the session. A fake daemon on a socketpair makes the
timing cases exact; a real daemon checks many threads at once."""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest

from google.protobuf import json_format

import vmmd
from vmmd import _frames, _proto
from vmmd.session import ClientSession

from conftest import MiB, Daemon

HELLO = _proto.message("HelloResponse")(protocol=2, session=7, token="0" * 64, pid=os.getpid(), uid=os.getuid(), gid=os.getgid(), capabilities=["CAPABILITY_MEMFD_DESCRIPTORS"])


def daemon_frame(flat: Dict[str, Any]) -> bytes:
    """A DaemonFrame's bytes from a flat dict: {"type": the body's case, "request": its id, the body's fields (JSON names)}."""
    fields = dict(flat)
    kind = fields.pop("type")
    frame = _frames.DaemonFrame(request=int(fields.pop("request", 0) or 0))
    getattr(frame, kind).SetInParent()
    json_format.ParseDict(fields, getattr(frame, kind))
    return frame.SerializeToString()


def client_request(data: bytes) -> Dict[str, Any]:
    """A ClientFrame flat: {"type": its body's case, "request": its id, the body's fields (JSON names)}."""
    frame = _frames.ClientFrame.FromString(data)
    kind = frame.WhichOneof("body")
    flat: Dict[str, Any] = {"type": kind, "request": str(frame.request)}
    if kind is not None:
        flat.update(json_format.MessageToDict(getattr(frame, kind)))
    return flat


class FakeDaemon:
    """The daemon's end of a SEQPACKET socketpair, answering by hand."""

    def __init__(self) -> None:
        self.end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.session = ClientSession(client_end, HELLO)
        self.end.settimeout(5)

    def request(self) -> Dict[str, Any]:
        data, fds, _, _ = socket.recv_fds(self.end, 8192, 4)
        for fd in fds:
            os.close(fd)
        return client_request(data)

    def send(self, message: Dict[str, Any], fd: int = -1) -> None:
        data = daemon_frame(message)
        if fd >= 0:
            socket.send_fds(self.end, [data], [fd])
        else:
            self.end.send(data)

    def pong(self, request: Dict[str, Any]) -> None:
        self.send({"type": "pong", "request": request["request"]})

    def serve(self, body: Any) -> threading.Thread:
        """On a thread of its own: waits for the next request and runs body(request)."""
        side = threading.Thread(target=lambda: body(self.request()), daemon=True)
        side.start()
        return side

    def allocated(self, request: Dict[str, Any], fd: int) -> None:
        self.send({"type": "allocated", "request": request["request"], "allocationId": "5", "size": "4096"}, fd)

    def close(self) -> None:
        self.end.close()
        self.session.close()


@pytest.fixture
def fake() -> Any:
    made = FakeDaemon()
    yield made
    made.close()


def in_thread(body: Any) -> Tuple[threading.Thread, Dict[str, Any]]:
    out: Dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = body()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            out["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def dispatch_threads(session: ClientSession) -> List[Tuple[str, str]]:
    """Records (message type, thread name) for every message the session dispatches."""
    seen: List[Tuple[str, str]] = []
    original = session._reading._dispatch

    def recording(data: bytes, fds: List[int], parsed: Optional[Dict[str, Any]] = None) -> None:
        seen.append((_frames.decode(data).WhichOneof("body"), threading.current_thread().name))
        original(data, fds, parsed)

    session._reading._dispatch = recording  # type: ignore[method-assign]
    return seen


def test_the_caller_reads_its_own_answer_on_its_thread(fake: FakeDaemon) -> None:
    seen = dispatch_threads(fake.session)
    thread, out = in_thread(lambda: fake.session.ping(timeout=5))
    fake.pong(fake.request())
    thread.join(5)
    assert "error" not in out and out["value"] > 0
    assert seen == [("pong", thread.name)]


def test_what_arrives_while_no_caller_waits_is_taken_by_the_reader_thread(fake: FakeDaemon) -> None:
    seen = dispatch_threads(fake.session)
    errors: List[Dict[str, Any]] = []
    fake.session.on_daemon_error.append(errors.append)
    read, write = os.pipe()
    try:
        fake.send({"type": "transfer", "id": "3"}, read)
        fake.send({"type": "error", "code": "FREE_FAILED", "status": 13, "message": "a free failed after its answer"})
        fd = fake.session.take_transfer("3", timeout=5)
        os.close(fd)
        deadline = time.monotonic() + 5
        while not errors and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        os.close(read)
        os.close(write)
    assert errors and errors[0].code == "FREE_FAILED"
    assert [name for _, name in seen] == [f"vmmd-session-{fake.session.id}"] * 2


def test_an_answer_that_comes_after_the_timeout_is_dropped_and_the_session_goes_on(fake: FakeDaemon) -> None:
    with pytest.raises(vmmd.VmmdError) as raised:
        fake.session.ping(timeout=0.2)
    assert raised.value.code == "NO_ANSWER"
    late = fake.request()
    # The late answer (with a descriptor, as an allocate's) lands after the caller gave up: closed, not kept.
    before = len(os.listdir("/proc/self/fd"))
    read, write = os.pipe()
    fake.send({"type": "allocated", "request": late["request"], "allocationId": "1"}, read)
    os.close(read)
    os.close(write)
    fake.pong(late)
    thread, out = in_thread(lambda: fake.session.ping(timeout=5))
    # The allocation the late answer made is its caller's no more: where the reader thread has recorded it by the
    # time the ping starts, the ping's call releases it first (its own request, answered here), then pings.
    while True:
        request = fake.request()
        if request["type"] == "ping":
            fake.pong(request)
            break
        assert (request["type"], request.get("allocationId")) == ("release", "1"), request
        fake.send({"type": "released", "request": request["request"], "freed": True})
    thread.join(5)
    assert not thread.is_alive() and "error" not in out, out.get("error")
    # Every message before the last pong was dispatched before it: the descriptor is closed by now.
    assert len(os.listdir("/proc/self/fd")) == before


def test_the_daemon_going_away_fails_a_reading_caller_at_once(fake: FakeDaemon) -> None:
    thread, out = in_thread(lambda: fake.session.ping(timeout=30))
    fake.request()
    started = time.monotonic()
    fake.end.close()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(out.get("error"), vmmd.VmmdError) and out["error"].code == "SESSION_LOST"
    assert time.monotonic() - started < 5
    # The caller fails at the end it read; the reader thread finishes the session right after.
    deadline = time.monotonic() + 5
    while not fake.session.closed and time.monotonic() < deadline:
        time.sleep(0.005)
    assert fake.session.closed
    with pytest.raises(vmmd.VmmdError) as raised:
        fake.session.ping(timeout=1)
    assert raised.value.code == "SESSION_LOST"


def test_close_while_a_caller_reads_ends_its_wait(fake: FakeDaemon) -> None:
    thread, out = in_thread(lambda: fake.session.ping(timeout=30))
    fake.request()
    fake.session.close()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(out.get("error"), vmmd.VmmdError) and out["error"].code == "SESSION_LOST"


def two_callers(fake: FakeDaemon, later_first: bool) -> None:
    """Two pings from two threads, answered in the order they were sent or the other way round, each answer
    after the thread before it got its own."""
    first, first_out = in_thread(lambda: fake.session.ping(timeout=5))
    one = fake.request()
    second, second_out = in_thread(lambda: fake.session.ping(timeout=5))
    two = fake.request()
    for request, thread in ([(two, second), (one, first)] if later_first else [(one, first), (two, second)]):
        fake.pong(request)
        thread.join(5)
        time.sleep(0.05)
    assert "error" not in first_out and "error" not in second_out


def test_answers_out_of_order_reach_their_callers(fake: FakeDaemon) -> None:
    """Whichever caller reads dispatches the other's answer too, and the one
    whose answer comes after the reader left still gets it."""
    two_callers(fake, later_first=False)
    two_callers(fake, later_first=True)


def test_many_threads_at_once_each_get_their_answers(daemon: Daemon) -> None:
    with daemon.connect() as client:
        session = client.session
        failures: List[BaseException] = []

        def work() -> None:
            try:
                for _ in range(100):
                    session.ping(timeout=10)
                    message, fd = session.allocate(2 * MiB, timeout=10)
                    os.close(fd)
                    assert session.release(int(message.allocation_id), timeout=10).freed
            except BaseException as error:  # noqa: BLE001 - collected
                failures.append(error)

        before = daemon.stats().allocations
        threads = [threading.Thread(target=work) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads)
        assert failures == []
        assert daemon.stats().allocations == before


class RecordingPoll:
    """Stands in for a session's caller poll object, recording each wait's timeout."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.timeouts: List[Optional[int]] = []

    def poll(self, timeout: Optional[int] = None) -> Any:
        self.timeouts.append(timeout)
        return self.inner.poll(timeout)


@pytest.mark.parametrize("budget", [0, 200])
def test_a_caller_spins_for_its_answer_only_within_its_budget(budget: int) -> None:
    end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    session = ClientSession(client_end, HELLO, busy_poll_us=budget)
    recording = RecordingPoll(session._reading._caller_poll)
    session._reading._caller_poll = recording  # type: ignore[assignment]
    try:
        thread, out = in_thread(lambda: session.ping(timeout=5))
        request = client_request(end.recv(8192))
        time.sleep(0.05)  # well past any budget: the caller sleeps in poll by now
        end.send(daemon_frame({"type": "pong", "request": request["request"]}))
        thread.join(5)
        assert not thread.is_alive() and "error" not in out, out.get("error")
    finally:
        end.close()
        session.close()
    if budget == 0:
        assert 0 not in recording.timeouts
    else:
        assert recording.timeouts[0] == 0
    # Past the budget it sleeps: a poll with a timeout (the rest of the call's 5 s).
    assert any(timeout is not None and timeout > 0 for timeout in recording.timeouts)


@pytest.mark.parametrize("value", [-1, 10_001, 1.5, True, "200"])
def test_a_bad_busy_poll_budget_is_refused_by_name(daemon: Daemon, value: Any) -> None:
    with pytest.raises(vmmd.VmmdError) as raised:
        daemon.connect(busy_poll_us=value)
    assert raised.value.code == "BAD_OPTION" and raised.value.status == 3
    assert "busy_poll_us" in str(raised.value) and "0 to 10000" in str(raised.value)


def test_a_bad_busy_poll_budget_in_the_environment_is_refused_by_name(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMMD_CLIENT_BUSY_POLL_US", "fast")
    with pytest.raises(vmmd.VmmdError) as raised:
        daemon.connect()
    assert raised.value.code == "BAD_OPTION"
    assert "VMMD_CLIENT_BUSY_POLL_US" in str(raised.value) and "'fast'" in str(raised.value)
    monkeypatch.setenv("VMMD_CLIENT_BUSY_POLL_US", "0")
    with daemon.connect() as client:
        assert client.session._reading.busy_poll_s == 0
        assert client.session.ping() > 0


def test_the_main_thread_takes_only_its_own_answer_and_leaves_the_rest_to_the_reader_thread(fake: FakeDaemon) -> None:
    """Signal handlers run in the main thread between any two bytecodes: a
    message it took off the socket but had not dispatched would be lost. So
    the main thread looks before it takes, and a message for anyone else
    (here a descriptor the daemon sends meanwhile) goes to the reader thread;
    its own answer, behind it, still reaches it."""
    seen = dispatch_threads(fake.session)
    read, write = os.pipe()

    # Another Python thread for the whole call (the daemon's side may be done before the ping reads):
    # the main thread is careful only while others run.
    done = threading.Event()
    idle = threading.Thread(target=done.wait, daemon=True)
    idle.start()
    side = fake.serve(lambda request: (fake.send({"type": "transfer", "id": "5"}, read), fake.pong(request)))
    try:
        assert fake.session.ping(timeout=5) > 0
        side.join(5)
        fd = fake.session.take_transfer("5", timeout=5)
        os.close(fd)
    finally:
        done.set()
        os.close(read)
        os.close(write)
    reader = f"vmmd-session-{fake.session.id}"
    assert ("transfer", reader) in seen
    assert ("transfer", threading.main_thread().name) not in seen
    assert [kind for kind, _ in seen] == ["transfer", "pong"]


def test_the_main_thread_reads_its_own_answer_itself(fake: FakeDaemon) -> None:
    seen = dispatch_threads(fake.session)
    side = threading.Thread(target=lambda: fake.pong(fake.request()), daemon=True)
    side.start()
    assert fake.session.ping(timeout=5) > 0
    side.join(5)
    assert seen == [("pong", threading.main_thread().name)]


def test_the_main_thread_alone_reads_what_comes_before_its_answer_too(fake: FakeDaemon) -> None:
    """With no other Python thread but the reader, nothing can wait on what
    the main thread reads: it reads straight on, and an unsolicited daemon
    error in front of its answer (read by whichever thread comes first) still
    reaches the callbacks, the answer its caller."""
    if threading.active_count() != 2:
        pytest.skip(f"other Python threads run here ({threading.active_count()})")
    seen = dispatch_threads(fake.session)
    errors: List[Dict[str, Any]] = []
    fake.session.on_daemon_error.append(errors.append)
    # The daemon answers once the ping is sent, after an error of its own, both on the socket before the
    # main thread reads: answered from inside the send, on this thread (a thread of the fake's would make
    # the main thread careful). Sent before the ping, the answer could be read, and dropped as answering
    # nothing, by the reader thread before the ping registers its id, as a real daemon's never is.
    requests: List[Dict[str, Any]] = []
    send = fake.session._send

    def send_and_answer(message: Dict[str, Any], **kwargs: Any) -> None:
        send(message, **kwargs)
        requests.append(fake.request())
        fake.send({"type": "error", "code": "FREE_FAILED", "status": 13, "message": "a free failed after its answer"})
        fake.send({"type": "pong", "request": requests[-1]["request"]})

    fake.session._send = send_and_answer  # type: ignore[method-assign]
    assert fake.session.ping(timeout=5) > 0
    assert [request["type"] for request in requests] == ["ping"]
    assert [error.code for error in errors] == ["FREE_FAILED"]
    assert [kind for kind, _ in seen] == ["error", "pong"]
