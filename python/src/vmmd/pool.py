"""The client-side pool (client/emm/pool.ts in Python): chunks leased from
the daemon, mapped here once, carved into blocks. Requests round up to a size
class (multiples of 256 bytes, then steps of a quarter of the power of two
below them, so at most 25% is lost to rounding); a block comes from the first
chunk with a free run long enough; freed blocks coalesce with free neighbours
at once. Requests above the large threshold get an allocation of their own.

Reuse of device memory is stream-ordered (_stream_order.py): a block freed
on a stream is reused at once only by the same stream, by others once the
work queued before its free is done. A stream given as an object (CuPy's
Stream: its handle in `.ptr`) is kept alive by the block until that is
known, so that the event that says so is never recorded on a stream
destroyed meanwhile; a bare handle must stay valid that long. Memory goes back to the daemon on trim()
(CuPy's free_all_blocks, Numba's reset) and by itself once the pool has been
idle for `idle_seconds` (VMMD_POOL_IDLE_SECONDS, default 10; 0 never).

A pool carries a tag ("default" unless given): sleep() gives its physical
memory back while every address stays reserved (offloaded to the daemon's
host memory or discarded, _sleep.py), wake() maps new memory at the same
addresses; pools() finds a process's pools by tag.

Frees may come from finalizers and __del__ at any moment, on any thread, even
while this thread is inside the pool: they are queued and applied under the
lock by the next call that holds it, so a finalizer never blocks, never
re-enters the pool's structures and never touches the driver."""
from __future__ import annotations

import bisect
import collections
import threading
import time
import weakref
from typing import Any, Deque, Dict, List, Optional, Tuple

from . import _sleep
from ._sleep import Segment
from ._stream_order import StreamOrder
from ._pool_chunk import Chunk, size_class
from ._pool_idle import REAPER as _REAPER, idle_seconds_setting
from .errors import STATUS, VmmdError

DEFAULT_TAG = "default"


def check_tag(tag: Any) -> str:
    """Raises VmmdError INVALID_ARGUMENT BAD_TAG."""
    if not isinstance(tag, str) or not tag:
        raise VmmdError("BAD_TAG", STATUS["INVALID_ARGUMENT"], f"tag {tag!r}: a tag is a non-empty string")
    return tag


def pools(tag: Optional[str] = None) -> List["DevicePool"]:
    """This process's open pools tagged `tag` (None: all)."""
    return [pool for pool in list(_POOLS) if not pool._closed and (tag is None or pool.tag == tag)]


class Block:
    """Memory handed out by the pool: `address`, `size` (the request), where
    it lies (`chunk`, `offset`; a large block has a chunk of its own), and the
    `stream` whose work uses it (None: not known) and, given as an object, the
    object that keeps that stream alive (`stream_owner`)."""

    __slots__ = ("address", "size", "rounded", "chunk", "offset", "large", "stream", "stream_owner", "__weakref__")

    def __init__(self, chunk: Chunk, offset: int, size: int, rounded: int, large: bool, stream: Optional[int] = None) -> None:
        self.chunk = chunk
        self.offset = offset
        self.address = chunk.base + offset
        self.size = size
        self.rounded = rounded
        self.large = large
        self.stream = stream
        self.stream_owner: Any = None

    @property
    def allocation_id(self) -> int:
        return int(self.chunk.memory.allocation_id)


