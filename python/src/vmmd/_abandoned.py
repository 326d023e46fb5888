"""Answers nobody will take: a request whose caller was cut short (an
interrupt, its timeout) is abandoned, not forgotten. What its answer made is
released when the answer comes (the descriptor closed, the allocation
released with the session's next send, the store's open closed), and an
answer its caller never took is released when its record is collected."""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _frames
from ._locks import Flag, guarded, release_if_held
from .errors import VmmdError

# What is left to undo for an answer nobody took: ("release", allocation id) or ("close", store id).
Orphan = Tuple[str, str]


def orphan_of(frame: Any) -> Optional[Orphan]:
    """What an answer (a DaemonFrame) made that its caller would have owned: an allocation, or an open of a store."""
    kind = None if frame is None else frame.WhichOneof("body")
    if kind == "allocated":
        return ("release", str(frame.allocated.allocation_id))
    if kind == "opened":
        return ("close", str(frame.opened.store.id))
    return None


class Pending:
    """One answer awaited by a caller (an allocate request, a ping)."""

    __slots__ = ("event", "message", "fd", "error", "abandoned", "_orphans")

    def __init__(self, orphans: List[Orphan]) -> None:
        self.event = Flag()
        # The answering DaemonFrame.
        self.message: Any = None
        self.fd = -1
        self.error: Optional[VmmdError] = None
        # Its caller gave up (an interrupt, a timeout): the answer, when it comes, is released by the session.
        self.abandoned = False
        self._orphans = orphans

    def take(self) -> Tuple[Any, int]:
        """The answer's body (the RPC's response message) and its descriptor, now the caller's (no longer this record's to release).
        The body is found first: from the hand-over to the return no call runs, where a signal's handler could raise
        with the answer out of this record and not yet the caller's."""
        message = self.message
        assert message is not None
        body = getattr(message, message.WhichOneof("body"))
        fd, self.message, self.fd = self.fd, None, -1
        return body, fd

    def release(self) -> None:
        """Lets go of an answer nobody will take: its descriptor is closed and
        what it made (an allocation, an open) undone with the session's next send.
        Each is taken out where it is released: no call between the two (a signal
        runs its handler after a call)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        # What the answer made is found while the record still holds it: orphan_of is a call, where an
        # interrupt taken with the answer already out would lose the allocation.
        orphan = orphan_of(self.message)
        self.message = None
        if orphan is not None:
            self._orphans.append(orphan)

    def __del__(self) -> None:
        # An answer its caller never took (cut short where no except ran: an interrupt inside one).
        self.release()


class AbandonedAnswers:
    """ClientSession's part that gives up requests and releases what their
    answers made. Uses the session's _lock, _send_lock, _requests, _orphans,
    _next_request, _send(), _closed and _forked. `close_store_open(store_id)`:
    how an open of a store is closed (the client's Close RPC, not awaited);
    without it, opens nobody took go with the session."""

    close_store_open: Optional[Callable[[str], None]] = None

    _lock: Any
    _send_lock: Any
    _requests: Dict[str, Pending]
    _orphans: List[Orphan]
    _next_request: int
    _closed: bool
    _forked: bool

    _send: Callable[..., None]

    def _abandon_all(self, sent: List[Tuple[str, Pending]]) -> None:
        """Forgets every request of a call cut short (an interrupt, a failure) that is not answered and taken."""
        for key, pending in sent:
            self._abandon(key, pending)

    def _abandon(self, key: str, pending: Pending) -> None:
        """Gives up a request its caller will not take: what its answer made
        is released, now if it is here (a descriptor closed, an allocation
        released), else when it comes (_dispatch_one)."""
        with guarded(self._lock):
            pending.abandoned = True
            pending.release()
        self._release_orphans()

    def _release_orphans(self) -> None:
        """Sends a release for each allocation whose answer nobody took, while
        the send lock is free and the socket has room now (never waiting: the
        reading thread calls it); what is left goes with the next call. The
        releases' own answers are abandoned: nobody awaits them."""
        if not self._orphans or self._closed or self._forked or self._send_lock._is_owned():
            return
        try:
            if not self._send_lock.acquire(False):
                return
            while self._orphans:
                kind, ident = self._orphans[0]
                if kind == "close":
                    if self.close_store_open is not None:
                        self.close_store_open(ident)
                    self._orphans.pop(0)
                    continue
                pending = Pending(self._orphans)
                pending.abandoned = True
                request = str(self._next_request)
                self._next_request += 1
                with guarded(self._lock):
                    self._requests[f"request:{request}"] = pending
                try:
                    self._send(_frames.ClientFrame(request=int(request), release={"allocation_id": int(ident)}), deadline=time.monotonic())
                except VmmdError:
                    with guarded(self._lock):
                        self._requests.pop(f"request:{request}", None)
                    return
                # Removed once sent: an interrupt between the two sends it twice (the second refused, and ignored), never not at all.
                self._orphans.pop(0)
        finally:
            release_if_held(self._send_lock)

    def disown(self, allocation: str) -> None:
        """Releases an allocation this process got but cannot use (its caller
        was cut short after the answer came): now if the socket is free, else
        with the next call."""
        self._orphans.append(("release", allocation))
        self._release_orphans()

    def _orphan_again(self, orphan: Orphan) -> None:
        """Undoes `orphan` with the next call: its first undoing did not take (any thread may call it)."""
        self._orphans.append(orphan)

    def orphans(self) -> List[Orphan]:
        """What answers nobody took made and is not undone yet (it goes with the next call):
        ("release", allocation id) and ("close", store id)."""
        return list(self._orphans)
