"""Who reads the session socket: one thread at a time holds it, a caller
waiting for its answer or the session's reader thread.

A caller reads its own answer on its own thread: no hand-off through the
reader thread and the GIL (that hand-off made a ping from Python cost about
twice one from TypeScript). It spins up to its busy-poll budget before it sleeps in
poll. The reader thread reads only while no caller does: descriptors and
errors that come between calls, answers whose callers did not hold the
socket; while a caller holds it, the reader thread's epoll watches only for
the hang-up, so that one answer does not wake two threads.

Signals: Python runs a signal handler (KeyboardInterrupt) in the main thread
between any two bytecodes, so a message the main thread has taken off the
socket but not dispatched would be lost. When other Python threads run (and
might wait for an answer, or for a descriptor of an RPC), the main thread
therefore takes only its own answer: it looks at the next message first
(MSG_PEEK, no descriptors) and leaves anything else to the reader thread,
which signals never interrupt. Alone with the reader thread it reads
straight away: nothing but its own answer, an unsolicited daemon error (only
logged) or a descriptor nobody will claim (sent for a call that gave up) can
come while it waits. An interrupt can lose only the
interrupted call's own answer, as it could before.

A take the main thread could not leave (a second interrupt in the first
one's clean-up, while it waited for the session's lock) would stop every
other thread's reading: the reader thread looks every STALE_CHECK_S while
it waits for a caller's take to end (and every STALE_POLL_S in its epoll), and takes back a main thread's take when no call that holds one
(`holding`, the code of the functions between a take and its leave) is on
the main thread's stack any more.
"""
from __future__ import annotations

import array
import errno
import os
import select
import socket
import sys
import threading
import time
from types import CodeType
from typing import Any, Callable, Collection, List, Optional, Tuple

from . import _frames
from ._declared import MAX_MESSAGE_BYTES
from ._locks import guarded

# What the reader thread waits for: messages and the hang-up, or (while a caller reads) only the hang-up.
_WATCH_ALL = select.EPOLLIN | select.EPOLLRDHUP
_WATCH_HANGUP = select.EPOLLRDHUP
# A caller sleeps in poll at most this long at a time (poll takes a C int of milliseconds).
_POLL_CAP_MS = 60_000
# How often the reader thread, waiting while a caller reads, looks whether the main thread's take is left over;
# its epoll wakes at least every STALE_POLL_S to look (a take turns it to the hang-up alone).
STALE_CHECK_S = 0.05
STALE_POLL_S = 1.0
# Errors of a read that mean the connection is gone (a signal handler's OSError is not one of them).
_GONE = (errno.EBADF, errno.ENOTCONN, errno.ECONNRESET, errno.EPIPE, errno.ENOTSOCK)

# How a caller's reading ended.
ANSWERED = "answered"  # its answer was dispatched
TIMED_OUT = "timed out"  # its deadline passed
ENDED = "ended"  # the connection ended: the reader thread finishes the session
YIELDED = "yielded"  # (main thread) the next message is not its answer: the reader thread takes it


