"""Sending on the session socket: one message whole (SEQPACKET) or nothing,
waiting for room up to a deadline (a daemon that stops reading fills it)."""
from __future__ import annotations

import math
import select
import socket
import time
from typing import Callable, List, Optional

from ._values import left_until
from .errors import STATUS, VmmdError


def send_message(sock: socket.socket, data: bytes, fd: int, deadline: Optional[float], stage: Optional[List[str]], closed: Callable[[], bool], lost: Callable[[], VmmdError]) -> None:
    """Sends `data` (and the descriptor `fd`, unless -1) by `deadline`
    (monotonic; None: no limit). `stage[0]`: "sending" from each send on,
    "waiting" once it found no room. Raises VmmdError UNAVAILABLE
    SESSION_SOCKET_FULL at the deadline (nothing sent), lost() when the
    session closed or its socket failed."""
    started = time.monotonic()
    while True:
        if stage is not None:
            stage[0] = "sending"
        try:
            if fd >= 0:
                socket.send_fds(sock, [data], [fd], socket.MSG_DONTWAIT)
            else:
                sock.send(data, socket.MSG_DONTWAIT)
            return
        except BlockingIOError:
            if stage is not None:
                stage[0] = "waiting"
        except OSError as error:
            raise VmmdError("SESSION_LOST", STATUS["UNAVAILABLE"], f"the session socket failed: {error}") from None
        left = left_until(deadline)
        if left == 0:
            raise VmmdError("SESSION_SOCKET_FULL", STATUS["UNAVAILABLE"], f"the session socket is full: the daemon has not read for {time.monotonic() - started:.3f} s; nothing was sent")
        if closed():
            raise lost()
        # Until there is room, the deadline, or a second (to look at the session again).
        try:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLOUT)
            poller.poll(1000 if left is None else max(1, min(1000, math.ceil(left * 1000))))
        except (ValueError, OSError):
            # The session closed meanwhile (its socket's descriptor is gone).
            raise lost() from None
