"""The client's side of the session socket (docs/PROTOCOL.md): the greeting
with the session token, the inbox of descriptors the daemon sent by transfer
id, descriptors sent to the daemon, and the requests on the socket (allocate,
release, share, export, open, ping)."""
from __future__ import annotations

import array
import json
import operator
import os
import select
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .errors import STATUS, VmmdError

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 4096
# A descriptor the daemon sent and nobody claimed is closed after this long.
UNCLAIMED_TRANSFER_S = 30.0
# A caller that could not take the socket to read its own answer (another thread reads) looks again this often;
# meanwhile whoever reads dispatches its answer too.
_RETRY_READING_S = 0.001
# How long a caller spins for its answer before it sleeps in poll (as the TypeScript client:
# common/busy-poll.ts): a sleeping thread's wake-up costs 30-70 us on the GPU VMs.
DEFAULT_BUSY_POLL_US = 200
# What the reader thread waits for: messages and the hang-up, or (while a caller reads) only the hang-up.
_WATCH_ALL = select.EPOLLIN | select.EPOLLRDHUP
_WATCH_HANGUP = select.EPOLLRDHUP


# Answers to request messages, and those that carry a descriptor.
_ANSWERS = ("allocated", "released", "shared", "exported", "opened")
_WITH_DESCRIPTOR = ("allocated", "exported", "opened")