def recv_message(sock: socket.socket, flags: int = 0) -> Tuple[bytes, List[int]]:
    """One message and the descriptors that came with it (socket.recv_fds
    before Python 3.13 drops its `flags`: MSG_DONTWAIT would not hold).
    Descriptors are received close-on-exec, as Python opens its own (PEP 446)."""
    fds = array.array("i")
    data, ancillary, _, _ = sock.recvmsg(MAX_MESSAGE_BYTES * 2, socket.CMSG_LEN(4 * fds.itemsize), flags | socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def _gone(error: OSError) -> bool:
    return isinstance(error, ConnectionError) or error.errno in _GONE


class SocketReading:
    """The session socket's reading: who holds it (under the session's lock)
    and the reads themselves. `dispatch(data, fds, message)` takes every
    message and its descriptors (it owns them from the call on, and does not
    raise); `message` is the parsed one when the reading parsed it already."""

    def __init__(
        self,
        sock: socket.socket,
        lock: threading.Condition,
        dispatch: Callable[[bytes, List[int], Optional[Any]], None],
        busy_poll_us: int,
        carrying: Tuple[str, ...] = (),
        holding: Collection[CodeType] = (),
    ) -> None:
        self._sock = sock
        # The code of the functions that take the socket and leave it before they return.
        self._holding = frozenset(holding)
        self._lock = lock
        self._dispatch = dispatch
        # The frames' bodies that carry a descriptor: left to the reader thread by the main thread.
        self._carrying = carrying
        self.busy_poll_s = busy_poll_us / 1e6
        # Invariant: the thread that reads the socket (its ident), else None, and how many of its takes
        # it has not left yet (a request made from a callback on the reading thread takes it again);
        # both changed under _lock.
        self.holder: Optional[int] = None
        self._depth = 0
        # Whether the reader thread's epoll looks for messages (else only for the hang-up); under _lock.
        self._watching_all = True
        # The connection has ended (EOF, or the socket closed under a reader): the reader thread finishes the session.
        self.ended = False
        self._caller_poll = select.poll()
        self._caller_poll.register(sock, select.POLLIN)
        # The reader thread's epoll: the socket, and an eventfd that wake() writes when the session is
        # finished (a socket closed before the thread waits leaves nothing in the epoll to wake it).
        # Both are closed by the reader thread only (close()), never under its wait.
        self._watch = select.epoll()
        self._watch.register(sock, _WATCH_ALL)
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._watch.register(self._wake, select.EPOLLIN)
        self._watch_closed = False

    # -- the role ------------------------------------------------------------

    def take(self, closed: bool, caller: bool = True) -> bool:
        """Takes the socket for this thread, unless another reads it, the
        session is `closed` or the connection ended; True when this thread
        holds it (now, or again: each take is left once). A caller's take
        turns the reader thread's epoll to the hang-up only."""
        me = threading.get_ident()
        with guarded(self._lock):
            if self.holder == me:
                self._depth += 1
                return True
            if closed or self.ended or self.holder is not None:
                return False
            self.holder = me
            self._depth = 1
            if caller and self._watching_all:
                self._watching_all = False
                self._watch_for(_WATCH_HANGUP)
        return True

    def leave(self) -> None:
        """Leaves one take of this thread's; once none is left, the socket is
        free and the reader thread watches for messages again (when this
        thread holds nothing: only that)."""
        self.leave_to(self.depth() - 1)

    def depth(self) -> int:
        """How many takes this thread holds now (0: it does not hold the socket): what leave_to() returns to."""
        return self._depth if self.holder == threading.get_ident() else 0

    def leave_to(self, depth: int) -> None:
        """Leaves this thread's takes down to `depth` (what depth() said
        before the call took any): idempotent, so a caller repeats it when
        an interrupt cuts it short, and an interrupt anywhere in take() or
        leave() leaves no take behind and releases no outer one."""
        me = threading.get_ident()
        with guarded(self._lock):
            if self.holder == me:
                if depth > 0:
                    self._depth = min(self._depth, depth)
                else:
                    self.holder = None
                    self._depth = 0
            if self.holder is None:
                if not self._watching_all:
                    self._watch_for(_WATCH_ALL)
                    self._watching_all = True
                self._lock.notify_all()

    def holds(self) -> bool:
        return self.holder == threading.get_ident()

    def _watch_for(self, mask: int) -> None:
        try:
            self._watch.modify(self._sock, mask)
        except (OSError, ValueError):
            pass  # closed: nothing left to watch

    # -- a caller's reading ----------------------------------------------------

    def read_until(self, event: Any, key: str, deadline: Optional[float]) -> str:
        """Reads and dispatches (this thread holds the socket) until `event`
        is set (the answer keyed `key`), the deadline passes, the connection
        ends or (main thread) a message that is not the answer comes first.
        Spins up to the busy-poll budget before each sleep. A signal
        handler's exception goes through (the caller's finally leaves)."""
        # The main thread of a program with other Python threads takes only its own answer (module docstring);
        # alone with the reader thread, nothing but its own answer or an unsolicited daemon error can come.
        main = threading.current_thread() is threading.main_thread()
        careful = threading.active_count() > 2 and main
        spin_until = time.monotonic() + self.busy_poll_s
        while not event.is_set():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                # One last look without waiting: an answer already here is not a timeout (behind another
                # message, for a careful main thread: YIELDED, and the reader thread dispatches it).
                if self._caller_poll.poll(0):
                    last = self.drain(event, key if careful else None, spare=main)
                    if last in (ENDED, YIELDED) and not event.is_set():
                        return last
                return ANSWERED if event.is_set() else TIMED_OUT
            if now < spin_until:
                wait_ms: int = 0
            elif deadline is None:
                wait_ms = _POLL_CAP_MS
            else:
                wait_ms = min(_POLL_CAP_MS, max(1, int((deadline - now) * 1000 + 0.999)))
            if not self._caller_poll.poll(wait_ms):
                continue
            outcome = self.drain(event, key if careful else None, deadline, main)
            if outcome in (ENDED, YIELDED):
                return outcome
            spin_until = time.monotonic() + self.busy_poll_s
        return ANSWERED

    def drain(self, until: Any = None, only: Optional[str] = None, deadline: Optional[float] = None, spare: bool = False) -> str:
        """Dispatches the messages waiting on the socket without blocking
        (this thread holds it): all of them, or up to `until` being set, or
        to the deadline. `only`: take a message only if it answers that key
        (YIELDED at the first that does not). `spare` (the main thread):
        leave a message that carries a descriptor (YIELDED): a signal handled
        as recvmsg returns would lose the descriptor with the message.
        ENDED when the connection ended, else ANSWERED (nothing more
        waiting, or `until` set)."""
        while until is None or not until.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return ANSWERED
            parsed: Optional[Any] = None
            try:
                if only is not None or spare:
                    head = self._sock.recv(MAX_MESSAGE_BYTES * 2, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                    if not head:
                        self.ended = True
                        return ENDED
                    parsed = _frames.decode(head)
                    if parsed is None:  # a bad frame: the reader thread drops it
                        return YIELDED
                    if only is not None and _frames.answer_key(parsed) != only:
                        return YIELDED
                    if spare and _frames.body_of(parsed) in self._carrying:
                        return YIELDED
                data, fds = recv_message(self._sock, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return ANSWERED
            except OSError as error:
                if not _gone(error):
                    raise
                self.ended = True
                return ENDED
            except ValueError:  # the socket object was closed under this reader
                self.ended = True
                return ENDED
            if not data:
                for fd in fds:
                    close_fd(fd)
                self.ended = True
                return ENDED
            self._dispatch(data, fds, parsed)
        return ANSWERED

    # -- the reader thread ---------------------------------------------------

    def reader_loop(self, closed: Callable[[], bool]) -> None:
        """The reader thread: reads while no caller does, until the
        connection ends or `closed()` (checked under the lock)."""
        while True:
            with guarded(self._lock):
                while self.holder is not None and not closed():
                    self._lock.wait(STALE_CHECK_S)
                    if self.holder is not None and self._left_over(self.holder):
                        self._take_back()
                if closed() or self.ended:
                    return  # (a caller read the end: every message before it was read too)
            try:
                # Not for ever: a take the main thread left over turns this epoll to the hang-up alone.
                self._watch.poll(STALE_POLL_S)
            except (OSError, ValueError):
                return
            if closed() or not self.take(False, caller=False):
                continue  # a caller took it meanwhile (or the hang-up came while it reads): it reads
            try:
                outcome = self.drain()
            finally:
                self.leave()
            if outcome == ENDED:
                return

    def _left_over(self, holder: int) -> bool:
        """(under _lock) Whether `holder`'s take is left over: the main thread's, with no call that holds one
        on its stack (only the main thread is interrupted: any other thread's leave runs)."""
        main = threading.main_thread()
        if holder != main.ident or not self._holding:
            return False
        frame = sys._current_frames().get(holder)
        if frame is None:
            return not main.is_alive()
        while frame is not None:
            if frame.f_code in self._holding:
                return False
            frame = frame.f_back
        return True

    def _take_back(self) -> None:
        """(under _lock) Ends a left-over take: the socket is free, the reader thread watches for messages."""
        self.holder = None
        self._depth = 0
        if not self._watching_all:
            self._watch_for(_WATCH_ALL)
            self._watching_all = True
        self._lock.notify_all()

    def wake(self) -> None:
        """Wakes the reader thread's wait (the session is finished)."""
        with guarded(self._lock):
            if self._watch_closed:
                return
            try:
                os.eventfd_write(self._wake, 1)
            except OSError:
                pass

    def forget_after_fork(self, lock: threading.Condition) -> None:
        """In a forked child: the session's new lock, and this process's copies of the epoll and eventfd closed."""
        self._lock = lock
        self.holder = None
        self._depth = 0
        self.close()

    def close(self) -> None:
        """The reader thread's epoll and eventfd: closed by the reader thread as it ends."""
        with guarded(self._lock):
            if self._watch_closed:
                return
            self._watch_closed = True
            for close in (self._watch.close, lambda: os.close(self._wake)):
                try:
                    close()
                except OSError:
                    pass


def close_fd(fd: int) -> None:
    """Closes a descriptor, if any (-1: none); one already closed is no error."""
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
