"""Opening a session: connect to the daemon's session socket, say hello (the
protocol this client speaks, and the resume token of a session to resume) and
take the daemon's answer (docs/PROTOCOL.md): the session id, its tokens, what
the daemon can do."""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Tuple

from . import _frames
from ._reading import recv_message
from .paths import where_else
from .errors import STATUS, VmmdError

PROTOCOL_VERSION = _frames.PROTOCOL_VERSION


# How many connections a greeting opens while the daemon takes its hello, come late, for silence (HELLO_LATE).
HELLO_TRIES = 3


def greet(path: str, timeout: float, resume_token: str = "", what: str = "the session") -> Tuple[socket.socket, Any]:
    """The connected socket and the daemon's HelloResponse (to a resume:
    resumed, or the refusal raised). A hello that came late on a loaded
    machine (the daemon took it for the silence of a client of protocol 1)
    is said again on a new connection, HELLO_TRIES times in all.

    Raises VmmdError UNAVAILABLE DAEMON_UNREACHABLE, DEADLINE_EXCEEDED NO_GREETING,
    PERMISSION_DENIED (the daemon refused the session), FAILED_PRECONDITION
    PROTOCOL_VERSION (a daemon of another session protocol), UNAVAILABLE BAD_GREETING, HELLO_LATE."""
    deadline = time.monotonic() + timeout
    for tries in range(1, HELLO_TRIES + 1):
        try:
            return _greet_once(path, max(deadline - time.monotonic(), 0.001), resume_token, what)
        except VmmdError as error:
            if error.code != "HELLO_LATE":
                raise
            if tries == HELLO_TRIES or time.monotonic() >= deadline:
                raise VmmdError("HELLO_LATE", STATUS["UNAVAILABLE"], f"{error.message} ({tries} tries)") from None
    raise AssertionError("unreachable")


def _greet_once(path: str, timeout: float, resume_token: str, what: str) -> Tuple[socket.socket, Any]:
    """One connection's hello and the daemon's answer."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
    except OSError as error:
        sock.close()
        raise VmmdError("DAEMON_UNREACHABLE", STATUS["UNAVAILABLE"], f"cannot reach vmmd at {path}: {error.strerror or error}; {where_else(os.path.dirname(path))}") from None
    sock.settimeout(timeout)
    try:
        try:
            sock.send(_frames.encode(hello={"protocol": PROTOCOL_VERSION, "resume_token": resume_token}))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon refused the session and closed: its refusal is read below
        try:
            data, fds = recv_message(sock)
        except ConnectionResetError:
            # The daemon closed with the hello unread (a refusal at connect): its refusal is still queued behind the error.
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
    late = _frames.late_hello_refusal(data) if _frames.is_protocol1(data) else None
    if late is not None:
        sock.close()
        raise VmmdError("HELLO_LATE", STATUS["UNAVAILABLE"], f"vmmd at {path} took this client's hello, come late, for a client of protocol 1: {late}")
    if _frames.is_protocol1(data):
        # A daemon of protocol 1 speaks first, in JSON.
        sock.close()
        raise VmmdError("PROTOCOL_VERSION", STATUS["FAILED_PRECONDITION"], f"vmmd at {path} speaks session protocol 1; this client speaks {PROTOCOL_VERSION}: upgrade the daemon")
    frame = _frames.decode(data)
    kind = _frames.body_of(frame)
    if kind == "error":
        sock.close()
        status = frame.error.status if 0 < frame.error.status <= 16 else STATUS["PERMISSION_DENIED"]
        raise VmmdError(frame.error.code, status, f"vmmd refused {what}: {frame.error.message}")
    if kind != "hello" or frame.hello.protocol != PROTOCOL_VERSION:
        sock.close()
        raise VmmdError("BAD_GREETING", STATUS["UNAVAILABLE"], f"vmmd at {path} greeted with an unexpected frame")
    sock.settimeout(None)
    return sock, frame.hello
