"""The client's side of the session socket (docs/PROTOCOL.md): the greeting
with the session token, the inbox of descriptors the daemon sent by transfer
id, descriptors sent to the daemon, and the requests on the socket (allocate,
release, share, export, open, ping)."""
from __future__ import annotations

import contextlib
import json
import math
import operator
import os
import select
import socket
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

from ._reading import ENDED, MAX_MESSAGE_BYTES, YIELDED, SocketReading, answer_key, recv_message
from ._declared import DEFAULT_BUSY_POLL_US, DEFAULT_TRANSFER_WAIT_MS
from ._reading import close_fd as _close
from .errors import STATUS, VmmdError

PROTOCOL_VERSION = 1
# A descriptor the daemon sent and nobody claimed is closed after this long.
UNCLAIMED_TRANSFER_S = 30.0
# release_many keeps at most this many requests unanswered: the daemon's socket buffer holds a few hundred
# answers, and one the client's socket cannot take is dropped (SESSION_SOCKET_FULL).
RELEASE_WINDOW = 64
# A main thread that leaves the socket to the reader thread at its deadline waits this much longer for it.
YIELD_GRACE_S = 0.005
# How long a caller spins for its answer before it sleeps in poll (DEFAULT_BUSY_POLL_US, as the
# TypeScript client: common/busy-poll.ts): a sleeping thread's wake-up is slow on a virtual machine.

# Answers to request messages, and those that carry a descriptor.
_ANSWERS = ("allocated", "released", "shared", "exported", "opened")
_WITH_DESCRIPTOR = ("allocated", "exported", "opened")


# Open sessions, for the fork hook below.
_SESSIONS: "weakref.WeakSet[ClientSession]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for session in list(_SESSIONS):
        session._forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


# How long a send with no timeout of its own (send_descriptor) waits for the daemon to read.
SEND_WAIT_S = 30.0


def _deadline(timeout: Optional[float]) -> Optional[float]:
    """The monotonic deadline of a wait of `timeout` seconds; None (no limit) for None or +inf.
    Raises VmmdError INVALID_ARGUMENT BAD_TIMEOUT for NaN."""
    if timeout is None or timeout == math.inf:
        return None
    if timeout != timeout:
        raise VmmdError("BAD_TIMEOUT", STATUS["INVALID_ARGUMENT"], "timeout nan is not a number of seconds")
    return time.monotonic() + timeout


def _left(deadline: Optional[float]) -> Optional[float]:
    """Seconds until `deadline` (0 once passed); None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def busy_poll_budget(option: Optional[int] = None, env: Optional[str] = None) -> int:
    """The busy-poll budget in microseconds: the option, else
    VMMD_CLIENT_BUSY_POLL_US, else DEFAULT_BUSY_POLL_US (0: never spin).
    Raises VmmdError INVALID_ARGUMENT BAD_OPTION naming the value and the rule."""
    if env is None:
        env = os.environ.get("VMMD_CLIENT_BUSY_POLL_US")
    if option is not None:
        value: Any = option
        source = "busy_poll_us"
    elif env is not None and env != "":
        source = "VMMD_CLIENT_BUSY_POLL_US"
        try:
            value = int(env, 10)
        except ValueError:
            value = env
    else:
        return DEFAULT_BUSY_POLL_US
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value > 10_000:
        raise VmmdError("BAD_OPTION", STATUS["INVALID_ARGUMENT"], f"{source} must be a whole number of microseconds from 0 to 10000, got {option if option is not None else env!r}")
    return value


def _u64(value: Any, what: str) -> str:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value >= 1 << 64:
        raise VmmdError("BAD_ID", STATUS["INVALID_ARGUMENT"], f"{what} {value!r} is not an integer in [0, 2^64)")
    return str(value)


def allocation_id(value: Any) -> str:
    """An allocation id as the socket spells it: any integer type (a numpy
    integer too) in [0, 2^64). Raises VmmdError INVALID_ARGUMENT BAD_ID."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else value
    except TypeError:
        number = value
    return _u64(number, "allocation")