def _recv_message(sock: socket.socket, flags: int = 0) -> Tuple[bytes, List[int]]:
    """One message and the descriptors that came with it (socket.recv_fds
    before Python 3.13 drops its `flags`: MSG_DONTWAIT would not hold).
    Descriptors are received close-on-exec, as Python opens its own (PEP 446)."""
    fds = array.array("i")
    data, ancillary, _, _ = sock.recvmsg(MAX_MESSAGE_BYTES * 2, socket.CMSG_LEN(4 * fds.itemsize), flags | socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


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

    Who reads: a caller waiting for an answer reads the socket itself, on its
    own thread, and dispatches whatever comes until its answer has (one
    caller at a time: the others wait for theirs to be dispatched, and look
    again every millisecond). The reader thread reads only while no caller
    does: descriptors and errors that come between requests, and answers
    whose callers gave up reading. A reply handed from a reader thread to the
    caller costs two thread wake-ups and a GIL hand-off (a ping took 101 us
    that way on the build VM, 44 us from TypeScript).
    """

    def __init__(self, sock: socket.socket, hello: Dict[str, Any], busy_poll_us: int = DEFAULT_BUSY_POLL_US) -> None:
        self._sock = sock
        self._busy_poll_s = busy_poll_us / 1e6
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
        # Whoever holds _recv_lock reads the socket: a caller (counted in _readers from before it tries
        # until it leaves) or the reader thread, which waits while _readers > 0.
        self._recv_lock = threading.Lock()
        self._readers = 0
        # The connection has ended (EOF or a failed read): the reader thread finishes the session.
        self._ended = False
        # Callers wait for messages on _caller_poll (one at a time: under _recv_lock). The reader thread
        # waits on _watch, which looks for messages only while no caller reads (for a hang-up always):
        # two threads woken by one answer would pass the GIL back and forth for it.
        self._caller_poll = select.poll()
        self._caller_poll.register(sock, select.POLLIN)
        self._watch = select.epoll()
        self._watch.register(sock, _WATCH_ALL)
        self._reader = threading.Thread(target=self._read_loop, name=f"vmmd-session-{self.id}", daemon=True)
        self._reader.start()

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
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES * 2, 4)
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

    def take_transfer(self, transfer: str | int, timeout: float = 5.0) -> int:
        """The descriptor the daemon sent as `transfer`; the caller owns it.

        Raises VmmdError DEADLINE_EXCEEDED TRANSFER_NOT_RECEIVED, UNAVAILABLE SESSION_LOST."""
        key = str(transfer)
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                held = self._inbox.pop(key, None)
                if held is not None:
                    return held[0]
                if self._closed:
                    raise self._lost()
                left = deadline - time.monotonic()
                if left <= 0:
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
        with self._send_lock:
            transfer = str(self._next_transfer)
            self._next_transfer += 1
            self._send({"type": "transfer", "transfer": transfer}, fd)
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
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        sent: List[Tuple[str, _Pending]] = []
        failure: Optional[VmmdError] = None
        for allocation in ids:
            try:
                sent.append(self._send_request({"type": "release", "allocation": allocation}))
            except VmmdError as error:
                failure = error
                break
        results: List[Union[Dict[str, Any], VmmdError]] = []
        for request, pending in sent:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._await(request, pending, left, "release", limit=timeout)
                assert pending.message is not None
                results.append(pending.message)
            except VmmdError as error:
                if error.code in ("NO_ANSWER", "SESSION_LOST"):
                    failure = failure or error
                results.append(error)
        if failure is not None:
            raise failure
        return results

    def _request(self, message: Dict[str, Any], timeout: float, what: str, key: str = "request") -> _Pending:
        # The socket is taken for reading before the request goes: its answer cannot reach the reader thread first.
        reading = self._take_reading()
        try:
            request, pending = self._send_request(message, key)
        except BaseException:
            if reading:
                self._leave_reading()
            raise
        self._await(request, pending, timeout, what, key, reading=reading)
        return pending

    def _send_request(self, message: Dict[str, Any], key: str = "request") -> Tuple[str, _Pending]:
        """Sends a request under a new id, registered for its answer: (the id, its pending answer)."""
        pending = _Pending()
        with self._send_lock:
            request = str(self._next_request)
            self._next_request += 1
            message[key] = request
            with self._lock:
                if self._closed:
                    raise self._lost()
                self._requests[f"{key}:{request}"] = pending
            try:
                self._send(message)
            except VmmdError:
                with self._lock:
                    self._requests.pop(f"{key}:{request}", None)
                raise
        return request, pending

    def _await(self, request: str, pending: _Pending, timeout: Optional[float], what: str, key: str = "request", limit: Optional[float] = None, reading: bool = False) -> None:
        """Waits for a sent request's answer, reading the socket on this thread
        while no other does (`reading`: this thread holds it already); raises
        its refusal, or NO_ANSWER after `timeout` seconds (None: no limit;
        `limit`: the caller's, when this wait had only what was left of it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not pending.event.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                if not reading:
                    reading = self._take_reading()
                if reading:
                    if not self._read_until(pending, deadline):
                        # The connection ended: the reader thread finishes the session, which fails this wait.
                        self._leave_reading()
                        reading = False
                else:
                    pending.event.wait(_RETRY_READING_S if left is None else min(left, _RETRY_READING_S))
        finally:
            if reading:
                self._leave_reading()
        if not pending.event.is_set():
            with self._lock:
                self._requests.pop(f"{key}:{request}", None)
            if pending.fd >= 0:
                os.close(pending.fd)
            raise VmmdError("NO_ANSWER", STATUS["DEADLINE_EXCEEDED"], f"the daemon did not answer {what} request {request} within {timeout if limit is None else limit} s")
        if pending.error is not None:
            raise pending.error

    def _take_reading(self) -> bool:
        """Takes the socket for reading on this thread, unless another thread
        reads it or the connection has ended; True when taken."""
        with self._lock:
            if self._closed or self._ended:
                return False
            self._count_reader(1)
        if self._recv_lock.acquire(blocking=False):
            return True
        with self._lock:
            self._count_reader(-1)
        return False

    def _leave_reading(self) -> None:
        self._recv_lock.release()
        with self._lock:
            self._count_reader(-1)

    def _count_reader(self, change: int) -> None:
        """Counts a caller in or out of reading (under _lock); the reader
        thread watches for messages again once none is left."""
        before = self._readers
        self._readers += change
        if (before == 0) != (self._readers == 0):
            try:
                self._watch.modify(self._sock, _WATCH_HANGUP if self._readers > 0 else _WATCH_ALL)
            except (OSError, ValueError):
                pass  # closed: nothing left to watch
        if self._readers == 0:
            self._lock.notify_all()

    def _read_until(self, pending: _Pending, deadline: Optional[float]) -> bool:
        """Reads and dispatches (this thread holds the socket) until `pending`
        is answered or the deadline passes, spinning up to the busy-poll
        budget before each sleep; False when the connection ended."""
        spin_until = time.monotonic() + self._busy_poll_s
        while not pending.event.is_set():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return True
            if now < spin_until:
                wait_ms: Optional[int] = 0
            elif deadline is None:
                wait_ms = None
            else:
                wait_ms = max(1, int((deadline - now) * 1000 + 0.999))
            try:
                ready = self._caller_poll.poll(wait_ms)
            except (OSError, ValueError):
                self._ended = True
                return False
            if ready:
                if not self._drain(pending):
                    return False
                spin_until = time.monotonic() + self._busy_poll_s
        return True

    def _drain(self, until: Optional[_Pending] = None) -> bool:
        """Dispatches the messages waiting on the socket, without blocking (the
        caller holds _recv_lock), all of them or up to `until`'s answer (the
        rest wait for the next reader); False when the connection ended."""
        while until is None or not until.event.is_set():
            try:
                data, fds = _recv_message(self._sock, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            except (OSError, ValueError):
                self._ended = True
                return False
            if not data:
                for fd in fds:
                    os.close(fd)
                self._ended = True
                return False
            try:
                self._dispatch(data, fds)
            except Exception:  # a bad message from the daemon must not stop the reading
                for fd in fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        return True

    # -- lifetime ----------------------------------------------------------

    def close(self) -> None:
        """Ends the session: the daemon reclaims everything it owns."""
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if threading.current_thread() is not self._reader:
            self._reader.join(5)
        self._finish()

    def __enter__(self) -> "ClientSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ---------------------------------------------------------

    def _lost(self) -> VmmdError:
        return VmmdError("SESSION_LOST", STATUS["UNAVAILABLE"], f"session {self.id} with vmmd is closed")

    def _send(self, message: Dict[str, Any], fd: int = -1) -> None:
        if self._closed:
            raise self._lost()
        data = json.dumps(message, separators=(",", ":")).encode("utf-8")
        try:
            if fd >= 0:
                socket.send_fds(self._sock, [data], [fd])
            else:
                self._sock.send(data)
        except OSError as error:
            raise VmmdError("SESSION_LOST", STATUS["UNAVAILABLE"], f"the session socket failed: {error}") from None

    def _read_loop(self) -> None:
        """The reader thread: reads while no caller does, until the connection ends."""
        while True:
            with self._lock:
                while self._readers > 0 and not self._closed:
                    self._lock.wait()
                if self._closed:
                    break
            if not self._ended:
                try:
                    events = self._watch.poll()
                except (OSError, ValueError):
                    break
                if not any(mask & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) for _, mask in events):
                    # A hang-up while a caller reads: the caller sees it and leaves; then this thread finishes.
                    with self._lock:
                        while self._readers > 0 and not self._closed:
                            self._lock.wait()
            if not self._recv_lock.acquire(blocking=False):
                continue  # a caller took it meanwhile (and counts in _readers: the wait above holds this thread)
            try:
                alive = self._drain()
            finally:
                self._recv_lock.release()
            if not alive:
                break
        self._finish()

    def _dispatch(self, data: bytes, fds: List[int]) -> None:
        # At most one descriptor per message; extras are closed.
        fd = fds[0] if fds else -1
        for extra in fds[1:]:
            os.close(extra)
        try:
            message = json.loads(data.decode("utf-8"))
        except ValueError:
            message = None
        if not isinstance(message, dict):
            if fd >= 0:
                os.close(fd)
            return
        kind = message.get("type")
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            if kind == "transfer" and fd >= 0 and isinstance(message.get("transfer"), str):
                old = self._inbox.pop(message["transfer"], None)
                if old is not None:
                    os.close(old[0])
                self._inbox[message["transfer"]] = (fd, now)
                self._lock.notify_all()
                return
            key = None
            if (kind in _ANSWERS or kind == "error") and message.get("request") is not None:
                key = f"request:{message['request']}"
            elif kind == "pong" and message.get("nonce") is not None:
                key = f"nonce:{message['nonce']}"
            pending = self._requests.pop(key, None) if key is not None else None
        if pending is not None:
            if kind in _WITH_DESCRIPTOR and fd >= 0:
                pending.message, pending.fd = message, fd
                fd = -1
            elif kind == "error":
                pending.error = VmmdError(str(message.get("code")), int(message.get("status") or STATUS["UNKNOWN"]), str(message.get("message")))
            elif kind in _WITH_DESCRIPTOR:
                pending.error = VmmdError("NO_DESCRIPTOR", STATUS["INTERNAL"], f"the daemon's answer ({kind}) to request {message.get('request')} carried no descriptor")
            else:
                pending.message = message
            pending.event.set()
        if fd >= 0:
            os.close(fd)
        if pending is None and kind == "error":
            for callback in list(self.on_daemon_error):
                callback(message)

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
        try:
            self._watch.close()
        except OSError:
            pass
        if not self._closing:
            for callback in list(self.on_close):
                callback()
