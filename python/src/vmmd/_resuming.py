"""A session's resumption (docs/PROTOCOL.md, "Resuming a session"): after the
session socket closes under a daemon that parks its sessions (its hello
carried a resume token), the client connects again, with backoff, until the
restarted daemon serves, and presents the token; the daemon answers with the
same session. Requests cut off by the restart are sent again on the new
connection by the session (session.py); gRPC calls wait for it (_rpc.py)."""
from __future__ import annotations

import os
import socket
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._abandoned import Pending
from ._greeting import greet
from ._locks import guarded
from . import _proto
from .errors import STATUS, VmmdError

# How long a client tries to resume its session, unless VMMD_RESUME_WAIT_MS or the argument says otherwise.
DEFAULT_RESUME_WAIT_S = 30.0
# The first wait between two attempts to reach the restarted daemon, doubled up to _BACKOFF_MAX_S.
_BACKOFF_S = 0.025
_BACKOFF_MAX_S = 0.5
# The daemon's refusals that end the attempts: the session cannot come back.
_FINAL = ("RESUME_UNKNOWN", "SESSION_RECLAIMED", "RESUME_OF_ANOTHER_UID", "RESUME_DUPLICATE", "BAD_MESSAGE", "NOT_ALLOWED", "PERMISSION_DENIED", "PROTOCOL_VERSION")


def resume_wait_seconds(value: Optional[float], env: Optional[str] = None) -> float:
    """The resume wait: the argument (seconds), else VMMD_RESUME_WAIT_MS, else 30 s.
    Raises VmmdError INVALID_ARGUMENT BAD_OPTION naming the value and the rule."""
    if value is None:
        env = os.environ.get("VMMD_RESUME_WAIT_MS") if env is None else env
        if env is None or env == "":
            return DEFAULT_RESUME_WAIT_S
        try:
            ms = int(env)
        except ValueError:
            ms = -1
        if not 0 <= ms <= 3_600_000:
            raise VmmdError("BAD_OPTION", STATUS["INVALID_ARGUMENT"], f"VMMD_RESUME_WAIT_MS must be a whole number of milliseconds from 0 to 3600000, got {env!r}")
        return ms / 1000
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3600:
        raise VmmdError("BAD_OPTION", STATUS["INVALID_ARGUMENT"], f"resume_wait_s must be a number of seconds from 0 to 3600, got {value!r}")
    return float(value)


def resume_socket(path: str, session: str, resume_token: str, deadline: float, stop: threading.Event) -> socket.socket:
    """A connection that serves session `session` again, made before `deadline`
    (time.monotonic()), trying again while no daemon serves `path`.
    Raises VmmdError: the daemon's refusal (RESUME_UNKNOWN, SESSION_RECLAIMED…),
    or the last attempt's failure once the deadline passed (or `stop` is set)."""
    backoff = _BACKOFF_S
    last = VmmdError("DAEMON_UNREACHABLE", STATUS["UNAVAILABLE"], f"no vmmd served {path}")
    while time.monotonic() < deadline and not stop.is_set():
        sock: Optional[socket.socket] = None
        try:
            sock, hello = greet(path, max(0.001, deadline - time.monotonic()), resume_token, f"to resume session {session}")
            if not hello.resumed or str(hello.session) != session:
                raise VmmdError("BAD_GREETING", STATUS["UNAVAILABLE"], f"vmmd at {path} did not answer the resume of session {session} with it")
            return sock
        except (VmmdError, OSError) as error:
            if sock is not None:
                sock.close()
            last = error if isinstance(error, VmmdError) else VmmdError("DAEMON_UNREACHABLE", STATUS["UNAVAILABLE"], f"vmmd at {path}: {error}")
            if last.code in _FINAL:
                raise last from None
        stop.wait(min(backoff, max(0.0, deadline - time.monotonic())))
        backoff = min(backoff * 2, _BACKOFF_MAX_S)
    raise last


