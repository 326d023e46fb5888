"""Locks that an exception raised anywhere cannot leave held.

CPython runs a signal handler (Ctrl-C's KeyboardInterrupt) between two
bytecodes of the main thread. `lock.acquire()` followed by `try:` has such a
point between the two, and a Condition's `__enter__` is Python code with the
same point after its lock is taken: an interrupt there leaves the lock held
with no `finally` to release it, and every later caller waits for ever.
Here the acquire happens inside the `try`, and what releases asks the lock
whether this thread holds it: a C RLock knows its owner, whatever the
interpreter was doing when the exception came.

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
    """Releases `lock` (a mutex() or a condition()) if this thread holds it."""
    if lock._is_owned():
        lock.release()


class guarded:
    """`with guarded(lock):`, or `guarded(lock, timeout, refuse)` that raises
    refuse() when the lock is not taken within `timeout` seconds: the lock
    is released on the way out however the block ends, and an exception
    raised while it is being taken leaves it free. A Condition's wait()
    inside the block may be interrupted with the lock released or held: the
    way out asks, as for the acquire. (A class, not a generator: an
    exception between a generator's yield and the `with` would leave it
    suspended, holding the lock, until it is collected.)"""

    __slots__ = ("_lock", "_timeout", "_refuse")

    def __init__(self, lock: Any, timeout: Optional[float] = None, refuse: Optional[Callable[[], BaseException]] = None) -> None:
        self._lock = lock
        self._timeout = -1.0 if timeout is None else timeout
        self._refuse = refuse

    def __enter__(self) -> None:
        try:
            acquired = self._lock.acquire(True, self._timeout)
        except BaseException:
            release_if_held(self._lock)
            raise
        if not acquired:
            raise (self._refuse() if self._refuse is not None else TimeoutError(f"lock not taken within {self._timeout} s"))

    def __exit__(self, *exc: Any) -> None:
        release_if_held(self._lock)


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