class DevicePool:
    """Pooled vmmd memory for one device of one client: allocate() and free()
    blocks; chunks come from client.vmm.allocate() and go back to the daemon on
    trim(), close(), or with the session when the process ends."""

    def __init__(self, client: Any, device: int = 0, chunk_size: int = 32 << 20, large_threshold: int = 16 << 20, location: Optional[Dict[str, Any]] = None, idle_seconds: Optional[float] = None, tag: str = DEFAULT_TAG, retain_copies: bool = False, prepare_copies: bool = False) -> None:
        self.client = client
        self.tag = check_tag(tag)
        # Keep the host copies of offloaded memory after wake, for the next sleep (_sleep.py).
        self.retain_copies = retain_copies
        # Make each chunk's host copy ahead, as it is leased, and keep it while awake (_sleep.prepare): the
        # first offload costs the copy alone. Host memory as large as the pool is held meanwhile.
        self.prepare_copies = prepare_copies
        # The sleep record of each chunk (by base) and attached store (by address) that has slept.
        self._segments: Dict[int, Segment] = {}
        # Invariant: None while awake; asleep, one segment per chunk of _chunks, _large and _idle_large, nothing else held.
        self._sleeping: Optional[List[Segment]] = None
        # Opened stores whose mappings sleep and wake with the pool (never copied).
        self._stores: List[Any] = []
        self.device = device
        self.location = location if location is not None else {"type": "LOCATION_TYPE_DEVICE", "id": device}
        granularity = int(client.devices.get_granularity(location=self.location).minimum)
        self.granularity = granularity
        self.chunk_size = -(-chunk_size // granularity) * granularity
        self.large_threshold = min(large_threshold, self.chunk_size)
        self._lock = threading.Lock()
        # Invariant: chunks sorted by base, never overlapping; large ones are not in it.
        self._chunks: List[Chunk] = []
        self._bases: List[int] = []
        self._large: Dict[int, Chunk] = {}
        # Large allocations freed and kept for reuse (by lease size) until trim().
        self._idle_large: List[Chunk] = []
        # Bytes of idle large allocations above which the next allocate() trims (a free never does: it may run in a finalizer).
        self.max_idle_bytes = 4 * self.chunk_size
        # Frees not yet applied: (block, stream it was freed on).
        self._returned: Deque[Tuple[Block, Optional[int]]] = collections.deque()
        # Device blocks freed and not yet safe for every stream.
        self._order = StreamOrder(device)
        self._closed = False
        self.counters = collections.Counter()  # type: ignore[var-annotated]
        self.idle_seconds = idle_seconds_setting(idle_seconds)
        self._last_use = time.monotonic()
        if self.idle_seconds > 0:
            _REAPER.watch(self)
        _POOLS.add(self)

    # -- allocation --------------------------------------------------------

    def allocate(self, size: int, stream: Any = None) -> Block:
        """A block of at least `size` bytes, 256-byte aligned, for work on
        `stream` (a CUstream handle, or an object holding one in `.ptr` that the
        block keeps alive until its free is settled; None: any stream, so only
        memory whose earlier work is done). Raises VmmdError INVALID_ARGUMENT
        ZERO_SIZE, BAD_STREAM; RESOURCE_EXHAUSTED when even after returning
        empty chunks the daemon has no room."""
        if stream is None or type(stream) is int:
            return self._allocate(size, stream)
        owner, handle = _stream_of(stream)
        block = self._allocate(size, handle)
        block.stream_owner = owner
        return block

    def _allocate(self, size: int, stream: Optional[int]) -> Block:
        if not isinstance(size, int) or size <= 0:
            raise VmmdError("ZERO_SIZE", STATUS["INVALID_ARGUMENT"], f"pool allocation of {size!r} bytes: the size must be an integer above 0")
        if self._closed:
            raise VmmdError("POOL_CLOSED", STATUS["FAILED_PRECONDITION"], "the pool was closed: its memory went back to the daemon")
        if self._sleeping is not None:
            raise VmmdError("ASLEEP", STATUS["FAILED_PRECONDITION"], f"the pool tagged {self.tag!r} is asleep: wake() it before allocating")
        rounded = size_class(size)
        large = rounded > self.large_threshold
        lease = -(-size // self.granularity) * self.granularity if large else self.chunk_size
        self._last_use = time.monotonic()
        with self._lock:
            self._drain()
            self.counters["allocate"] += 1
            block = self._reuse(size, rounded, large, lease, stream)
            if block is None and len(self._order):
                # Memory freed on other streams whose work is done; never a wait here (streams
                # would run one after the other): more is leased, and out of memory waits (trim).
                self._give_safe(self._order.settle(wait=False))
                block = self._reuse(size, rounded, large, lease, stream)
            if block is not None:
                return block
            idle = sum(chunk.size for chunk in self._idle_large)
        if idle > self.max_idle_bytes:
            self.trim()
        # No room: lease (outside the lock: a daemon round trip).
        memory = self._lease(lease)
        chunk = Chunk(memory, int(memory.address), int(memory.size))
        if self.prepare_copies:
            segment = Segment(memory, self.location)
            with self._lock:
                self._segments[chunk.base] = segment
            _sleep.prepare(self.client, [segment])
        with self._lock:
            if large:
                chunk.take(chunk.size)
                self._large[chunk.base] = chunk
                self.counters["large"] += 1
                return Block(chunk, 0, size, chunk.size, True, stream)
            index = bisect.bisect_left(self._bases, chunk.base)
            self._chunks.insert(index, chunk)
            self._bases.insert(index, chunk.base)
            self.counters["chunks_leased"] += 1
            offset = chunk.take(rounded)
            assert offset is not None
            return Block(chunk, offset, size, rounded, False, stream)

    def _reuse(self, size: int, rounded: int, large: bool, lease: int, stream: Optional[int]) -> Optional[Block]:
        # Invariant: called with the lock held. A block the same stream freed first, then free space.
        held = self._order.take(stream, lease if large else rounded) if len(self._order) else None
        if held is not None:
            self.counters["same_stream_reused"] += 1
            if held.large:
                self._large[held.chunk.base] = held.chunk
            return Block(held.chunk, held.offset, size, held.rounded, held.large, stream)
        if not large:
            for chunk in self._chunks:
                offset = chunk.take(rounded)
                if offset is not None:
                    self.counters["pooled"] += 1
                    return Block(chunk, offset, size, rounded, False, stream)
            return None
        for index, chunk in enumerate(self._idle_large):
            if chunk.size == lease:
                del self._idle_large[index]
                self._large[chunk.base] = chunk
                self.counters["large_reused"] += 1
                return Block(chunk, 0, size, chunk.size, True, stream)
        return None

    def _give_safe(self, blocks: List[Block]) -> None:
        # Invariant: called with the lock held; the blocks' work is done on every stream.
        for block in blocks:
            if block.large:
                self._idle_large.append(block.chunk)
            else:
                block.chunk.give(block.offset, block.rounded)

    def _lease(self, size: int) -> Any:
        try:
            return self.client.vmm.allocate(size, location=self.location)
        except VmmdError as error:
            if not error.out_of_memory:
                raise
            # Give back what is cached (blocks held for their streams once the device is done with them) and
            # try once more, as Numba and CuPy do.
            self.counters["out_of_memory_retries"] += 1
            if self.trim() == 0:
                raise
            return self.client.vmm.allocate(size, location=self.location)

    def free(self, block: Block, stream: Any = ...) -> None:
        """Gives a block back, freed in the order of `stream` (default: the
        stream it was allocated for; None: not known). Safe from finalizers and
        __del__: queued, applied by whoever holds the lock next, never blocking,
        never calling the driver. After close() it does nothing: the memory
        went back with the pool. A stream object (`.ptr`) is kept alive by the
        block until the free is settled. Raises VmmdError BAD_STREAM."""
        if self._closed:
            return
        self._last_use = time.monotonic()
        if stream is not ...:
            owner, handle = _stream_of(stream)
            if owner is not None:
                block.stream_owner = owner
            stream = handle
        self._returned.append((block, block.stream if stream is ... else stream))
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        # Invariant: called with the lock held.
        while self._returned:
            block, stream = self._returned.popleft()
            self.counters["frees"] += 1
            if block.large and self._large.pop(block.chunk.base, None) is None:
                raise VmmdError("DOUBLE_FREE", STATUS["FAILED_PRECONDITION"], f"pool: the large block at 0x{block.address:x} was freed twice")
            if getattr(block.chunk.memory, "is_device_memory", False):
                # Kernels queued before the free may still use it: reused in stream order.
                self._order.device = block.chunk.memory.device
                if not self._order.hold(block, stream):
                    raise VmmdError("DOUBLE_FREE", STATUS["FAILED_PRECONDITION"], f"pool: the block at 0x{block.address:x} was freed twice")
                continue
            self._give_safe([block])

    # -- lookup ------------------------------------------------------------

    def lookup(self, address: int) -> Optional[Tuple[Chunk, int]]:
        """The chunk that holds `address` and the offset in it, if any."""
        with self._lock:
            index = bisect.bisect_right(self._bases, address) - 1
            if index >= 0:
                chunk = self._chunks[index]
                if address < chunk.base + chunk.size:
                    return chunk, address - chunk.base
            for chunk in self._large.values():
                if chunk.base <= address < chunk.base + chunk.size:
                    return chunk, address - chunk.base
        return None

    def share_key(self, chunk: Chunk) -> str:
        """The Share key of a chunk's allocation (asked of the daemon once)."""
        if chunk.share_key is None:
            chunk.share_key = str(self.client.vmm.share(allocation_id=int(chunk.memory.allocation_id)).share_key)
        return chunk.share_key

    # -- giving memory back ------------------------------------------------

    def trim(self) -> int:
        """Returns every empty chunk and idle large allocation to the daemon;
        returns the bytes given back. Asleep, those freed meanwhile go without
        waking: their offloaded copies are released and their ranges freed.
        Not from a finalizer (it calls the daemon and, on cuda, the driver)."""
        with self._lock:
            if self._sleeping is not None:
                return self._trim_asleep()
            empty = self._take_empty()
            self._release(empty)
        return sum(chunk.size for chunk in empty)

    def _take_empty(self) -> List[Chunk]:
        # Invariant: called with the lock held. The chunks with no block in use and the idle large
        # allocations, taken out of the pool (blocks held for their streams settled first).
        self._drain()
        if len(self._order):
            self._give_safe(self._order.settle_all())
        empty = [chunk for chunk in self._chunks if chunk.blocks == 0]
        for chunk in empty:
            index = self._chunks.index(chunk)
            del self._chunks[index]
            del self._bases[index]
        empty += self._idle_large
        self._idle_large = []
        return empty

    def _trim_asleep(self) -> int:
        # Invariant: called with the lock held, asleep. The sleep waited for the device and nothing may touch
        # asleep memory, so blocks held for their streams are free for every stream.
        empty = self._take_empty()
        if not empty:
            return 0
        bases = {chunk.base for chunk in empty}
        assert self._sleeping is not None
        self._sleeping = [segment for segment in self._sleeping if int(segment.memory.address) not in bases]
        # Their allocations went with the sleep: the copies go, and the ranges (nothing mapped) are freed here.
        _sleep.forget(self.client, [self._segments.pop(base) for base in bases if base in self._segments])
        for chunk in empty:
            chunk.memory.close()
            self.counters["chunks_returned"] += 1
        return sum(chunk.size for chunk in empty)

    def close(self) -> None:
        """Returns everything to the daemon, blocks in use too (reset)."""
        with self._lock:
            self._closed = True
            self._returned.clear()
            self._order.drop()
            chunks = self._chunks + list(self._large.values()) + self._idle_large
            self._chunks, self._bases, self._large, self._idle_large = [], [], {}, []
            sleeping, self._sleeping = self._sleeping, None
            _sleep.forget(self.client, list(self._segments.values()))
            self._segments = {}
            if sleeping is not None:
                # Nothing is mapped: the copies went back to the daemon, the ranges are freed here (the stores' opens went at sleep).
                for chunk in chunks:
                    chunk.memory.close()
                for store in self._stores:
                    store.memory.close()
                    store._closed = True
                return
            self._release(chunks)

    def _release(self, chunks: List[Chunk]) -> None:
        if not chunks:
            return
        _sleep.forget(self.client, [self._segments.pop(chunk.base) for chunk in chunks if chunk.base in self._segments])
        if getattr(chunks[0].memory, "is_device_memory", False):
            from . import _cuda

            # Work queued on the memory must be done before it is unmapped.
            _cuda.synchronize(chunks[0].memory.device)
        # A mapping that cannot close (a view of it still alive) is not released: its memory stays mapped and held; the others go back.
        unmapped: List[Chunk] = []
        failed: List[VmmdError] = []
        for chunk in chunks:
            try:
                chunk.memory.close()
            except VmmdError as error:
                failed.append(error)
                continue
            self.counters["chunks_returned"] += 1
            unmapped.append(chunk)
        # One round trip for them all: every release is sent before any answer is waited for.
        try:
            results = self.client.vmm.release_many([int(chunk.memory.allocation_id) for chunk in unmapped]) if unmapped else []
        except VmmdError as error:
            if error.code != "SESSION_LOST":
                raise
            results = []
        failed += [result for result in results if isinstance(result, VmmdError) and result.code != "SESSION_LOST"]
        if failed:
            raise failed[0]

    # -- sleep and wake ----------------------------------------------------

    @property
    def asleep(self) -> bool:
        return self._sleeping is not None

    def attach_store(self, store: Any) -> None:
        """Makes an opened store's mapping (client.stores.open) sleep and wake
        with the pool: unmapped and its open dropped at sleep, opened and
        mapped at the same address at wake; never copied.
        Raises VmmdError FAILED_PRECONDITION ASLEEP, CLOSED."""
        store.memory._check_open()
        with self._lock:
            if self._sleeping is not None:
                raise VmmdError("ASLEEP", STATUS["FAILED_PRECONDITION"], f"the pool tagged {self.tag!r} is asleep: attach stores while it is awake")
            self._stores.append(store)

    def sleep(self, mode: str = _sleep.OFFLOAD) -> int:
        """Gives the pool's physical memory back, every address kept: empty
        chunks go back as trim() gives them, the rest sleeps (`offload`: the
        contents kept in the daemon's host memory; `discard`: dropped). Blocks,
        pointers and arrays stay valid but must not be touched until wake().
        Returns the bytes put to sleep. Raises VmmdError INVALID_ARGUMENT BAD_SLEEP_MODE,
        FAILED_PRECONDITION ASLEEP, POOL_CLOSED; OUT_OF_MEMORY (no host memory for the copies: still awake)."""
        _sleep.check_mode(mode)
        if self._closed:
            raise VmmdError("POOL_CLOSED", STATUS["FAILED_PRECONDITION"], "the pool was closed: its memory went back to the daemon")
        if self._sleeping is not None:
            raise VmmdError("ASLEEP", STATUS["FAILED_PRECONDITION"], f"the pool tagged {self.tag!r} is already asleep")
        self.trim()
        with self._lock:
            segments = [self._segments.setdefault(chunk.base, Segment(chunk.memory, self.location)) for chunk in self._chunks + list(self._large.values())]
            segments += [self._segments.setdefault(store.memory.address, Segment(store.memory, store=store)) for store in self._stores]
            _sleep.sleep(self.client, segments, mode)
            for chunk in self._chunks + list(self._large.values()):
                chunk.share_key = None  # a key names an allocation, and the allocation is gone
            self._sleeping = segments
            self.counters["sleeps"] += 1
        return sum(segment.memory.size for segment in segments)

    def wake(self, timeout: Optional[float] = None) -> int:
        """Maps new memory at every address the pool held and copies offloaded
        contents back; returns the bytes woken (0 when awake). `timeout`: how long
        the daemon may hold the wake for memory that another process's sleep frees.
        Raises VmmdError RESOURCE_EXHAUSTED OUT_OF_MEMORY (still asleep and intact), POOL_CLOSED."""
        if self._closed:
            raise VmmdError("POOL_CLOSED", STATUS["FAILED_PRECONDITION"], "the pool was closed: its memory went back to the daemon")
        with self._lock:
            if self._sleeping is None:
                return 0
            _sleep.wake(self.client, self._sleeping, timeout, retain=self.retain_copies)
            woken = sum(segment.memory.size for segment in self._sleeping)
            self._sleeping = None
            self.counters["wakes"] += 1
            self._last_use = time.monotonic()
        return woken

    def stats(self) -> Dict[str, int]:
        with self._lock:
            # Blocks freed and held for their stream are not in use: they count as held.
            held_blocks, held_bytes = self._order.held_in_chunks()
            return {
                "chunks": len(self._chunks),
                "bytes": sum(c.size for c in self._chunks),
                "used": sum(c.used for c in self._chunks) - held_bytes,
                "blocks": sum(c.blocks for c in self._chunks) - held_blocks,
                "large": len(self._large),
                "large_bytes": sum(c.size for c in self._large.values()),
                "idle_large_bytes": sum(c.size for c in self._idle_large),
                "pending_frees": len(self._returned),
                "stream_held_bytes": self._order.bytes,
                # Host copies made ahead and held for the next offload (prepare_copies), and those being made.
                "prepared_bytes": 0 if self._sleeping is not None else sum(int(s.copy.size) for s in self._segments.values() if s.copy is not None),
                "prepare_pending": sum(1 for s in self._segments.values() if s.pending is not None),
            }

    @property
    def prepare_error(self) -> Optional[BaseException]:
        """Why making a chunk's host copy ahead failed (its next offload makes the copy itself), if it did."""
        with self._lock:
            return next((s.prepare_error for s in self._segments.values() if s.prepare_error is not None), None)

    def trim_if_idle(self) -> int:
        """trim() when nothing was allocated or freed for `idle_seconds` and
        there is something to give back; returns the bytes given back."""
        if self._closed or self._sleeping is not None or self.idle_seconds <= 0 or time.monotonic() - self._last_use < self.idle_seconds:
            return 0
        with self._lock:
            holding = bool(self._returned or len(self._order) or self._idle_large or any(chunk.blocks == 0 for chunk in self._chunks))
        if not holding:
            return 0
        self.counters["idle_trims"] += 1
        return self.trim()


def _stream_of(stream: Any) -> Tuple[Any, Optional[int]]:
    """(the object that keeps the stream alive, or None; the CUstream handle, or None) of a stream argument.
    Raises VmmdError INVALID_ARGUMENT BAD_STREAM."""
    if stream is None or (isinstance(stream, int) and not isinstance(stream, bool)):
        return None, stream
    handle = getattr(stream, "ptr", None)
    if isinstance(handle, int) and not isinstance(handle, bool):
        return stream, handle
    raise VmmdError("BAD_STREAM", STATUS["INVALID_ARGUMENT"], f"stream {stream!r}: a CUstream handle (an int), an object holding one in .ptr (CuPy's Stream), or None")


_POOLS: "weakref.WeakSet[DevicePool]" = weakref.WeakSet()
