"""_locks.guarded and release_if_held under an exception raised at any point
of their Python code, as a signal handler's KeyboardInterrupt can be: the
lock is never left held by the thread once the exception is out."""
from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any, Callable, List, Optional

import pytest

from vmmd import _locks
from vmmd._locks import condition, guarded, mutex, release_if_held

LOCKS_FILE = _locks.__file__


def interrupted_at(step: int, action: Callable[[], None]) -> Optional[str]:
    """Runs `action` with a KeyboardInterrupt raised at its `step`-th traced
    event in _locks.py (a call or a line); returns where it was raised, or
    None when the action has fewer events (nothing raised)."""
    seen = [0]
    where: List[str] = []

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != LOCKS_FILE:
            return None
        if event in ("call", "line"):
            seen[0] += 1
            if seen[0] == step:
                where.append(f"{frame.f_code.co_name}:{frame.f_lineno} ({event})")
                raise KeyboardInterrupt
        return trace

    run_traced(action, trace)
    return where[0] if where else None


def run_traced(action: Callable[[], None], tracer: Any, profile: bool = False) -> None:
    """Runs `action` under `tracer` (sys.settrace's, or sys.setprofile's), a KeyboardInterrupt out of it swallowed."""
    install = sys.setprofile if profile else sys.settrace
    install(tracer)
    try:
        action()
    except KeyboardInterrupt:
        pass
    finally:
        install(None)


def owned(lock: Any) -> bool:
    return bool(lock._is_owned())


@pytest.mark.parametrize("make", [mutex, condition], ids=["mutex", "condition"])
@pytest.mark.parametrize("timeout", [None, 5.0], ids=["no-timeout", "timeout"])
def test_an_interrupt_anywhere_in_a_guarded_block_leaves_the_lock_free(make: Callable[[], Any], timeout: Optional[float]) -> None:
    lock = make()
    body = []

    def action() -> None:
        with guarded(lock, timeout):
            body.append(owned(lock))

    places = []
    for step in range(1, 200):
        where = interrupted_at(step, action)
        assert not owned(lock), f"the lock is left held after an interrupt at {where}"
        if where is None:
            break
        places.append(where)
    assert places, "no point of guarded() was interrupted: the test tried nothing"
    assert all(body), "the block ran without the lock"
    # Another thread takes it at once.
    got: List[bool] = []
    other = threading.Thread(target=lambda: got.append(lock.acquire(True, 1.0)) or lock.release())
    other.start()
    other.join(5)
    assert got == [True]


@pytest.mark.parametrize("make", [mutex, condition], ids=["mutex", "condition"])
def test_release_if_held_interrupted_anywhere_releases_or_raises_before_the_lock_is_taken(make: Callable[[], Any]) -> None:
    lock = make()
    for step in range(1, 50):
        lock.acquire()

        def action() -> None:
            try:
                release_if_held(lock)
            except KeyboardInterrupt:
                # The caller's own clean-up: asks again (what the session's except clauses do).
                release_if_held(lock)
                raise

        where = interrupted_at(step, action)
        assert not owned(lock), f"the lock is left held after an interrupt at {where}"
        if where is None:
            break


def test_release_if_held_leaves_another_threads_lock_alone() -> None:
    lock = mutex()
    taken, done = threading.Event(), threading.Event()

    def holder() -> None:
        lock.acquire()
        taken.set()
        done.wait(5)
        lock.release()

    thread = threading.Thread(target=holder)
    thread.start()
    taken.wait(5)
    release_if_held(lock)
    assert not lock.acquire(False), "release_if_held released a lock another thread holds"
    done.set()
    thread.join(5)


def test_surely_runs_a_clean_up_to_its_end_through_interrupts_at_any_two_points() -> None:
    from vmmd._locks import surely

    state = {"left": 0}

    def clean_up() -> None:
        state["left"] = 0
        state["left"] += 1  # two steps: an interrupt between them leaves it half done

    def action() -> None:
        surely(clean_up)

    for first in range(1, 30):
        for second in range(first + 1, first + 6):
            seen = [0]

            def trace(frame: FrameType, event: str, arg: Any) -> Any:
                if frame.f_code is not clean_up.__code__:
                    return trace if frame.f_code.co_filename == LOCKS_FILE else None
                if event == "line":
                    seen[0] += 1
                    if seen[0] in (first, second):
                        raise KeyboardInterrupt
                return trace

            state["left"] = -1
            run_traced(action, trace)
            assert state["left"] == 1, f"the clean-up was left half done (interrupts at lines {first} and {second})"


def interrupting_at_check_point(step: int, seen: List[int]) -> Any:
    """A profiler raising KeyboardInterrupt at the `step`-th check point of _abandoned.py's code (a
    function's entry, a C call's return: where CPython runs a signal handler); `seen[0]` counts them."""
    from vmmd import _abandoned

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if frame.f_code.co_filename != _abandoned.__file__ or event not in ("call", "c_return"):
            return
        seen[0] += 1
        if seen[0] == step:
            raise KeyboardInterrupt

    return profile


def allocated_answer(orphans: List[Any]) -> Any:
    """A Pending holding an allocate answer (allocation 7) and a real descriptor (a pipe's read end)."""
    import os

    from vmmd import _frames
    from vmmd._abandoned import Pending

    read, write = os.pipe()
    os.close(write)
    pending = Pending(orphans)
    pending.message = _frames.DaemonFrame(request=1, allocated={"allocation_id": 7})
    pending.fd = read
    return pending


def assert_closed(fd: int, step: int) -> None:
    """The answer's descriptor is closed once the record released it, whatever check point the interrupt hit."""
    import os

    try:
        os.fstat(fd)
    except OSError:
        return
    raise AssertionError(f"the descriptor stayed open after an interrupt at check point {step}")


def test_an_answer_taken_under_an_interrupt_at_any_check_point_stays_the_records_or_is_the_callers() -> None:
    """CPython runs a signal handler at a function's entry and after a call
    returns: the profiler's "call" and "c_return" events are those points."""
    import os

    cut = 0
    for step in range(1, 20):
        orphans: List[Any] = []
        pending = allocated_answer(orphans)
        read = pending.fd
        taken: List[Any] = []
        run_traced(lambda: taken.append(pending.take()), interrupting_at_check_point(step, [0]), profile=True)
        if taken:
            assert taken[0][1] == read and pending.fd == -1
            os.close(read)
            break
        cut += 1
        # Cut short: the record still holds the answer, and releasing it closes the descriptor and orphans the allocation.
        assert pending.fd == read and pending.message is not None, f"the answer was lost by an interrupt at check point {step}"
        pending.release()
        assert orphans == [("release", "7")]
        assert_closed(read, step)
    assert cut >= 2, "take() was interrupted at fewer than two points: the test tried nothing"


def test_an_answer_released_under_an_interrupt_at_any_check_point_is_released_whole_by_the_next_try() -> None:
    """A clean-up that an interrupt cut short is run again (surely): the
    second release must still find what the answer made."""
    cut = 0
    for step in range(1, 20):
        orphans: List[Any] = []
        pending = allocated_answer(orphans)
        read = pending.fd
        seen = [0]
        run_traced(pending.release, interrupting_at_check_point(step, seen), profile=True)
        if seen[0] < step:
            break
        cut += 1
        pending.release()
        assert orphans[:1] == [("release", "7")], f"the allocation was lost by an interrupt at check point {step}"
        assert_closed(read, step)
    assert cut >= 2, "release() was interrupted at fewer than two points: the test tried nothing"
