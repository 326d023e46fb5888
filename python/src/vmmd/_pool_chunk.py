"""A chunk of the client-side pool (pool.py): one lease of the daemon's
memory carved into blocks by first fit, its free runs kept sorted and
coalesced at once; and the size classes requests round up to."""
from __future__ import annotations

import bisect
from typing import Any, List, Optional

from .errors import STATUS, VmmdError

ALIGNMENT = 256


def size_class(size: int) -> int:
    """The size class of a request: what the pool really hands out for it."""
    if size <= ALIGNMENT:
        return ALIGNMENT
    power = 1 << ((size - 1).bit_length() - 1)
    step = max(ALIGNMENT, power // 4)
    return -(-size // step) * step


class Chunk:
    """One lease of the daemon's memory, carved into blocks."""

    __slots__ = ("memory", "base", "size", "free", "used", "blocks", "share_key")

    def __init__(self, memory: Any, base: int, size: int) -> None:
        self.memory = memory
        self.base = base
        self.size = size
        # Invariant: sorted by offset, inside [0, size), never overlapping nor touching.
        self.free: List[List[int]] = [[0, size]]
        self.used = 0
        self.blocks = 0
        self.share_key: Optional[str] = None

    def take(self, size: int) -> Optional[int]:
        for index, run in enumerate(self.free):
            if run[1] < size:
                continue
            offset = run[0]
            if run[1] == size:
                del self.free[index]
            else:
                run[0] += size
                run[1] -= size
            self.used += size
            self.blocks += 1
            return offset
        return None

    def give(self, offset: int, size: int) -> None:
        index = bisect.bisect_left(self.free, [offset, 0])
        before = self.free[index - 1] if index > 0 else None
        after = self.free[index] if index < len(self.free) else None
        if (before and before[0] + before[1] > offset) or (after and offset + size > after[0]):
            raise VmmdError("DOUBLE_FREE", STATUS["FAILED_PRECONDITION"], f"pool: [{offset}, +{size}) of a chunk at 0x{self.base:x} overlaps free space: freed twice?")
        joins_before = before is not None and before[0] + before[1] == offset
        joins_after = after is not None and offset + size == after[0]
        if joins_before and joins_after:
            before[1] += size + after[1]  # type: ignore[index]
            del self.free[index]
        elif joins_before:
            before[1] += size  # type: ignore[index]
        elif joins_after:
            after[0] = offset  # type: ignore[index]
            after[1] += size  # type: ignore[index]
        else:
            self.free.insert(index, [offset, size])
        self.used -= size
        self.blocks -= 1

    def check(self) -> None:
        """The invariant (tests): free runs sorted, apart, adding up with `used`."""
        total = 0
        for index, (offset, size) in enumerate(self.free):
            assert size > 0 and 0 <= offset and offset + size <= self.size, "a free run is out of its chunk"
            if index + 1 < len(self.free):
                assert offset + size < self.free[index + 1][0], "free runs overlap or touch"
            total += size
        assert total + self.used == self.size, f"free {total} + used {self.used} is not the chunk's {self.size}"
