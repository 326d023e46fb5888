"""A session survives an interrupt anywhere: a lock whose acquire raises
right after taking it (where CPython would run Ctrl-C's handler) leaves the
session usable, and a storm of SIGINTs on a process whose threads allocate
and release leaves no session wedged and nothing owned by nobody (no
allocation in the daemon, no descriptor in the process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

import pytest

import vmmd

from conftest import Daemon, eventually
from test_session_hazards import Interrupted
from test_session_reading import FakeDaemon, fake, in_thread  # noqa: F401 - the fixture


class RaisingAfterAcquire:
    """A lock whose `armed`-th acquire by the main thread raises Interrupted
    once it holds the lock (a signal handled right after the C acquire
    returned). Everything else goes to the real lock."""

    def __init__(self, inner: Any, armed: int) -> None:
        self._inner = inner
        self._countdown = armed
        self.fired = False

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        got = self._inner.acquire(*args, **kwargs)
        if got and not self.fired and threading.current_thread() is threading.main_thread():
            self._countdown -= 1
            if self._countdown == 0:
                self.fired = True
                raise Interrupted()
        return got

    def release(self) -> None:
        self._inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._inner.release()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def ping_from_another_thread(fake: FakeDaemon) -> Any:
    """A ping on a second thread, answered: its outcome ({"value"} or {"error"})."""
    thread, out = in_thread(lambda: fake.session.ping(timeout=2))
    try:
        fake.end.settimeout(3)
        while True:
            request = fake.request()
            if request.get("type") == "ping" and request.get("request") not in (None, "0"):
                fake.pong(request)
                break
    except OSError as error:
        out.setdefault("error", error)
    thread.join(5)
    if thread.is_alive():
        out.setdefault("error", "the second thread's ping never returned")
    return out


def interrupted_ping(fake: FakeDaemon) -> None:
    """A ping on the main thread that an injected lock interrupts; its request may be answered."""
    side = threading.Thread(target=lambda: _answer_pings(fake, 1), daemon=True)
    side.start()
    try:
        fake.session.ping(timeout=1)
    except (Interrupted, vmmd.VmmdError):
        pass
    side.join(3)


def _answer_pings(fake: FakeDaemon, count: int) -> None:
    fake.end.settimeout(1)
    try:
        for _ in range(count):
            fake.pong(fake.request())
    except OSError:
        pass


@pytest.mark.parametrize("armed", [1, 2])
def test_a_send_lock_interrupted_right_after_its_acquire_is_not_left_held(fake: FakeDaemon, armed: int) -> None:
    lock = RaisingAfterAcquire(fake.session._send_lock, armed)
    fake.session._send_lock = lock
    interrupted_ping(fake)
    interrupted_ping(fake)
    assert lock.fired
    out = ping_from_another_thread(fake)
    assert "error" not in out, f"the session is wedged after an interrupt in the send lock's acquire: {out['error']!r}"


@pytest.mark.parametrize("armed", [1, 2, 3, 4, 5, 6])
def test_a_condition_interrupted_right_after_its_acquire_is_not_left_held(fake: FakeDaemon, armed: int) -> None:
    lock = RaisingAfterAcquire(threading.RLock(), armed)
    condition = threading.Condition(lock)  # type: ignore[arg-type]
    fake.session._lock = condition
    fake.session._reading._lock = condition
    for _ in range(3):
        interrupted_ping(fake)
    assert lock.fired
    out = ping_from_another_thread(fake)
    assert "error" not in out, f"the session is wedged after an interrupt in its lock's acquire: {out['error']!r}"


STORM = r'''
import json, os, signal, sys, threading, time
import vmmd
MiB = 1 << 20
client = vmmd.connect()
main = threading.main_thread().ident
target = int(sys.argv[1])
stop = threading.Event()
done = {"sent": 0}

def storm():
    time.sleep(0.2)  # (the main thread is in its loop by then: start() is not interrupted)
    while not stop.is_set() and done["sent"] < target:
        signal.pthread_kill(main, signal.SIGINT)
        done["sent"] += 1
        time.sleep(0.0007)
    stop.set()

def worker(index, outcomes):
    calls = 0
    while not stop.is_set():
        memory = client.vmm.allocate(2 * MiB)
        client.vmm.release(allocation_id=memory.allocation_id)
        memory.close()
        client.session.ping(timeout=5)
        calls += 1
    outcomes[index] = calls

def release(held):
    # Released, then forgotten: an interrupt between the two releases it twice (refused), never not at all.
    try:
        client.vmm.release(allocation_id=held[-1].allocation_id)
    except vmmd.VmmdError as error:
        if error.code not in ("UNKNOWN_ALLOCATION", "ALREADY_RELEASED"):
            raise
    held.pop()

def fds():
    return len(os.listdir("/proc/self/fd"))

held = []
memory = client.vmm.allocate(2 * MiB)
client.vmm.release(allocation_id=memory.allocation_id)
memory.close()
client.admin.get_stats()  # the gRPC channel's connection, made on first use: not a leak
baseline_fds = fds()
outcomes = {}
workers = [threading.Thread(target=worker, args=(i, outcomes), daemon=True) for i in range(3)]
for thread in workers:
    thread.start()
interrupts = 0
main_calls = 0
# Ctrl-C's KeyboardInterrupt, raised only inside the loop's try: the loop's own jump back is no place for it.
inside = [False]
def on_sigint(signum, frame):
    if inside[0]:
        raise KeyboardInterrupt
signal.signal(signal.SIGINT, on_sigint)
sender = threading.Thread(target=storm, daemon=True)
sender.start()
while not stop.is_set():
    try:
        inside[0] = True
        if held:
            release(held)
        else:
            held.append(client.vmm.allocate(2 * MiB))
        main_calls += 1
        inside[0] = False
    except KeyboardInterrupt:
        inside[0] = False
        interrupts += 1
    except vmmd.VmmdError as error:
        print(json.dumps({"error": repr(error)}), flush=True)
        raise
sender.join()
while held:
    release(held)
for thread in workers:
    thread.join(10)
wedged = sum(thread.is_alive() for thread in workers)
# Every thread's next call works.
after = []
def last_call():
    try:
        client.session.ping(timeout=5)
        memory = client.vmm.allocate(2 * MiB, timeout=5)
        client.vmm.release(allocation_id=memory.allocation_id, timeout=5)
        memory.close()
        after.append(True)
    except Exception as error:
        after.append(repr(error))
threads = [threading.Thread(target=last_call) for _ in range(3)]
for thread in threads:
    thread.start()
last_call()
for thread in threads:
    thread.join(15)
deadline = time.monotonic() + 10
while True:
    mine = [s for s in client.admin.list_sessions().sessions if str(s.id) == client.session.id]
    left = client.admin.get_stats().allocations
    if (left == 0 and not client.session.orphans()) or time.monotonic() > deadline:
        break
    client.session.ping(timeout=5)
    time.sleep(0.05)
leaks = {}
def target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # closed since the listing (the reader thread closes what answers nobody took brought)
        return "(closed)"
if left or fds() != baseline_fds:
    import gc
    from vmmd._abandoned import Pending
    # What a leak is made of, for the failure's message: the daemon's objects, the process's descriptors, the session's
    # records, and records still alive with an answer nobody took.
    leaks = {"objects": [(str(o.id), o.kind, str(o.owner_session)) for o in client.admin.list_objects().objects],
             "descriptors": sorted(target(fd) for fd in os.listdir("/proc/self/fd")),
             "untaken": [(repr(o.message)[:200], o.fd, o.abandoned) for o in gc.get_objects() if isinstance(o, Pending) and (o.message is not None or o.fd >= 0)],
             "requests": [(key, pending.abandoned, pending.message is not None, pending.fd) for key, pending in client.session._requests.items()],
             "held": [str(memory.allocation_id) for memory in held], "orphans": client.session.orphans()}
print(json.dumps({"interrupts": interrupts, "sent": done["sent"], "main_calls": main_calls, "worker_calls": sorted(outcomes.values()),
                  "wedged": wedged, "after": after, "allocations_left": left, "fds_leaked": fds() - baseline_fds, "leaks": leaks}), flush=True)
'''


def raising_at_first_call_of(name: str) -> Any:
    """A profiler raising KeyboardInterrupt at the entry of the first Pending.`name` called on this thread
    (a function's entry is where CPython runs a signal's handler); it is unset once it raised."""
    from vmmd import _abandoned

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename == _abandoned.__file__ and frame.f_code.co_name == name:
            raise KeyboardInterrupt

    return profile


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the record's finalizer, interrupted on purpose
def test_an_allocate_interrupted_as_its_answer_is_taken_and_again_as_the_record_is_collected_leaves_nothing(client: vmmd.VmmdClient) -> None:
    """The answer (an allocation and its descriptor) is the record's until its caller takes it: an interrupt at
    the take releases it on the spot, not in the record's finalizer, which a second interrupt can cut short."""
    client.admin.get_stats()  # the gRPC channel's connection, made on first use: not a leak
    fds = len(os.listdir("/proc/self/fd"))
    sys.setprofile(raising_at_first_call_of("take"))
    try:
        client.vmm.allocate(2 << 20)
        raise AssertionError("the take was not interrupted: the test tried nothing")
    except KeyboardInterrupt:
        # Set while the first interrupt still holds the frames: the record's finalizer is interrupted too.
        sys.setprofile(raising_at_first_call_of("__del__"))
    finally:
        sys.setprofile(None)
    # Each ping sends what is left to release.
    eventually(lambda: client.session.ping(timeout=5) >= 0 and client.admin.get_stats().allocations == 0, what="the allocation whose answer was interrupted to leave the daemon")
    assert len(os.listdir("/proc/self/fd")) == fds, "its descriptor is left open"


