"""Stream-ordered reuse for the client-side pool, as CuPy's MemoryPool and
RMM's pool do it: a block freed on a stream goes back to the chunk's free
space (usable by any stream) only once the work queued on that stream before
the free is done; until then only allocations on the same stream may take it,
because their work runs after everything queued there before.

The event that says "done" is recorded lazily, when another stream needs the
memory (or the pool gives memory back): recorded later than the free, it
still follows all work queued before the free, and a free (which may run in a
finalizer) never calls the driver. Stream None stands for work whose stream
is not known (Numba's frees): its event goes on the legacy default stream,
which waits for every blocking stream of the context, and no allocation
reuses such a block before that event is done.

cuEventRecord on a destroyed stream is undefined (its handle may name
another stream by then, whose event says nothing of this work), so the
stream a held block names must outlive the block's stay here: a block keeps
its stream's owner object (CuPy's Stream) until it leaves, and a caller that
passes a bare handle keeps that stream alive as long. CuPy's own pool never
records on a stream after the free (a block goes to another stream only
after a synchronize); RMM records at the free itself; a free here may run in
a finalizer, which must not call the driver."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from . import _cuda


class StreamOrder:
    """The blocks of one device pool freed and not yet safe for every stream."""

    def __init__(self, device: int) -> None:
        self.device = device
        # Invariant: every block here is counted once in `bytes` and `addresses`; blocks
        # in `_waiting` have no event yet, blocks in `_settling` wait for their event.
        self._waiting: Dict[Optional[int], Dict[int, List[Any]]] = {}
        self._settling: List[Tuple[Any, List[Any]]] = []
        self.addresses: set = set()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.addresses)

    def hold(self, block: Any, stream: Optional[int]) -> bool:
        """Keeps a freed block; False when it is already held (freed twice)."""
        if block.address in self.addresses:
            return False
        self.addresses.add(block.address)
        self.bytes += block.rounded
        self._waiting.setdefault(stream, {}).setdefault(block.rounded, []).append(block)
        return True

    def take(self, stream: Optional[int], rounded: int) -> Optional[Any]:
        """A held block of exactly `rounded` bytes freed on `stream`: safe for
        work on that stream at once. None (unknown stream) never takes one."""
        if stream is None:
            return None
        by_size = self._waiting.get(stream)
        if not by_size:
            return None
        blocks = by_size.get(rounded)
        if not blocks:
            return None
        block = blocks.pop()
        if not blocks:
            del by_size[rounded]
        self._forget(block)
        return block

    def settle(self, wait: bool) -> List[Any]:
        """Records an event on each stream with blocks freed since the last
        one, and returns the blocks whose work is done (all of them when
        `wait`: it waits for the events), now safe for every stream."""
        for stream, by_size in self._waiting.items():
            blocks = [block for same in by_size.values() for block in same]
            try:
                event = _cuda.record_event(self.device, stream)
            except Exception:
                # The record refused (a handle the driver no longer knows): wait for the whole device instead.
                _cuda.synchronize(self.device)
                event = None
            self._settling.append((event, blocks))
        self._waiting = {}
        safe: List[Any] = []
        pending: List[Tuple[Any, List[Any]]] = []
        for event, blocks in self._settling:
            if event is not None:
                if wait:
                    _cuda.wait_event(event)
                elif not _cuda.event_done(event):
                    pending.append((event, blocks))
                    continue
                _cuda.destroy_event(event)
            safe += blocks
        self._settling = pending
        for block in safe:
            self._forget(block)
        return safe

    def held_in_chunks(self) -> Tuple[int, int]:
        """(blocks, bytes) held that are carved from shared chunks (not large ones)."""
        blocks = [block for by_size in self._waiting.values() for same in by_size.values() for block in same]
        blocks += [block for _, same in self._settling for block in same]
        small = [block for block in blocks if not block.large]
        return len(small), sum(block.rounded for block in small)

    def settle_all(self) -> List[Any]:
        """Every block, once the device has finished all its work (one
        cuCtxSynchronize covers every stream): for giving memory back."""
        _cuda.synchronize(self.device)
        blocks = [block for by_size in self._waiting.values() for same in by_size.values() for block in same]
        blocks += [block for _, same in self._settling for block in same]
        self.drop()
        return blocks

    def drop(self) -> None:
        """Forgets every block (their memory went back with the pool) and frees the events."""
        for event, _ in self._settling:
            if event is not None:
                _cuda.destroy_event(event)
        self.__init__(self.device)  # type: ignore[misc]

    def _forget(self, block: Any) -> None:
        self.addresses.discard(block.address)
        self.bytes -= block.rounded