class Resumable:
    """ClientSession's lifetime: its end (_finish), and, under a daemon that
    parks sessions, its resumption on a new connection when the socket closed
    without close(). Uses the session's _lock, _closed, _closing, _forked,
    _inbox, _requests, _sock, _reading, on_close and _start_reading()."""

    id: str
    resume_token: Optional[str]
    on_close: List[Callable[[], None]]
    _lock: Any
    _closed: bool
    _closing: bool
    _forked: bool
    _inbox: Dict[str, Tuple[int, float]]
    _requests: Dict[str, Any]
    _sock: socket.socket
    _reading: Any
    _path: str
    _resume_wait_s: float
    _generation: int
    _resuming: bool
    _stop_resuming: threading.Event
    _why_lost: Optional[VmmdError]
    _start_reading: Callable[[socket.socket], None]

    def _may_resume(self) -> bool:
        return self.resume_token is not None and self._resume_wait_s > 0 and self._path != "" and not (self._closing or self._forked or self._closed) and self._why_lost is None

    def _lost(self) -> VmmdError:
        """What a call meets when the connection is gone: SESSION_RESUMING while the session may come back."""
        if self._may_resume():
            return VmmdError("SESSION_RESUMING", STATUS["UNAVAILABLE"], f"session {self.id} is resuming after the daemon went away")
        if self._why_lost is not None:
            return self._why_lost
        return VmmdError("SESSION_LOST", STATUS["UNAVAILABLE"], f"session {self.id} with vmmd is closed")

    def _resume(self) -> bool:
        """(The reader thread, its connection ended.) Brings the session back on a new connection; False when
        it cannot (the session then finishes). Requests cut off fail SESSION_RESUMING: their callers send them again."""
        if not self._may_resume():
            return False
        with guarded(self._lock):
            self._resuming = True
            for fd, _ in self._inbox.values():
                os.close(fd)
            self._inbox.clear()
            cut = list(self._requests.values())
            self._requests.clear()
            self._lock.notify_all()
        for pending in cut:
            pending.error = self._lost()
            pending.event.set()
        try:
            sock = resume_socket(self._path, self.id, self.resume_token or "", time.monotonic() + self._resume_wait_s, self._stop_resuming)
        except VmmdError as why:
            self._why_lost = VmmdError("SESSION_LOST", STATUS["UNAVAILABLE"], f"session {self.id} with vmmd could not be resumed after its socket closed ({why.code}: {why}); everything it held in the daemon is gone (memory mapped in this process stays valid)")
            with guarded(self._lock):
                self._resuming = False
                self._lock.notify_all()
            return False
        try:
            self._sock.close()
        except OSError:
            pass
        with guarded(self._lock):
            if self._closing:
                sock.close()
                self._resuming = False
                self._lock.notify_all()
                return False
            self._start_reading(sock)
            self._generation += 1
            self._resuming = False
            self._lock.notify_all()
        return True

    def _wait_serving(self, deadline: Optional[float]) -> None:
        """Returns once the session is not resuming (it serves, or has ended), or at `deadline` (time.monotonic())."""
        with guarded(self._lock):
            while self._resuming and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._lock.wait(left)

    @staticmethod
    def _released_before(code: str) -> Optional[Pending]:
        """The answer a release sent again after a resume gets where the daemon's refusal says the first one was
        done before the daemon went (its answer lost with it): UNKNOWN_ALLOCATION, it freed the allocation;
        NO_REFERENCE, it gave back the session's reference and the allocation lives on, held by a store or another
        session (the counts left are not known here: 0). None for any other refusal, which goes to the caller."""
        if code not in ("UNKNOWN_ALLOCATION", "NO_REFERENCE"):
            return None
        pending = Pending([])
        pending.message = _proto.message("DaemonFrame")(released={"freed": code == "UNKNOWN_ALLOCATION"})
        pending.event.set()
        return pending

    def _wait_resumed(self, generation: int, deadline: Optional[float]) -> bool:
        """Waits until the session serves on a connection newer than `generation`; False once it has ended, or at `deadline`."""
        with guarded(self._lock):
            while self._generation == generation and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
            return not self._closed

    def _finish(self) -> None:
        with guarded(self._lock):
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
