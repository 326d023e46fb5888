"""The client's side of the session socket (docs/PROTOCOL.md, session.proto):
the greeting with the session token, the inbox of descriptors the daemon sent
by transfer id, descriptors sent to the daemon, and the requests on the socket
(allocate, release, share, export, open, ping), which return the RPCs' own
response messages."""
from __future__ import annotations

import os
import socket
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _fork, _frames, _proto
from ._abandoned import AbandonedAnswers, Orphan, Pending, orphan_of
from ._batch import BatchedReleases
from ._greeting import greet
from ._locks import condition, guarded, mutex, surely
from ._reading import ENDED, YIELDED, SocketReading
from ._resuming import Resumable
from ._declared import DEFAULT_TRANSFER_WAIT_MS
from ._reading import close_fd as _close
from ._sending import send_message
from ._values import DEFAULT_BUSY_POLL_US, allocation_id, busy_poll_budget, deadline_of, left_until, u64
from .errors import STATUS, VmmdError

__all__ = ["ClientSession", "DEFAULT_BUSY_POLL_US", "allocation_id", "busy_poll_budget"]

# A descriptor the daemon sent and nobody claimed is closed after this long.
UNCLAIMED_TRANSFER_S = 30.0
# A main thread that leaves the socket to the reader thread at its deadline waits this much longer for it.
YIELD_GRACE_S = 0.005

_WITH_DESCRIPTOR = _frames.WITH_DESCRIPTOR

# How long a send with no timeout of its own (send_descriptor) waits for the daemon to read.
SEND_WAIT_S = 30.0


_PING = _proto.message("Ping")()


def _release_request(allocation: int) -> Any:
    return _proto.message("ReleaseRequest")(allocation_id=int(u64(allocation, "allocation")))


def _SOCKET_BUSY() -> VmmdError:
    return VmmdError("SESSION_SOCKET_FULL", STATUS["UNAVAILABLE"], "the session socket is full: another call of this process is still waiting for the daemon to read; nothing was sent")


