"""connect() and shared_client(): a client process's session and gRPC
channel, with one method per RPC of every service (the token sent on each):
Devices and Admin here, VirtualMemory in _vmm (import_() and allocate() map
memory into this process), Stores in _stores, the calls themselves in _rpc.
A client is closed by close(), or by its finalizer once dropped."""
from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional

import grpc

from . import _fork
from ._declared import MAX_STAGING_BYTES
from ._rpc import SESSION_METADATA_KEY, STREAM_CHUNK_BYTES, Message, Request, _Future, _Service, sealed_memfd
from ._staging import DEFAULT_STAGING_BYTES, STAGED_MIN_BYTES, StagingBuffer
from ._stores import OpenedStore, StoreName, StoresApi
from ._vmm import VirtualMemoryApi
from .errors import STATUS, VmmdError
from .paths import default_socket_dir, socket_paths
from ._resuming import resume_wait_seconds
from .session import DEFAULT_BUSY_POLL_US, ClientSession, busy_poll_budget

__all__ = [
    "AdminApi", "DEFAULT_STAGING_BYTES", "DevicesApi", "Message", "OpenedStore", "Request", "SESSION_METADATA_KEY",
    "STAGED_MIN_BYTES", "STREAM_CHUNK_BYTES", "StagingBuffer", "StoreName", "StoresApi", "VirtualMemoryApi",
    "VmmdClient", "connect", "sealed_memfd", "shared_client", "_Future", "_Service",
]