class _Pending:
    """One answer awaited by a caller (an allocate request, a ping)."""

    __slots__ = ("event", "message", "fd", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.message: Optional[Dict[str, Any]] = None
        self.fd = -1
        self.error: Optional[VmmdError] = None


class ClientSession:
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

    def __init__(self, sock: socket.socket, hello: Dict[str, Any], busy_poll_us: int = DEFAULT_BUSY_POLL_US) -> None:
        self._sock = sock
        self.id: str = str(hello["session"])
        self.token: str = str(hello["token"])
        self.pid: int = int(hello.get("pid", 0))
        # The daemon's backend ("host", "cuda") when its hello names it (daemons before it do not).
        backend = hello.get("backend")
        self.backend: Optional[str] = backend if isinstance(backend, str) and backend != "" else None
        self.on_daemon_error: List[Callable[[Dict[str, Any]], None]] = []
        self.on_close: List[Callable[[], None]] = []
        self._lock = threading.Condition()
        # Invariant: every fd in _inbox is owned by the session until claimed or expired.
        self._inbox: Dict[str, Tuple[int, float]] = {}
        self._requests: Dict[str, _Pending] = {}
        self._send_lock = threading.Lock()
        self._next_transfer = 1
        self._next_request = 1
        self._closed = False
        self._closing = False
        # Set in a child forked while this session was open: the socket is its parent's (see _check_process).
        self._forked = False
        self._pid = os.getpid()
        self._reading = SocketReading(sock, self._lock, self._dispatch, _ANSWERS, busy_poll_us)
        self._reader = threading.Thread(target=self._read_loop, name=f"vmmd-session-{self.id}", daemon=True)
        self._reader.start()
        _SESSIONS.add(self)

    @classmethod
    def open(cls, path: str, timeout: float = 5.0, busy_poll_us: int = DEFAULT_BUSY_POLL_US) -> "ClientSession":
        """Connects and waits for the daemon's greeting. busy_poll_us: how long
        a caller spins for its answer before it sleeps (busy_poll_budget()).

        Raises VmmdError UNAVAILABLE DAEMON_UNREACHABLE, DEADLINE_EXCEEDED NO_GREETING,
        PERMISSION_DENIED (the daemon refused the session), UNAVAILABLE BAD_GREETING."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
        except OSError as error:
            sock.close()
            raise VmmdError("DAEMON_UNREACHABLE", STATUS["UNAVAILABLE"], f"cannot reach vmmd at {path}: {error.strerror or error}") from None
        sock.settimeout(timeout)
        try:
            data, fds = recv_message(sock)
        except socket.timeout:
            sock.close()
            raise VmmdError("NO_GREETING", STATUS["DEADLINE_EXCEEDED"], f"vmmd at {path} sent no greeting within {timeout} s") from None
        except OSError as error:
            sock.close()
            raise VmmdError("DAEMON_UNREACHABLE", STATUS["UNAVAILABLE"], f"vmmd at {path}: {error}") from None
        for fd in fds:
            os.close(fd)
        if not data:
            sock.close()
            raise VmmdError("DAEMON_UNREACHABLE", STATUS["UNAVAILABLE"], f"vmmd at {path} closed the session socket")
        try:
            hello = json.loads(data.decode("utf-8"))
        except ValueError:
            hello = None
        if isinstance(hello, dict) and hello.get("type") == "error":
            sock.close()
            raise VmmdError(str(hello.get("code")), STATUS["PERMISSION_DENIED"], f"vmmd refused the session: {hello.get('message')}")
        if not isinstance(hello, dict) or hello.get("type") != "hello" or hello.get("protocol") != PROTOCOL_VERSION:
            sock.close()
            raise VmmdError("BAD_GREETING", STATUS["UNAVAILABLE"], f"vmmd at {path} greeted with an unexpected message")
        sock.settimeout(None)
        return cls(sock, hello, busy_poll_us)

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        return self._sock.fileno()

    # -- descriptors -------------------------------------------------------

    def take_transfer(self, transfer: str | int, timeout: float = DEFAULT_TRANSFER_WAIT_MS / 1000) -> int:
        """The descriptor the daemon sent as `transfer`; the caller owns it.

        Raises VmmdError DEADLINE_EXCEEDED TRANSFER_NOT_RECEIVED, UNAVAILABLE SESSION_LOST, FAILED_PRECONDITION FORKED."""
        self._check_process()
        key = str(transfer)
        deadline = _deadline(timeout)
        with self._lock:
            while True:
                held = self._inbox.pop(key, None)
                if held is not None:
                    return held[0]
                if self._closed:
                    raise self._lost()
                left = _left(deadline)
                if left == 0:
                    raise VmmdError("TRANSFER_NOT_RECEIVED", STATUS["DEADLINE_EXCEEDED"], f"descriptor {key} did not arrive within {timeout} s")
                self._lock.wait(left)

    def pending_transfers(self) -> List[str]:
        """Transfer ids received and not claimed yet."""
        with self._lock:
            return list(self._inbox)

    def send_descriptor(self, fd: int) -> str:
        """Sends a descriptor (the caller keeps its own) and returns its
        transfer id, to be named in an Import, Attach or OpenStaging call.
        Ids are picked and sent under one lock, so they rise in sending order.

        Raises VmmdError UNAVAILABLE SESSION_LOST."""
        deadline = time.monotonic() + SEND_WAIT_S
        with self._sending(deadline):
            transfer = str(self._next_transfer)
            self._next_transfer += 1
            self._send({"type": "transfer", "transfer": transfer}, fd, deadline)
            return transfer

    # -- requests ----------------------------------------------------------

    def allocate(self, size: int, location: Optional[Dict[str, Any]] = None, timeout: float = 30.0) -> Tuple[Dict[str, Any], int]:
        """Allocate on the session socket: a new allocation of this session
        and its descriptor (the caller owns it), in one round trip.

        Raises VmmdError as the Allocate RPC (OUT_OF_MEMORY, NOT_ALIGNED…),
        DEADLINE_EXCEEDED NO_ANSWER, UNAVAILABLE SESSION_LOST."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or size >= 1 << 64:
            raise VmmdError("BAD_SIZE", STATUS["INVALID_ARGUMENT"], f"allocation size {size!r} is not an integer in [0, 2^64)")
        message: Dict[str, Any] = {"type": "allocate", "size": str(size)}
        if location is not None:
            message["location"] = location
        pending = self._request(message, timeout, "allocate")
        assert pending.message is not None
        return pending.message, pending.fd

    def release(self, allocation: int, timeout: float = 30.0) -> Dict[str, Any]:
        """Release on the session socket, one round trip: the answer has the
        Release RPC's fields (freed, handleReferences, mappingCount).

        Raises VmmdError as the Release RPC (UNKNOWN_ALLOCATION, NOT_OWNER,
        ALREADY_RELEASED…), NO_ANSWER, SESSION_LOST."""
        pending = self._request({"type": "release", "allocation": _u64(allocation, "allocation")}, timeout, "release")
        assert pending.message is not None
        return pending.message

    def share(self, allocation: int, timeout: float = 30.0) -> str:
        """Share on the session socket: the key another session exports the allocation with."""
        pending = self._request({"type": "share", "allocation": _u64(allocation, "allocation")}, timeout, "share")
        assert pending.message is not None
        return str(pending.message["shareKey"])

    def export(self, allocation: int, share_key: str = "", timeout: float = 30.0) -> Tuple[Dict[str, Any], int]:
        """Export on the session socket: the allocation's descriptor (the caller owns it), attached to the answer.

        Raises VmmdError as the Export RPC (NOT_OWNER, BAD_SHARE_KEY, ALREADY_RELEASED…), NO_ANSWER, SESSION_LOST."""
        message: Dict[str, Any] = {"type": "export", "allocation": _u64(allocation, "allocation")}
        if share_key:
            message["shareKey"] = share_key
        pending = self._request(message, timeout, "export")
        assert pending.message is not None
        return pending.message, pending.fd

    def open_store(self, store: Dict[str, Any], writable: bool = False, timeout: float = 30.0) -> Tuple[Dict[str, Any], int]:
        """Open a store on the session socket: {"store": Store's JSON fields,
        "granularity", "mappedSize"} and its descriptor (the caller owns it).

        Raises VmmdError as Stores.Open (UNKNOWN_STORE, STORE_DETACHED, STORE_READ_ONLY…), NO_ANSWER, SESSION_LOST."""
        ref: Dict[str, Any] = {}
        if "id" in store:
            ref["id"] = _u64(store["id"], "store id")
        if "name" in store:
            ref["name"] = str(store["name"])
        pending = self._request({"type": "open", "store": ref, "writable": bool(writable)}, timeout, "open")
        assert pending.message is not None
        return pending.message, pending.fd

    def ping(self, timeout: float = 5.0) -> float:
        """One round trip on the session socket; returns its seconds."""
        start = time.perf_counter()
        self._request({"type": "ping"}, timeout, "ping", key="nonce")
        return time.perf_counter() - start

    def release_many(self, allocations: List[int], timeout: Optional[float] = 30.0) -> List[Union[Dict[str, Any], VmmdError]]:
        """Releases several allocations in one round trip: every request is
        sent before any answer is waited for. Returns, in order, each answer
        (as release()'s) or the VmmdError that refused it; a refusal does not
        stop the others. Raises VmmdError BAD_ID (nothing sent) for an id that
        is not a uint64, and NO_ANSWER (`timeout` seconds for them all; None:
        no limit) or SESSION_LOST, after waiting for the requests already
        sent, when the session fails."""
        ids = [allocation_id(allocation) for allocation in allocations]
        self._check_process()
        deadline = _deadline(None if timeout is None else float(timeout))
        sent: List[Tuple[str, _Pending]] = []
        registered: List[Tuple[str, _Pending]] = []
        tail: List[VmmdError] = []
        failure: Optional[VmmdError] = None
        results: List[Union[Dict[str, Any], VmmdError]] = []

        def collect(request: str, pending: _Pending) -> None:
            nonlocal failure
            try:
                self._await(request, pending, _left(deadline), "release", limit=timeout)
                assert pending.message is not None
                results.append(pending.message)
            except VmmdError as error:
                if error.code in ("NO_ANSWER", "SESSION_LOST"):
                    failure = failure or error
                results.append(error)

        held = self._reading.depth()
        try:
            self._reading.take(self._closed)  # as _request: before the first release goes
            for index, allocation in enumerate(ids):
                # At most RELEASE_WINDOW unanswered: the daemon drops answers a full socket cannot take.
                if len(sent) - len(results) >= RELEASE_WINDOW:
                    collect(*sent[len(results)])
                if deadline is not None and time.monotonic() >= deadline:
                    # Past the deadline nothing more is sent: the rest are not released.
                    unsent = VmmdError("NO_ANSWER", STATUS["DEADLINE_EXCEEDED"], f"release_many: {len(ids) - index} release(s) not sent: the {timeout} s deadline passed")
                    failure = failure or unsent
                    tail = [unsent] * (len(ids) - index)
                    break
                try:
                    sent.append(self._send_request({"type": "release", "allocation": allocation}, "request", registered, deadline))
                except VmmdError as error:
                    failure = failure or error
                    break
            for request, pending in sent[len(results):]:
                collect(request, pending)
            results.extend(tail)
        except BaseException:
            self._reading.leave_to(held)
            self._abandon_all(registered)
            raise
        finally:
            self._reading.leave_to(held)
        if failure is not None:
            raise failure
        return results

    def _request(self, message: Dict[str, Any], timeout: float, what: str, key: str = "request") -> _Pending:
        self._check_process()  # before the take: a forked child's take would turn its parent's epoll
        sent: List[Tuple[str, _Pending]] = []
        held = self._reading.depth()
        try:
            try:
                # The socket is taken before the request goes: its answer cannot reach the reader thread first.
                self._reading.take(self._closed)
                deadline = _deadline(timeout)
                request, pending = self._send_request(message, key, sent, deadline)
                self._await(request, pending, _left(deadline), what, key, limit=timeout)
            finally:
                self._reading.leave_to(held)
        except BaseException:
            # Cut short anywhere (an interrupt in the leave too): the socket left, the request forgotten.
            self._reading.leave_to(held)
            self._abandon_all(sent)
            raise
        return pending

    def _send_request(self, message: Dict[str, Any], key: str = "request", sent: Optional[List[Tuple[str, _Pending]]] = None, deadline: Optional[float] = None) -> Tuple[str, _Pending]:
        """Sends a request under a new id, registered for its answer: (the id,
        its pending answer). `sent` gets (its key, the pending answer) before
        the registration: a caller cut short anywhere after it can forget it.
        The send waits for room in the socket until `deadline` (_send)."""
        pending = _Pending()
        with self._sending(deadline):
            request = str(self._next_request)
            self._next_request += 1
            message[key] = request
            if sent is not None:
                sent.append((f"{key}:{request}", pending))
            with self._lock:
                if self._closed:
                    raise self._lost()
                self._requests[f"{key}:{request}"] = pending
            try:
                self._send(message, deadline=deadline)
            except VmmdError:
                with self._lock:
                    self._requests.pop(f"{key}:{request}", None)
                raise
        return request, pending

    def _abandon_all(self, sent: List[Tuple[str, _Pending]]) -> None:
        """Forgets every request of a call cut short (an interrupt, a failure) that is not answered and taken."""
        for key, pending in sent:
            self._abandon(key, pending)

    def _await(self, request: str, pending: _Pending, timeout: Optional[float], what: str, key: str = "request", limit: Optional[float] = None) -> None:
        """Waits for a sent request's answer, reading the socket on this
        thread when no other reads it (a take the caller leaves); raises its
        refusal, SESSION_LOST, or NO_ANSWER after `timeout` seconds (None or
        infinite: no limit; `limit`: the caller's, when this wait had only
        what was left of it). A wait cut short (an interrupt) forgets the
        request and closes a descriptor that came for it."""
        deadline = _deadline(timeout)
        try:
            grace = 0.0
            if not pending.event.is_set() and (self._reading.holds() or self._reading.take(self._closed)):
                outcome = self._reading.read_until(pending.event, f"{key}:{request}", deadline)
                if outcome == ENDED and not pending.event.is_set():
                    raise self._lost()
                if outcome == YIELDED:
                    # (main thread) another message came first: the reader thread reads on, and an answer
                    # already here behind it is not a timeout (it has YIELD_GRACE_S to dispatch it).
                    self._reading.leave()
                    grace = YIELD_GRACE_S
            if not pending.event.is_set():
                left = _left(deadline)
                pending.event.wait(None if left is None else max(grace, left))
            if not pending.event.is_set():
                raise VmmdError("NO_ANSWER", STATUS["DEADLINE_EXCEEDED"], f"the daemon did not answer {what} request {request} within {timeout if limit is None else limit} s")
        except BaseException:
            self._abandon(f"{key}:{request}", pending)
            raise
        if pending.error is not None:
            raise pending.error

    def _abandon(self, key: str, pending: _Pending) -> None:
        """Forgets a request its caller gave up on: an answer that comes later is dropped, a descriptor already here closed."""
        with self._lock:
            self._requests.pop(key, None)
            fd, pending.fd = pending.fd, -1
        _close(fd)

    # -- lifetime ----------------------------------------------------------

    def close(self) -> None:
        """Ends the session: the daemon reclaims everything it owns. In a
        child forked from the process that opened it, only drops the child's
        copy of the socket: the session is the parent's."""
        if self._forked:
            # This process's copies only: the socket, the reader thread's epoll and eventfd, unclaimed descriptors.
            self._closing = self._closed = True
            with self._lock:
                inbox = [fd for fd, _ in self._inbox.values()]
                self._inbox.clear()
            for fd in inbox:
                _close(fd)
            self._sock.close()
            self._reading.close()
            return
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        # The reader thread ends once no caller reads: not waited for from itself, nor from a caller that
        # reads (an on_daemon_error callback), whose reading then ends on the closed socket.
        if threading.current_thread() is not self._reader and not self._reading.holds():
            self._reader.join(5)
        self._finish()

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

    def _lost(self) -> VmmdError:
        return VmmdError("SESSION_LOST", STATUS["UNAVAILABLE"], f"session {self.id} with vmmd is closed")

    @contextlib.contextmanager
    def _sending(self, deadline: Optional[float]) -> Iterator[None]:
        """Holds the send lock, taken by `deadline` (None: no limit): a sender
        waiting for room holds it, and a call behind it keeps its own timeout.
        Raises VmmdError UNAVAILABLE SESSION_SOCKET_FULL at the deadline."""
        left = _left(deadline)
        if not self._send_lock.acquire(timeout=-1.0 if left is None else left):
            raise VmmdError("SESSION_SOCKET_FULL", STATUS["UNAVAILABLE"], "the session socket is full: another call of this process is still waiting for the daemon to read; nothing was sent")
        try:
            yield
        finally:
            self._send_lock.release()

    def _send(self, message: Dict[str, Any], fd: int = -1, deadline: Optional[float] = None) -> None:
        """Sends one message (and a descriptor), waiting for room in the socket
        until `deadline` (monotonic; None: no limit): a daemon that stops
        reading fills it. Raises VmmdError UNAVAILABLE SESSION_SOCKET_FULL at
        the deadline (nothing sent; the session stays), SESSION_LOST."""
        self._check_process()
        if self._closed:
            raise self._lost()
        data = json.dumps(message, separators=(",", ":")).encode("utf-8")
        started = time.monotonic()
        while True:
            try:
                # A SEQPACKET message goes whole or not at all.
                if fd >= 0:
                    socket.send_fds(self._sock, [data], [fd], socket.MSG_DONTWAIT)
                else:
                    self._sock.send(data, socket.MSG_DONTWAIT)
                return
            except BlockingIOError:
                pass
            except OSError as error:
                raise VmmdError("SESSION_LOST", STATUS["UNAVAILABLE"], f"the session socket failed: {error}") from None
            left = _left(deadline)
            if left == 0:
                raise VmmdError("SESSION_SOCKET_FULL", STATUS["UNAVAILABLE"], f"the session socket is full: the daemon has not read for {time.monotonic() - started:.3f} s; nothing was sent")
            if self._closed:
                raise self._lost()
            # Until there is room, the deadline, or a second (to look at the session again).
            try:
                poller = select.poll()
                poller.register(self._sock.fileno(), select.POLLOUT)
                poller.poll(1000 if left is None else max(1, min(1000, math.ceil(left * 1000))))
            except (ValueError, OSError):
                # The session closed meanwhile (its socket's descriptor is gone).
                raise self._lost() from None

    def _read_loop(self) -> None:
        """The reader thread: reads while no caller does, until the connection ends; then finishes the session."""
        try:
            self._reading.reader_loop(lambda: self._closed)
        finally:
            try:
                self._finish()
            finally:
                self._reading.close()

    def _dispatch(self, data: bytes, fds: List[int], parsed: Optional[Dict[str, Any]] = None) -> None:
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

    def _dispatch_one(self, data: bytes, fd: int, parsed: Optional[Dict[str, Any]]) -> int:
        """_dispatch's work; returns the descriptor if it is still the caller's to close, else -1."""
        message: Any = parsed
        if message is None:
            try:
                message = json.loads(data.decode("utf-8"))
            except Exception:  # ValueError, UnicodeDecodeError, RecursionError: a bad message is dropped
                message = None
        if not isinstance(message, dict):
            return fd
        kind = message.get("type")
        now = time.monotonic()
        key = answer_key(message, _ANSWERS)
        with self._lock:
            self._expire(now)
            if kind == "transfer" and fd >= 0 and isinstance(message.get("transfer"), str):
                old = self._inbox.pop(message["transfer"], None)
                if old is not None:
                    _close(old[0])
                self._inbox[message["transfer"]] = (fd, now)
                self._lock.notify_all()
                return -1
            pending = self._requests.get(key) if key is not None else None
            if pending is not None:
                # Answered, then forgotten: a caller is never left unregistered and unanswered.
                if kind in _WITH_DESCRIPTOR and fd >= 0:
                    pending.message, pending.fd = message, fd
                    fd = -1
                elif kind == "error":
                    status = message.get("status")
                    status = status if isinstance(status, int) and not isinstance(status, bool) and 0 <= status <= 16 else STATUS["UNKNOWN"]
                    pending.error = VmmdError(str(message.get("code")), status, str(message.get("message")))
                elif kind in _WITH_DESCRIPTOR:
                    pending.error = VmmdError("BAD_ANSWER", STATUS["INTERNAL"], f"the daemon's answer ({kind}) to request {message.get('request')} carried no descriptor")
                else:
                    pending.message = message
                pending.event.set()
                del self._requests[key]  # type: ignore[arg-type]
        if pending is None and kind == "error":
            for callback in list(self.on_daemon_error):
                try:
                    callback(message)
                except Exception as error:  # a callback's failure is its own: the reading goes on
                    warnings.warn(f"vmmd: an on_daemon_error callback failed: {error!r}", RuntimeWarning, stacklevel=2)
        return fd

    def _expire(self, now: float) -> None:
        for transfer, (fd, since) in list(self._inbox.items()):
            if now - since > UNCLAIMED_TRANSFER_S:
                del self._inbox[transfer]
                os.close(fd)

    def _finish(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd, _ in self._inbox.values():
                os.close(fd)
            self._inbox.clear()
            requests = list(self._requests.values())
            self._requests.clear()
            self._lock.notify_all()
        for pending in requests:
            pending.error = self._lost()
            pending.event.set()
        try:
            self._sock.close()
        except OSError:
            pass
        self._reading.wake()
        if not self._closing:
            for callback in list(self.on_close):
                try:
                    callback()
                except Exception as error:  # one callback's failure stops neither the others nor the session's end
                    warnings.warn(f"vmmd: an on_close callback failed: {error!r}", RuntimeWarning, stacklevel=2)