def test_a_storm_of_interrupts_wedges_no_session_and_leaks_nothing() -> None:
    """The main thread allocates and releases while a thread sends it SIGINT
    every 0.7 ms and three worker threads make calls on the same session."""
    target = int(os.environ.get("VMMD_STORM_INTERRUPTS", "10000"))
    # Each allocate cut short after it went is released once its answer is read: on a starved machine
    # hundreds are in flight at once (2 MiB each, never touched), more than the other tests' 256 MiB.
    daemon = Daemon(capacity="8GiB")
    try:
        storm(daemon, target)
    finally:
        daemon.stop()


def storm(daemon: Daemon, target: int) -> None:
    assert daemon.stats().allocations == 0, "the storm counts the daemon's allocations: it needs a daemon of its own"
    done = subprocess.run([sys.executable, "-c", STORM, str(target)], env=daemon.env(), capture_output=True, text=True, timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, f"the storm's process failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-3000:]}"
    result = json.loads(lines[-1])
    print("storm:", result)
    assert result["interrupts"] >= target // 2, result
    assert result["wedged"] == 0 and result["after"] == [True] * 4, result
    assert len(result["worker_calls"]) == 3, f"a worker thread ended with an error: {result} {done.stderr[-3000:]}"
    assert result["allocations_left"] == 0, result
    assert result["fds_leaked"] == 0, result


def test_a_take_the_main_thread_left_over_is_taken_back_and_other_threads_are_answered(fake: FakeDaemon) -> None:
    # What a second interrupt in the first one's clean-up leaves: the main thread holds the socket outside any call.
    assert fake.session._reading.take(False)
    try:
        out = ping_from_another_thread(fake)
        assert "error" not in out, f"another thread's call is not answered while the main thread's take is left over: {out['error']!r}"
        assert fake.session._reading.holder != threading.main_thread().ident
    finally:
        fake.session._reading.leave_to(0)


def test_a_take_of_the_main_thread_inside_a_call_is_not_taken_back(fake: FakeDaemon) -> None:
    import time

    from vmmd._reading import STALE_CHECK_S

    reading = fake.session._reading
    assert type(fake.session)._request_once.__code__ in reading._holding

    def a_call_that_holds_the_socket() -> bool:
        assert reading.take(False)
        try:
            time.sleep(STALE_CHECK_S * 6)
            return reading.holder == threading.main_thread().ident
        finally:
            reading.leave_to(0)

    reading._holding = reading._holding | {a_call_that_holds_the_socket.__code__}
    assert a_call_that_holds_the_socket(), "the reader thread took the socket from a call that held it"
