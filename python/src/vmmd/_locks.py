"""Locks that an exception raised anywhere cannot leave held.

CPython runs a signal handler (Ctrl-C's KeyboardInterrupt) in the main thread
at its next check point: after a call returns, at a function's entry, on a
loop's way back. `lock.acquire()` followed by `try:` has one between the two;
a Condition's `__enter__` is Python code with one after its lock is taken; a
Python `__exit__` has one at its entry, before it releases anything. An
interrupt at any of them leaves the lock held with nothing to release it,
and every later caller waits for ever.

Here every release is the lock's own C code, which checks the owner and
releases in one call: guarded()'s way out is the lock's C `__exit__`, looked
up by the `with` statement before `__enter__` runs (nothing of Python runs
between the block's end and the release), and the acquire happens inside a
`try` that releases it again when anything raises after it.

Each lock made here is taken at most once at a time by a thread (never
nested): that is what makes "held by this thread" mean "taken by this call".
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional


def mutex() -> "threading.RLock":
    """A lock for guarded(): an RLock, for its owner (never taken twice by one thread)."""
    return threading.RLock()


def condition() -> threading.Condition:
    """A Condition for guarded(), over mutex()."""
    return threading.Condition(mutex())


def release_if_held(lock: Any) -> None:
    """Releases `lock` (a mutex() or a condition()) if this thread holds it:
    the RLock's release checks the owner and releases in one C call."""
    try:
        lock.release()
    except RuntimeError:
        pass  # not held by this thread


class guarded:
    """`with guarded(lock):`, or `guarded(lock, timeout, refuse)` that raises
    refuse() when the lock is not taken within `timeout` seconds: the lock
    is released on the way out however the block ends, and an exception
    raised while it is being taken leaves it free. A Condition's wait()
    inside the block may be interrupted with the lock released or held: the
    C release asks, as for the acquire. (A class, not a generator: an
    exception between a generator's yield and the `with` would leave it
    suspended, holding the lock, until it is collected.)"""

    __slots__ = ("_mutex", "_timeout", "_refuse")

    def __init__(self, lock: Any, timeout: Optional[float] = None, refuse: Optional[Callable[[], BaseException]] = None) -> None:
        # A Condition's own __enter__/__exit__ are Python: the RLock under it is what is taken and released.
        self._mutex = lock._lock if isinstance(lock, threading.Condition) else lock  # type: ignore[attr-defined]
        self._timeout = -1.0 if timeout is None else timeout
        self._refuse = refuse

    def __enter__(self) -> None:
        try:
            if not self._mutex.acquire(True, self._timeout):
                raise (self._refuse() if self._refuse is not None else TimeoutError(f"lock not taken within {self._timeout} s"))
        except BaseException:
            release_if_held(self._mutex)
            raise

    @property
    def __exit__(self) -> Callable[..., Any]:
        # The RLock's C __exit__, fetched by the `with` before __enter__: an interrupt here has taken nothing.
        return self._mutex.__exit__  # type: ignore[no-any-return]


class Flag:
    """A one-shot event: set() once, by one thread; wait() by the thread that
    awaits it. threading.Event's wait() takes a Condition (the window
    above): an interrupt there would leave set(), called under the
    session's lock by the thread that reads, blocked for ever."""

    __slots__ = ("_set", "_gate")

    def __init__(self) -> None:
        self._set = False
        # Held until set(): a waiter blocks in its acquire, in C.
        self._gate = threading.Lock()
        self._gate.acquire()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        try:
            self._gate.release()
        except RuntimeError:
            pass  # a racing set() released it already

    def wait(self, timeout: Optional[float] = None) -> bool:
        """True once set; False when `timeout` seconds (None: no limit) passed first."""
        if self._set:
            return True
        if self._gate.acquire(True, -1.0 if timeout is None else max(0.0, timeout)):
            self._gate.release()
        return self._set


# How often surely() runs an action again that exceptions keep cutting short, before it gives up.
SURELY_TRIES = 100


def surely(action: Callable[[], None]) -> None:
    """Runs `action` (a clean-up that may run twice) to its end although an
    exception cuts it short: a second interrupt while the first one's
    clean-up waits for a lock, say. It runs again until it ends without one
    (at most SURELY_TRIES times); the exception that came last is raised
    after, as it would have been."""
    interrupted: Optional[BaseException] = None
    for _ in range(SURELY_TRIES):
        try:
            action()
            break
        except BaseException as error:
            interrupted = error
    if interrupted is not None:
        try:
            raise interrupted
        finally:
            # Not kept by this frame, which its traceback holds: a cycle would keep the frames' records (an
            # answer nobody took) until a collection ran their finalizers at any later moment.
            interrupted = None