class DevicesApi:
    """The Devices service."""

    def __init__(self, service: _Service) -> None:
        self._service = service

    def list_devices(self, timeout: Optional[float] = None) -> Message:
        return self._service.unary("ListDevices", timeout=timeout)

    def get_memory_info(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """Raises VmmdError OUT_OF_RANGE UNKNOWN_DEVICE."""
        return self._service.unary("GetMemoryInfo", request, timeout=timeout, **fields)

    def get_granularity(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """Raises VmmdError OUT_OF_RANGE UNKNOWN_DEVICE."""
        return self._service.unary("GetGranularity", request, timeout=timeout, **fields)


class AdminApi:
    """The Admin service."""

    def __init__(self, service: _Service) -> None:
        self._service = service

    def get_stats(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        return self._service.unary("GetStats", request, timeout=timeout, **fields)

    def get_report(self, timeout: Optional[float] = None) -> Dict[str, object]:
        """The daemon's report (the Admin service's GetReport), parsed from its JSON: an object, as TypeScript's getReport gives it."""
        import json

        return json.loads(self._service.unary("GetReport", timeout=timeout).json)

    def list_sessions(self, timeout: Optional[float] = None) -> Message:
        return self._service.unary("ListSessions", timeout=timeout)

    def list_objects(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        return self._service.unary("ListObjects", request, timeout=timeout, **fields)

    def clear_caches(self, timeout: Optional[float] = None) -> Message:
        return self._service.unary("ClearCaches", timeout=timeout)

    def get_version(self, timeout: Optional[float] = None) -> Message:
        return self._service.unary("GetVersion", timeout=timeout)


class VmmdClient:
    """A connected client: the session (the lease on everything it creates)
    and the services: devices, vmm, stores, admin. Usable as a context manager."""

    def __init__(self, session: ClientSession, socket_dir: str, channel: grpc.Channel, deadline: float, staging_bytes: int, busy_poll_us: int = DEFAULT_BUSY_POLL_US) -> None:
        self.session = session
        self.socket_dir = socket_dir
        self._channel = channel
        self._closing = False
        self.lost = False
        self.on_session_lost: List[Callable[[VmmdError], None]] = []
        metadata = lambda: [(SESSION_METADATA_KEY, session.token)]  # noqa: E731
        self.devices = DevicesApi(_Service(channel, "Devices", metadata, deadline, session))
        self.admin = AdminApi(_Service(channel, "Admin", metadata, deadline, session))
        # How to map the daemon's descriptors is a capability its hello states: memfds ("host") or CUDA handles ("cuda").
        self.backend: str = _descriptor_kind(session)
        self.vmm = VirtualMemoryApi(_Service(channel, "VirtualMemory", metadata, deadline, session), session, self.backend, staging_bytes)
        self.stores = StoresApi(_Service(channel, "Stores", metadata, deadline, session), session, self.backend)
        self._options = (deadline, staging_bytes, busy_poll_us)
        # The session holds the client weakly (its reader thread holds the session): a client dropped without
        # close() is collected, and its finalizer ends the session.
        session.on_close.append(_weakly(self._on_session_close))
        stores = self.stores._service
        # An open whose answer nobody took (an interrupted or timed-out open) is closed, not awaited.
        session.close_store_open = lambda store_id: _close_orphaned_open(session, stores, store_id)
        self._finalizer = weakref.finalize(self, _close_parts, session, channel, self.vmm)
        self._finalizer.atexit = False  # at exit the daemon sees the socket close

    def _on_session_close(self) -> None:
        if self._closing:
            return
        self.lost = True
        why = self.session._why_lost
        error = VmmdError(
            "SESSION_LOST",
            STATUS["UNAVAILABLE"],
            f"session {self.session.id} with vmmd at {self.socket_dir} ended: the daemon went away{'' if why is None else f' and the session did not come back ({why})'}; everything the session held in the daemon is gone (memory mapped in this process stays valid); reconnect() opens a new session",
        )
        for callback in list(self.on_session_lost):
            callback(error)

    def reconnect(self) -> "VmmdClient":
        """A new session with the daemon at the same socket directory (after a
        restart of the daemon, say). This client stays closed.
        Raises VmmdError UNAVAILABLE DAEMON_UNREACHABLE while no daemon serves the directory."""
        self.close()
        return connect(self.socket_dir, deadline=self._options[0], staging_bytes=self._options[1], busy_poll_us=self._options[2])

    def close(self) -> None:
        """Ends the session: the daemon reclaims everything it owns. Local
        mappings stay valid. A client dropped without close() is closed when
        it is collected."""
        self._closing = True
        self._finalizer()

    def __enter__(self) -> "VmmdClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _descriptor_kind(session: ClientSession) -> str:
    """How the daemon's descriptors are mapped, from its capabilities: "cuda" (CUDA handles) or "host" (memfds).
    Raises VmmdError UNIMPLEMENTED UNKNOWN_BACKEND for a daemon whose descriptors are of neither kind."""
    if "CAPABILITY_CUDA_DESCRIPTORS" in session.capabilities:
        return "cuda"
    if "CAPABILITY_MEMFD_DESCRIPTORS" in session.capabilities:
        return "host"
    held = ", ".join(sorted(session.capabilities)) or "none"
    raise VmmdError("UNKNOWN_BACKEND", STATUS["UNIMPLEMENTED"], f"the daemon's descriptors are of no kind this client maps (its capabilities: {held}); this client maps memfds and CUDA handles")


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """`method`, called while its object lives, without keeping it alive."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        target = ref()
        if target is not None:
            target()

    return call



# A Close the daemon did not take: the channel was not ready (reconnecting after a stall) or the call ran out of time.
_CLOSE_AGAIN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _close_orphaned_open(session: ClientSession, stores: _Service, store_id: str) -> None:
    """Closes an open whose answer nobody took, without waiting; a close the
    daemon did not take goes again with the session's next call, so that the
    open is never left to nobody."""

    def settled(future: grpc.Future) -> None:
        error = future.exception()
        if isinstance(error, grpc.RpcError) and error.code() in _CLOSE_AGAIN:  # type: ignore[attr-defined]
            session._orphan_again(("close", store_id))

    stores.unary_future("Close", store_id=int(store_id)).add_done_callback(settled)


def _close_parts(session: ClientSession, channel: grpc.Channel, vmm: VirtualMemoryApi) -> None:
    """A client's close (once, from close() or its finalizer). In a forked
    child, nothing: the session was the parent's (dropped at the fork), and
    the channel is not used there."""
    if session.forked:
        return
    vmm.close_staging()
    session.close()
    channel.close()


def connect(
    socket_dir: Optional[str] = None,
    deadline: float = 30.0,
    connect_timeout: float = 5.0,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    busy_poll_us: Optional[int] = None,
    resume_wait_s: Optional[float] = None,
) -> VmmdClient:
    """Opens a session with the daemon and a gRPC channel to it.

    socket_dir: the daemon's socket directory (default VMMD_SOCKET_DIR, then the
    daemon's own default); deadline: seconds per call; staging_bytes: the
    staging buffer of large reads and writes (0: stream everything over gRPC);
    busy_poll_us: how long a caller spins for its answer on the session
    socket before it sleeps (default VMMD_CLIENT_BUSY_POLL_US, else 200; 0:
    never); resume_wait_s: under a daemon that parks its sessions (restarts
    without loss), how long the session tries to resume after its socket
    closed, calls waiting meanwhile (default VMMD_RESUME_WAIT_MS, else 30 s;
    0: never). Raises VmmdError UNAVAILABLE DAEMON_UNREACHABLE when no daemon
    serves the directory, INVALID_ARGUMENT BAD_STAGING_SIZE, BAD_OPTION."""
    page = mmap.PAGESIZE
    if not isinstance(staging_bytes, int) or staging_bytes < 0 or staging_bytes % (2 * page) != 0 or staging_bytes > MAX_STAGING_BYTES:
        raise VmmdError("BAD_STAGING_SIZE", STATUS["INVALID_ARGUMENT"], f"staging_bytes {staging_bytes!r} must be 0 or a positive multiple of twice the page size ({2 * page}), at most 1 GiB")
    spin = busy_poll_budget(busy_poll_us)
    directory = socket_dir or default_socket_dir()
    grpc_path, session_path = socket_paths(directory)
    session = ClientSession.open(session_path, connect_timeout, spin, resume_wait_seconds(resume_wait_s))
    # A restarted daemon is reached again within a fraction of a second, not after gRPC's default backoff of seconds.
    channel = grpc.insecure_channel(f"unix://{grpc_path}", options=[("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 1000)])
    try:
        return VmmdClient(session, directory, channel, deadline, staging_bytes, spin)
    except BaseException:
        session.close()
        channel.close()
        raise


_shared_lock = threading.Lock()
_shared: Optional[VmmdClient] = None
# The process that made _shared: a forked child makes its own.
_shared_pid = 0


def shared_client() -> VmmdClient:
    """This process's one session with the daemon, for the allocators that
    Numba, CuPy and PyTorch load (made on first use with connect()'s
    defaults; made again if the daemon went away, and in a forked child)."""
    global _shared, _shared_pid
    with _shared_lock:
        if _shared is None or _shared_pid != os.getpid() or _shared.session.closed:
            _shared = connect()
            _shared_pid = os.getpid()
        return _shared


def _forget_shared_client_after_fork() -> None:
    """In a forked child: the parent's shared client is not this process's,
    and its lock may have been held by a parent thread at the fork."""
    global _shared_lock, _shared
    _shared_lock = threading.Lock()
    _shared = None


_fork.in_child(_forget_shared_client_after_fork)
