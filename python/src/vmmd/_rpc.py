"""The gRPC half of the client: calls of one service with the session token
and a deadline each (the client's default, or the call's own `timeout`),
gRPC errors turned into VmmdError of their kind."""
from __future__ import annotations

import os
import fcntl
import time
from typing import Any, Callable, Iterable, Iterator, List, Mapping, Optional, Tuple

import grpc

from . import _proto
from ._values import timeout_seconds
from .errors import STATUS, VmmdError

from ._declared import SESSION_METADATA_KEY  # noqa: F401  (re-exported: shared with the daemon, generated)
# The RPCs sent again when the daemon's going away cut them off (UNAVAILABLE, or CANCELLED: the stream reset by a
# daemon that stopped with the call in flight; this client never cancels a unary call itself): they change nothing, or change it
# to the same end however often they run (Detach: the store detached). The rest fail to their caller (client/rpc.ts
# has the same list, and says why the others are not in it).
CUT_OFF = frozenset((STATUS["UNAVAILABLE"], STATUS["CANCELLED"]))
SAFE_AGAIN = frozenset((
    "GetStats", "GetReport", "ListSessions", "ListObjects", "GetVersion", "ListDevices", "GetMemoryInfo", "GetGranularity",
    "List", "Read", "GetAccess", "GetProperties", "Share", "Export", "SetAccess", "Fill", "Detach",
))
# Calls of SAFE_AGAIN whose repeat the daemon refuses when the attempt cut off did the work: the refusal codes that say
# so (a Detach repeated finds the store detached, or gone with its name); the caller gets the answer below instead.
DONE_BY_THE_CUT = {"Detach": frozenset(("STORE_DETACHED", "UNKNOWN_STORE"))}


def _done_by_the_cut(method: str, request: Message) -> Message:
    """What the caller gets for a call the attempt cut off did: for Detach, the store it named, detached."""
    ref = request.store
    return _proto.message("Store")(id=ref.id, name=ref.name, state=_proto.enum_value("StoreState", "STORE_STATE_DETACHED"))
# Largest message a client stream sends.
STREAM_CHUNK_BYTES = 1 << 20

Message = Any
Request = Optional[Mapping[str, Any]]


def sealed_memfd(name: str, size: int) -> int:
    """A memfd of `size` bytes that can neither shrink nor grow (F_SEAL_SHRINK,
    F_SEAL_GROW), written only by its owner (mode 0644): the daemon maps what
    clients send it, refuses descriptors that could be resized under its
    mapping, and hands other uids read-only descriptors that must not be
    reopened writable through /proc/self/fd."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        os.fchmod(fd, 0o644)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Service:
    """Calls of one service: each sends the session token and turns gRPC errors into VmmdError."""

    def __init__(self, channel: grpc.Channel, name: str, metadata: Callable[[], List[Tuple[str, str]]], deadline: float, session: Any = None) -> None:
        self._session = session
        self._calls = _proto.stub(channel, name)
        self._methods = _proto.methods(name)
        self._metadata = metadata
        self._deadline = deadline

    def _request(self, method: str, request: Request, fields: Mapping[str, Any]) -> Message:
        cls = _proto.message(self._methods[method].input_type.name)
        if request is not None and not isinstance(request, Mapping):
            return request  # already a message
        values = {**(request or {}), **fields}
        try:
            return cls(**values)
        except (TypeError, ValueError) as error:
            raise VmmdError("BAD_REQUEST", STATUS["INVALID_ARGUMENT"], f"{method}: {error}") from None

    def seconds(self, timeout: Optional[float]) -> float:
        """A call's deadline in seconds: its own `timeout`, else the client's.
        Raises VmmdError INVALID_ARGUMENT BAD_TIMEOUT."""
        return timeout_seconds(timeout, self._deadline)

    def unary(self, method: str, request: Request = None, *, timeout: Optional[float] = None, **fields: Any) -> Message:
        """Raises VmmdError of the daemon's code; VmmdTimeoutError past `timeout` (None: the client's deadline)."""
        message = self._request(method, request, fields)
        seconds = self.seconds(timeout)
        session = self._session
        if session is None or session.resume_token is None:
            try:
                return self._calls[method](message, metadata=self._metadata(), timeout=seconds)
            except grpc.RpcError as error:
                raise VmmdError.from_rpc(error) from None
        # Under a daemon that parks sessions: the call waits while the session resumes, waits for the daemon's
        # channel rather than failing at once, and goes again when the restart cut it off where that is safe.
        deadline = time.monotonic() + seconds
        # Whether an attempt was cut off: the work may be done, and a refusal of the repeat may say so.
        cut = False
        for attempt in range(1_000_000):
            session._wait_serving(deadline)
            try:
                return self._calls[method](message, metadata=self._metadata(), timeout=max(0.001, deadline - time.monotonic()), wait_for_ready=not session.closed)
            except grpc.RpcError as error:
                failed = VmmdError.from_rpc(error)
                if cut and failed.code in DONE_BY_THE_CUT.get(method, ()):
                    return _done_by_the_cut(method, message)
                cut_off = failed.status in CUT_OFF and attempt < 3 and method in SAFE_AGAIN
                cut = cut or cut_off
                again = failed.code == "SESSION_RESUMING" or cut_off
                if not again or session.closed or time.monotonic() >= deadline:
                    raise failed from None
                time.sleep(0.02)
        raise AssertionError("unreachable")

    def server_stream(self, method: str, request: Request = None, timeout: Optional[float] = -1.0, **fields: Any) -> Iterator[Message]:
        message = self._request(method, request, fields)
        call = self._calls[method](message, metadata=self._metadata(), timeout=self._deadline if timeout == -1.0 else timeout)
        try:
            for item in call:
                yield item
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                return
            raise VmmdError.from_rpc(error) from None
        finally:
            call.cancel()

    def unary_future(self, method: str, request: Request = None, *, timeout: Optional[float] = None, **fields: Any) -> "_Future":
        """The call started; result() waits for it (and raises VmmdError)."""
        message = self._request(method, request, fields)
        return _Future(self._calls[method].future(message, metadata=self._metadata(), timeout=self.seconds(timeout)))

    def client_stream(self, method: str, messages: Iterable[Message], timeout: Optional[float] = None) -> Message:
        seconds = self.seconds(timeout)
        try:
            return self._calls[method](iter(messages), metadata=self._metadata(), timeout=seconds)
        except grpc.RpcError as error:
            raise VmmdError.from_rpc(error) from None

    def call(self, method: str) -> Any:
        return self._calls[method]


class _Future:
    """A unary call in flight."""

    def __init__(self, future: Any) -> None:
        self._future = future

    def result(self) -> Message:
        try:
            return self._future.result()
        except grpc.RpcError as error:
            raise VmmdError.from_rpc(error) from None

    def add_done_callback(self, callback: Callable[[grpc.Future], None]) -> None:
        """Calls `callback(grpc future)` once the call ends (at once if it has; on a gRPC thread otherwise)."""
        self._future.add_done_callback(callback)
