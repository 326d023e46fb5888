"""Opening a session: connect to the daemon's session socket and take its
greeting (docs/PROTOCOL.md): the session id, its token, the backend."""
from __future__ import annotations

import json
import os
import socket
from typing import Any, Dict, Tuple

from ._reading import recv_message
from .paths import where_else
from .errors import STATUS, VmmdError

PROTOCOL_VERSION = 1


def greet(path: str, timeout: float) -> Tuple[socket.socket, Dict[str, Any]]:
    """The connected socket and the daemon's hello.

    Raises VmmdError UNAVAILABLE DAEMON_UNREACHABLE, DEADLINE_EXCEEDED NO_GREETING,
    PERMISSION_DENIED (the daemon refused the session), UNAVAILABLE BAD_GREETING."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
    except OSError as error:
        sock.close()
        raise VmmdError("DAEMON_UNREACHABLE", STATUS["UNAVAILABLE"], f"cannot reach vmmd at {path}: {error.strerror or error}; {where_else(os.path.dirname(path))}") from None
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
    return sock, hello

