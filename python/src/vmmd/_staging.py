"""The session's staging buffer: large reads and writes copied through a
shared memfd, only offsets over gRPC. A daemon that refuses the buffer (its
uid's staging budget is spent) is asked no more: the caller streams instead."""
from __future__ import annotations

import mmap
import os
import threading
from typing import List, Optional

from ._rpc import _Future, _Service, sealed_memfd
from .errors import VmmdError
from .session import ClientSession

from ._declared import DEFAULT_STAGING_BYTES, STAGED_MIN_BYTES  # noqa: F401  (re-exported: shared with the daemon, generated)


class StagingRefused(Exception):
    """Raised by a staged copy when the daemon refused the buffer
    (BUDGET_EXCEEDED): nothing was copied, the caller streams instead."""


class StagingBuffer:
    """The session's staging buffer: a sealed memfd mapped here and, once sent
    (OpenStaging), in the daemon; large reads and writes go through its two
    halves so that only offsets travel over gRPC. One staged copy at a time."""

    def __init__(self, size: int, service: _Service, session: ClientSession) -> None:
        self.size = size
        self._service = service
        self._session = session
        self._map: Optional[mmap.mmap] = None
        self._lock = threading.Lock()
        # The daemon refused the buffer for its uid's budget: this client streams from then on.
        self.refused = False

    def _mapped(self) -> mmap.mmap:
        """Raises StagingRefused when the daemon refuses the buffer (now or before)."""
        if self.refused:
            raise StagingRefused("an earlier OpenStaging was refused BUDGET_EXCEEDED")
        if self._map is None:
            fd = sealed_memfd("vmmd:staging", self.size)
            try:
                staging = mmap.mmap(fd, self.size, access=mmap.ACCESS_WRITE)
                try:
                    self._service.unary("OpenStaging", transfer_id=int(self._session.send_descriptor(fd)))
                except VmmdError as error:
                    staging.close()
                    if error.code == "BUDGET_EXCEEDED":
                        self.refused = True
                        raise StagingRefused(str(error)) from error
                    raise
                except BaseException:
                    staging.close()
                    raise
            finally:
                os.close(fd)
            self._map = staging
        return self._map

    def read(self, address: int, length: int, into: Optional[memoryview] = None, timeout: Optional[float] = None) -> memoryview:
        """Copies `length` bytes at `address` out of the daemon's memory: the
        daemon fills one half while this process copies the other out."""
        with self._lock:
            staging = memoryview(self._mapped())
            half = self.size // 2
            out = into if into is not None else memoryview(bytearray(length))
            pending: Optional[_Future] = self._service.unary_future("ReadStaged", address=address, length=min(half, length), staging_offset=0, timeout=timeout)
            offset, slot = 0, 0
            try:
                while offset < length:
                    count = min(half, length - offset)
                    assert pending is not None
                    pending.result()
                    pending = None
                    following = offset + count
                    if following < length:
                        pending = self._service.unary_future("ReadStaged", address=address + following, length=min(half, length - following), staging_offset=(1 - slot) * half, timeout=timeout)
                    out[offset:following] = staging[slot * half : slot * half + count]
                    offset, slot = following, 1 - slot
            finally:
                if pending is not None:  # a copy still in flight must finish before the buffer is reused
                    try:
                        pending.result()
                    except VmmdError:
                        pass
                staging.release()
            return out

    def write(self, address: int, data: memoryview, timeout: Optional[float] = None) -> None:
        """Copies `data` into the daemon's memory at `address`: this process
        fills one half while the daemon copies the other in."""
        with self._lock:
            staging = memoryview(self._mapped())
            half = self.size // 2
            in_flight: List[Optional[_Future]] = [None, None]
            offset, slot = 0, 0
            try:
                while offset < data.nbytes:
                    count = min(half, data.nbytes - offset)
                    # A half is free again once the daemon's copy out of it is done.
                    if in_flight[slot] is not None:
                        in_flight[slot].result()  # type: ignore[union-attr]
                    staging[slot * half : slot * half + count] = data[offset : offset + count]
                    in_flight[slot] = self._service.unary_future("WriteStaged", address=address + offset, length=count, staging_offset=slot * half, timeout=timeout)
                    offset, slot = offset + count, 1 - slot
            finally:
                for future in in_flight:
                    if future is not None:
                        future.result()
                staging.release()

    def close(self) -> None:
        with self._lock:
            if self._map is not None:
                self._map.close()
                self._map = None