class ClientSession(AbandonedAnswers, BatchedReleases, Resumable):
    """One session: the lease on everything this process creates through vmmd.

    Every message the daemon sends is dispatched in order: descriptors go to
    the inbox (keyed by transfer id) until take_transfer() claims them,
    answers wake their callers, and error messages go to the
    `on_daemon_error` callbacks. The connection closing (the daemon stopped)
    fails everything waiting with SESSION_LOST.

    Who reads (vmmd/_reading.py): a caller waiting for its answer reads the
    socket on its own thread, spinning up to `busy_poll_us` before it sleeps;
    the reader thread reads while no caller does. `on_daemon_error` callbacks
    therefore run on whichever thread reads: a caller's (the main thread's
    only while no other Python thread runs: else it takes only its own
    answer) or the reader thread.
    """

    def __init__(self, sock: socket.socket, hello: Any, busy_poll_us: int = DEFAULT_BUSY_POLL_US, path: str = "", resume_wait_s: float = 0.0) -> None:
        self.id: str = str(hello.session)
        # Under a daemon that parks its sessions: the secret that resumes this one after a restart (_resuming.py).
        self.resume_token: Optional[str] = hello.resume_token or None
        self._path, self._resume_wait_s = path, resume_wait_s
        # Invariant: _generation counts the connections this session has had past its first; _resuming is set
        # while it has none and tries to come back (both under _lock). _stop_resuming is set by close().
        self._generation, self._resuming, self._stop_resuming = 0, False, threading.Event()
        self._why_lost: Optional[VmmdError] = None
        self.token: str = str(hello.token)
        self.pid: int = int(hello.pid)
        # What the daemon can do (session.proto's Capability names): asked, instead of a backend's name.
        self.capabilities: frozenset = frozenset(_proto.enum_name("Capability", number) for number in hello.capabilities)
        # Callbacks get the daemon's SessionError (code, message, status).
        self.on_daemon_error: List[Callable[[Any], None]] = []
        self.on_close: List[Callable[[], None]] = []
        # Both locks are taken through guarded() only: an interrupt anywhere leaves them free.
        self._lock = condition()
        # Invariant: every fd in _inbox is owned by the session until claimed or expired.
        self._inbox: Dict[str, Tuple[int, float]] = {}
        # Invariant: every request sent and not answered yet, awaited or abandoned (its answer released on arrival).
        self._requests: Dict[str, Pending] = {}
        # What answers of abandoned requests made (allocations, opens of stores): undone with the session's next send.
        self._orphans: List[Orphan] = []
        self._send_lock = mutex()
        self._next_transfer = 1
        self._next_request = 1
        self._closed = False
        self._closing = False
        # Set in a child forked while this session was open: the socket is its parent's (see _check_process).
        self._forked = False
        self._pid = os.getpid()
        self._busy_poll_us = busy_poll_us
        self._start_reading(sock)
        _fork.track(self)

    def _start_reading(self, sock: socket.socket) -> None:
        """The connection the session is served on, and its reader thread."""
        self._sock = sock
        self._reading = SocketReading(sock, self._lock, self._dispatch, self._busy_poll_us, ("transfer",) + _WITH_DESCRIPTOR, _HOLDING)
        self._reader = threading.Thread(target=self._read_loop, name=f"vmmd-session-{self.id}", daemon=True)
        self._reader.start()

    @classmethod
    def open(cls, path: str, timeout: float = 5.0, busy_poll_us: int = DEFAULT_BUSY_POLL_US, resume_wait_s: float = 0.0) -> "ClientSession":
        """Connects and waits for the daemon's greeting. busy_poll_us: how long
        a caller spins for its answer before it sleeps (busy_poll_budget()).
        resume_wait_s: how long the session tries to resume after its socket
        closed under a daemon that parks sessions (0: it ends at once).

        Raises VmmdError UNAVAILABLE DAEMON_UNREACHABLE, DEADLINE_EXCEEDED NO_GREETING,
        PERMISSION_DENIED (the daemon refused the session), UNAVAILABLE BAD_GREETING."""
        sock, hello = greet(path, timeout)
        return cls(sock, hello, busy_poll_us, path, resume_wait_s)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def forked(self) -> bool:
        """This process is a child forked from the one that opened the session (whose it stays)."""
        return self._forked

    def fileno(self) -> int:
        return self._sock.fileno()

    # -- descriptors -------------------------------------------------------

    def take_transfer(self, transfer: str | int, timeout: Optional[float] = DEFAULT_TRANSFER_WAIT_MS / 1000) -> int:
        """The descriptor the daemon sent as `transfer`; the caller owns it.

        Raises VmmdError DEADLINE_EXCEEDED TRANSFER_NOT_RECEIVED, UNAVAILABLE SESSION_LOST, FAILED_PRECONDITION FORKED."""
        self._check_process()
        key = str(transfer)
        deadline = deadline_of(timeout)
        with guarded(self._lock):
            while True:
                held = self._inbox.pop(key, None)
                if held is not None:
                    return held[0]
                if self._closed:
                    raise self._lost()
                left = left_until(deadline)
                if left == 0:
                    raise VmmdError("TRANSFER_NOT_RECEIVED", STATUS["DEADLINE_EXCEEDED"], f"descriptor {key} did not arrive within {timeout} s")
                self._lock.wait(left)

    def pending_transfers(self) -> List[str]:
        """Transfer ids received and not claimed yet."""
        with guarded(self._lock):
            return list(self._inbox)

    def send_descriptor(self, fd: int, timeout: Optional[float] = SEND_WAIT_S) -> str:
        """Sends a descriptor (the caller keeps its own) and returns its
        transfer id, to be named in an Import, Attach or OpenStaging call.
        Ids are picked and sent under one lock, so they rise in sending order.

        Raises VmmdError UNAVAILABLE SESSION_LOST."""
        deadline = deadline_of(timeout)
        with self._sending(deadline):
            transfer = str(self._next_transfer)
            self._next_transfer += 1
            self._send(_frames.ClientFrame(transfer={"id": int(transfer)}), fd, deadline)
            return transfer

    # -- requests ----------------------------------------------------------

    def allocate(self, size: int, location: Any = None, timeout: Optional[float] = 30.0) -> Tuple[Any, int]:
        """Allocate on the session socket: a new allocation of this session
        and its descriptor (the caller owns it), in one round trip. `location`:
        CreateRequest's (a Location, or a dict of its fields; None: device 0).
        Returns the Allocate RPC's ExportResponse (transfer_id 0: the descriptor came with it).

        Raises VmmdError as the Allocate RPC (OUT_OF_MEMORY, NOT_ALIGNED…),
        DEADLINE_EXCEEDED NO_ANSWER, UNAVAILABLE SESSION_LOST."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or size >= 1 << 64:
            raise VmmdError("BAD_SIZE", STATUS["INVALID_ARGUMENT"], f"allocation size {size!r} is not an integer in [0, 2^64)")
        request = _proto.message("CreateRequest")(size=size, location=location)
        return self._request("allocate", request, timeout)

    def release(self, allocation: int, timeout: Optional[float] = 30.0) -> Any:
        """Release on the session socket, one round trip: the Release RPC's
        ReleaseResponse (freed, handle_references, mapping_count).

        Raises VmmdError as the Release RPC (UNKNOWN_ALLOCATION, NOT_OWNER,
        ALREADY_RELEASED…), NO_ANSWER, SESSION_LOST."""
        return self._request("release", _release_request(allocation), timeout)[0]

    def share(self, allocation: int, timeout: Optional[float] = 30.0) -> str:
        """Share on the session socket: the key another session exports the allocation with."""
        request = _proto.message("ShareRequest")(allocation_id=int(u64(allocation, "allocation")))
        return str(self._request("share", request, timeout)[0].share_key)

    def export(self, allocation: int, share_key: str = "", timeout: Optional[float] = 30.0) -> Tuple[Any, int]:
        """Export on the session socket: the Export RPC's ExportResponse and the allocation's descriptor (the caller owns it), attached to the answer.

        Raises VmmdError as the Export RPC (NOT_OWNER, BAD_SHARE_KEY, ALREADY_RELEASED…), NO_ANSWER, SESSION_LOST."""
        request = _proto.message("ExportRequest")(allocation_id=int(u64(allocation, "allocation")), share_key=share_key, handle_type="HANDLE_TYPE_POSIX_FD")
        return self._request("export", request, timeout)

    def open_store(self, store: Dict[str, Any], writable: bool = False, timeout: Optional[float] = 30.0) -> Tuple[Any, int]:
        """Open a store on the session socket: Stores.Open's OpenResponse and
        its descriptor (the caller owns it). `store`: {"id": …} or {"name": …}.

        Raises VmmdError as Stores.Open (UNKNOWN_STORE, STORE_DETACHED, STORE_READ_ONLY…), NO_ANSWER, SESSION_LOST."""
        ref: Dict[str, Any] = {}
        if "id" in store:
            ref["id"] = int(u64(store["id"], "store id"))
        if "name" in store:
            ref["name"] = str(store["name"])
        return self._request("open", _proto.message("OpenRequest")(store=ref, writable=bool(writable)), timeout)

    def ping(self, timeout: Optional[float] = 5.0) -> float:
        """One round trip on the session socket; returns its seconds."""
        start = time.perf_counter()
        self._request("ping", _PING, timeout)
        return time.perf_counter() - start

    def _request(self, what: str, body: Any, timeout: Optional[float]) -> Tuple[Any, int]:
        """Sends a request frame and returns its answer (Pending.take()); one the daemon's restart cut off goes again once the
        session is resumed: an allocate under the same id with `again` set (the daemon answers with the
        allocation it made before it went, if it did), anything else under a new id."""
        deadline = deadline_of(timeout)
        ids: List[str] = []
        again: Optional[str] = None
        while True:
            generation = self._generation
            try:
                return self._request_once(what, body, left_until(deadline), timeout, ids, again)
            except VmmdError as error:
                if ids and what == "release" and again is not None and (before := self._released_before(error.code)) is not None:
                    return before.take()
                if error.code != "SESSION_RESUMING" or not self._wait_resumed(generation, deadline):
                    raise (self._lost() if self._closed else error) from None
                again = ids[-1] if ids and what == "allocate" else ""

    def _request_once(self, what: str, body: Any, timeout: Optional[float], limit: Optional[float], ids: List[str], again: Optional[str]) -> Tuple[Any, int]:
        self._check_process()  # before the take: a forked child's take would turn its parent's epoll
        self._release_orphans()
        sent: List[Tuple[str, Pending]] = []
        reading = self._reading
        held = reading.depth()
        try:
            try:
                # The socket is taken before the request goes: its answer cannot reach the reader thread first.
                reading.take(self._closed)
                deadline = deadline_of(timeout)
                request, pending = self._send_request(what, body, sent, deadline, again or None)
                ids.append(request)
                self._await(request, pending, left_until(deadline), what, limit=limit, reading=reading)
            finally:
                reading.leave_to(held)
            # Taken here: cut short before the hand-over, the answer is still the record's, released below.
            answer = pending.take()
        except BaseException:
            # Cut short anywhere (an interrupt in the leave too, or in this clean-up: surely runs it again):
            # the socket left, the request forgotten.
            surely(lambda: reading.leave_to(held))
            surely(lambda: self._abandon_all(sent))
            raise
        return answer

    def _send_request(self, what: str, body: Any, sent: Optional[List[Tuple[str, Pending]]] = None, deadline: Optional[float] = None, again: Optional[str] = None) -> Tuple[str, Pending]:
        """Sends a request frame whose body `what` is `body` under a new id (`again`: under that id, sent
        before, with the frame's `again` set), registered for its answer: (the id, its pending answer). `sent`
        gets (its key, the pending answer) before the registration: a caller cut short anywhere after it can
        forget it. The send waits for room in the socket until `deadline` (_send)."""
        pending = Pending(self._orphans)
        key = "request"
        with self._sending(deadline):
            request = again if again is not None else str(self._next_request)
            self._next_request += 0 if again is not None else 1
            frame = _frames.ClientFrame(request=int(request), again=again is not None, **{what: body})
            if sent is not None:
                sent.append((f"{key}:{request}", pending))
            with guarded(self._lock):
                if self._closed:
                    raise self._lost()
                self._requests[f"{key}:{request}"] = pending
            stage = ["waiting"]
            try:
                self._send(frame, deadline=deadline, stage=stage)
            except BaseException as error:
                # Not sent (refused, or cut short while waiting for room): forgotten. Perhaps sent (an interrupt
                # right after the send): the caller abandons it, and its answer is released when it comes.
                if isinstance(error, VmmdError) or stage[0] == "waiting":
                    with guarded(self._lock):
                        self._requests.pop(f"{key}:{request}", None)
                raise
        return request, pending

    def _await(self, request: str, pending: Pending, timeout: Optional[float], what: str, limit: Optional[float] = None, reading: Optional[SocketReading] = None) -> None:
        """Waits for a sent request's answer, reading the socket on this
        thread when no other reads it (a take the caller leaves); raises its
        refusal, SESSION_LOST, or NO_ANSWER after `timeout` seconds (None or
        infinite: no limit; `limit`: the caller's, when this wait had only
        what was left of it). A wait cut short (an interrupt) forgets the
        request and closes a descriptor that came for it."""
        deadline = deadline_of(timeout)
        key = "request"
        reading = self._reading if reading is None else reading
        try:
            grace = 0.0
            if not pending.event.is_set() and (reading.holds() or reading.take(self._closed)):
                outcome = reading.read_until(pending.event, f"{key}:{request}", deadline)
                if outcome == ENDED and not pending.event.is_set():
                    raise self._lost()
                if outcome == YIELDED:
                    # (main thread) another message came first: the reader thread reads on, and an answer
                    # already here behind it is not a timeout (it has YIELD_GRACE_S to dispatch it).
                    reading.leave()
                    grace = YIELD_GRACE_S
            if not pending.event.is_set():
                left = left_until(deadline)
                pending.event.wait(None if left is None else max(grace, left))
            if not pending.event.is_set():
                raise VmmdError("NO_ANSWER", STATUS["DEADLINE_EXCEEDED"], f"the daemon did not answer {what} request {request} within {timeout if limit is None else limit} s")
        except BaseException:
            self._abandon(f"{key}:{request}", pending)
            raise
        if pending.error is not None:
            raise pending.error

    # -- lifetime ----------------------------------------------------------

    def close(self) -> None:
        """Ends the session: the daemon reclaims everything it owns. In a
        child forked from the process that opened it, only drops the child's
        copy of the socket: the session is the parent's."""
        if self._forked:
            return  # this process's copies were dropped at the fork (forget_after_fork)
        self._closing = True
        self._stop_resuming.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        # The reader thread ends once no caller reads: not waited for from itself, nor from a caller that
        # reads (an on_daemon_error callback), whose reading then ends on the closed socket.
        if threading.current_thread() is not self._reader and not self._reading.holds():
            self._reader.join(5)
        self._finish()

    def forget_after_fork(self) -> None:
        """In a child forked while this session was open (the at-fork hook,
        before the child runs anything): drops this process's copies of the
        parent's session, so that the daemon ends it when the parent closes or
        exits: the socket, the reader thread's epoll and eventfd (no reader
        thread runs here), unclaimed descriptors. Its locks are made anew: a
        parent thread may have held them at the fork."""
        self._forked = True
        self._lock = condition()
        self._send_lock = mutex()
        self._reading.forget_after_fork(self._lock)
        fds = [fd for fd, _ in self._inbox.values()] + [pending.fd for pending in self._requests.values()]
        self._inbox.clear()
        self._requests.clear()
        self._orphans.clear()
        for fd in fds:
            _close(fd)
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> "ClientSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ---------------------------------------------------------

    def _check_process(self) -> None:
        """Refuses a forked child: its requests would take the parent's answers off the shared socket.
        Raises VmmdError FAILED_PRECONDITION FORKED."""
        if self._forked:
            raise VmmdError("FORKED", STATUS["FAILED_PRECONDITION"], f"session {self.id} belongs to process {self._pid}, which forked this one; connect() here for a session of this process's own")


    def _sending(self, deadline: Optional[float]) -> guarded:
        """Holds the send lock, taken by `deadline` (None: no limit): a sender
        waiting for room holds it, and a call behind it keeps its own timeout.
        Raises VmmdError UNAVAILABLE SESSION_SOCKET_FULL at the deadline."""
        return guarded(self._send_lock, left_until(deadline), _SOCKET_BUSY)

    def _send(self, frame: Any, fd: int = -1, deadline: Optional[float] = None, stage: Optional[List[str]] = None) -> None:
        """Sends one ClientFrame (and a descriptor), waiting for room in the socket
        until `deadline` (monotonic; None: no limit): a daemon that stops
        reading fills it. Raises VmmdError UNAVAILABLE SESSION_SOCKET_FULL at
        the deadline (nothing sent; the session stays), SESSION_LOST.
        `stage[0]`: "sending" from each send on, "waiting" once it found no room."""
        self._check_process()
        if self._closed:
            raise self._lost()
        try:
            send_message(self._sock, frame.SerializeToString(), fd, deadline, stage, lambda: self._closed, self._lost)
        except VmmdError as error:
            # The daemon went away under the send: the session may come back (SESSION_RESUMING).
            raise (self._lost() if error.code == "SESSION_LOST" else error) from None

    def _read_loop(self) -> None:
        """The reader thread: reads while no caller does, until the connection ends; then finishes the session."""
        reading = self._reading
        try:
            reading.reader_loop(lambda: self._closed)
        finally:
            try:
                if not self._resume():
                    self._finish()
            finally:
                reading.close()

    def _dispatch(self, data: bytes, fds: List[int], parsed: Optional[Any] = None) -> None:
        """Takes one message and its descriptors (owned from here: each is
        handed on or closed); never raises for what the daemon sent, nor for
        a callback's error. `parsed`: the message, when the reading parsed it."""
        # At most one descriptor per message; extras are closed.
        fd = fds[0] if fds else -1
        for extra in fds[1:]:
            _close(extra)
        try:
            fd = self._dispatch_one(data, fd, parsed)
        except Exception as error:  # a message malformed past what _dispatch_one checks (it raises only before it hands fd on)
            warnings.warn(f"vmmd: a message from the daemon could not be taken: {error!r}", RuntimeWarning, stacklevel=2)
        finally:
            # Still ours unless handed on (a callback's KeyboardInterrupt too: callbacks get no descriptor).
            _close(fd)

    def _dispatch_one(self, data: bytes, fd: int, parsed: Optional[Any]) -> int:
        """_dispatch's work; returns the descriptor if it is still the caller's to close, else -1."""
        frame = parsed if parsed is not None else _frames.decode(data)
        if frame is None:  # not a DaemonFrame: dropped
            return fd
        kind = frame.WhichOneof("body")
        now = time.monotonic()
        key = _frames.answer_key(frame)
        orphaned = False
        with guarded(self._lock):
            self._expire(now)
            if kind == "transfer" and fd >= 0 and frame.transfer.id:
                transfer = str(frame.transfer.id)
                old = self._inbox.pop(transfer, None)
                if old is not None:
                    _close(old[0])
                self._inbox[transfer] = (fd, now)
                self._lock.notify_all()
                return -1
            pending = self._requests.get(key) if key is not None else None
            if pending is not None and pending.abandoned:
                # Nobody awaits it: what it made is released (its descriptor by _dispatch, its allocation below).
                del self._requests[key]  # type: ignore[arg-type]
                orphan = orphan_of(frame)
                if orphan is not None:
                    self._orphans.append(orphan)
                orphaned = True
            elif pending is not None:
                # Answered, then forgotten: a caller is never left unregistered and unanswered.
                if kind in _WITH_DESCRIPTOR and fd >= 0:
                    pending.message, pending.fd = frame, fd
                    fd = -1
                elif kind == "error":
                    status = frame.error.status if 0 <= frame.error.status <= 16 else STATUS["UNKNOWN"]
                    pending.error = VmmdError(frame.error.code, status, frame.error.message)
                elif kind in _WITH_DESCRIPTOR:
                    pending.error = VmmdError("BAD_ANSWER", STATUS["INTERNAL"], f"the daemon's answer ({kind}) to request {frame.request} carried no descriptor")
                else:
                    pending.message = frame
                pending.event.set()
                del self._requests[key]  # type: ignore[arg-type]
        if orphaned:
            self._release_orphans()
            return fd
        if pending is None and kind == "error":
            for callback in list(self.on_daemon_error):
                try:
                    callback(frame.error)
                except Exception as error:  # a callback's failure is its own: the reading goes on
                    warnings.warn(f"vmmd: an on_daemon_error callback failed: {error!r}", RuntimeWarning, stacklevel=2)
        return fd

    def _expire(self, now: float) -> None:
        for transfer, (fd, since) in list(self._inbox.items()):
            if now - since > UNCLAIMED_TRANSFER_S:
                del self._inbox[transfer]
                os.close(fd)


# The functions that take the session socket and leave it before they return (_reading.py: left-over takes).
_HOLDING = (ClientSession._request_once.__code__, BatchedReleases.release_many.__code__)
