"""Releases in one round trip: every request sent before any answer is
awaited, at most RELEASE_WINDOW unanswered at a time."""
from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Tuple, Union

from . import _proto
from ._abandoned import Pending
from ._locks import surely
from ._values import allocation_id, deadline_of, left_until
from .errors import STATUS, VmmdError

# release_many keeps at most this many requests unanswered: the daemon's socket buffer holds a few hundred
# answers, and one the client's socket cannot take is dropped (SESSION_SOCKET_FULL).
RELEASE_WINDOW = 64


class BatchedReleases:
    """ClientSession's release_many(), on its _reading, _send_request(),
    _await(), _abandon_all(), _check_process() and _release_orphans()."""

    _reading: Any
    _closed: bool
    _send_request: Callable[..., Tuple[str, Pending]]
    _await: Callable[..., None]
    _abandon_all: Callable[[List[Tuple[str, Pending]]], None]
    _check_process: Callable[[], None]
    _release_orphans: Callable[[], None]

    def release_many(self, allocations: List[int], timeout: Optional[float] = 30.0) -> List[Union[Any, VmmdError]]:
        """Releases several allocations in one round trip: every request is
        sent before any answer is waited for. Returns, in order, each answer
        (as release()'s) or the VmmdError that refused it; a refusal does not
        stop the others. Raises VmmdError BAD_ID (nothing sent) for an id that
        is not a uint64, and NO_ANSWER (`timeout` seconds for them all; None:
        no limit) or SESSION_LOST, after waiting for the requests already
        sent, when the session fails."""
        ids = [allocation_id(allocation) for allocation in allocations]
        self._check_process()
        self._release_orphans()
        deadline = deadline_of(None if timeout is None else float(timeout))
        sent: List[Tuple[str, Pending]] = []
        registered: List[Tuple[str, Pending]] = []
        tail: List[VmmdError] = []
        failure: Optional[VmmdError] = None
        results: List[Union[Any, VmmdError]] = []

        def collect(request: str, pending: Pending) -> None:
            nonlocal failure
            try:
                self._await(request, pending, left_until(deadline), "release", limit=timeout)
                results.append(pending.take()[0])
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
                    sent.append(self._send_request("release", _proto.message("ReleaseRequest")(allocation_id=int(allocation)), registered, deadline))
                except VmmdError as error:
                    failure = failure or error
                    break
            for request, pending in sent[len(results):]:
                collect(request, pending)
            results.extend(tail)
        except BaseException:
            surely(lambda: self._reading.leave_to(held))
            surely(lambda: self._abandon_all(registered))
            raise
        finally:
            self._reading.leave_to(held)
        if failure is not None:
            raise failure
        return results

