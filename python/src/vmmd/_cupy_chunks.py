"""The chunks behind vmmd's CuPy allocator when it runs in C
(_cupy_allocator.c through cupy.cuda.memory.CFunctionAllocator): the library
carves blocks from chunks that this module leases, maps and hands over, and
takes them back on trim() (CuPy's free_all_blocks) or once a chunk has been
idle for `idle_seconds`.

CuPy calls the C malloc holding the GIL; when it finds no room it answers
NULL at once and the Python function CuPy really calls (`Carver.malloc`)
leases a chunk on the caller's thread and asks again: no thread waits for
another. Out of memory first makes every held block free for every stream
and gives empty chunks back (after synchronizing the device, as CuPy's pool
frees its cache), then is raised there as the OutOfMemoryError CuPy's
callers catch. One carver per process: the C
library's state is the process's, and the chunks must outlive every array
carved from them, so the carver is never dropped. Nothing here imports cupy:
the host tests drive it through the library alone."""
from __future__ import annotations

import collections
import ctypes
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _cuda, _sleep
from ._sleep import Segment
from ._compile import shared_library
from .errors import STATUS, VmmdError
from ._pool_idle import REAPER, idle_seconds_setting
from .pool import Chunk, DevicePool

HERE = os.path.dirname(os.path.abspath(__file__))
TAKE_IDLE = 1
# The C library's counters (those of _torch_allocator.c, as this library uses them).
COUNTERS = ("mallocs", "frees", "same_stream_reused", None, "no_room", None, None, "unknown_frees")
# Times a malloc leases and asks again before it gives up (other threads may take the room between).
GROW_ATTEMPTS = 4


def library_path() -> str:
    """The built library (vmmd._compile: built with the host's C compiler on first use, then cached).
    Raises VmmdError NO_COMPILER."""
    return shared_library(os.path.join(HERE, "_cupy_allocator.c"), includes=(os.path.join(HERE, "_torch_allocator.c"),))


def load(path: Optional[str] = None) -> ctypes.CDLL:
    """The library (library_path(), or `path`), its functions typed."""
    library = ctypes.CDLL(path or library_path())
    u64, pointer = ctypes.c_uint64, ctypes.c_void_p
    library.vmmd_counters.argtypes = [ctypes.POINTER(u64)]
    library.vmmd_cupy_configure.argtypes = [pointer, u64]
    library.vmmd_cupy_size_class.argtypes = [u64]
    library.vmmd_cupy_size_class.restype = u64
    library.vmmd_cupy_malloc.argtypes = [pointer, ctypes.c_size_t, ctypes.c_int]
    library.vmmd_cupy_malloc.restype = pointer
    library.vmmd_cupy_free.argtypes = [pointer, pointer, ctypes.c_int]
    library.vmmd_cupy_add_chunk.argtypes = [ctypes.c_int, u64, u64, ctypes.c_int]
    library.vmmd_cupy_stats.argtypes = [ctypes.c_int, ctypes.POINTER(u64)]
    library.vmmd_cupy_release_held.restype = u64
    library.vmmd_set_asleep.argtypes = [ctypes.c_int, ctypes.c_int]
    library.vmmd_set_asleep.restype = u64
    library.vmmd_take_empty_chunk.argtypes = [ctypes.c_int, ctypes.c_double, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(u64), ctypes.POINTER(u64)]
    return library


def function_address(library: ctypes.CDLL, name: str) -> int:
    return int(ctypes.cast(getattr(library, name), ctypes.c_void_p).value or 0)


class Carver:
    """Chunks for the C library, leased from per-device pools (`pool_for(device)`,
    device as CuPy numbers it). `large_threshold` as DevicePool's: a larger request
    gets a chunk of its own size when none has room. `allocate(size)` is the C path
    (CFunctionAllocator's malloc: an object whose `.ptr` is 0 when there was no
    room); `device()` the device it allocates on. `malloc` is what CuPy calls.
    `prepare_copies` as DevicePool's: each chunk's host copy made ahead as it is
    leased and kept while awake, so the first offload costs the copy alone."""

    def __init__(self, library: Any, pool_for: Callable[[int], DevicePool], allocate: Callable[[int], Any], device: Callable[[], int], large_threshold: int, idle_seconds: Optional[float] = None, stream_getter: int = 0, prepare_copies: bool = False) -> None:
        self.library = library
        self._pool_for = pool_for
        self._allocate = allocate
        self._device = device
        self.large_threshold = large_threshold
        self.idle_seconds = idle_seconds_setting(idle_seconds)
        library.vmmd_cupy_configure(stream_getter or None, large_threshold)
        # Invariant: every chunk the C library holds, by base, with the pool that leased it.
        self._chunks: Dict[int, Tuple[DevicePool, Chunk]] = {}
        self._lock = threading.Lock()
        self.prepare_copies = prepare_copies
        # The sleep record of each chunk (by base) that has slept or has its copy made ahead; it goes with its chunk.
        self._segments: Dict[int, Segment] = {}
        self.counters = collections.Counter()  # type: ignore[var-annotated]
        # Invariant: None while awake; asleep, one segment per chunk the C library holds (all marked asleep there).
        self._sleeping: Optional[List[Segment]] = None
        self._sleep_lock = threading.Lock()
        self._sleep_client: Any = None
        if self.idle_seconds > 0:
            REAPER.watch(self)
        slow = self._malloc_slowly

        def malloc(size: int) -> Any:
            # CuPy's allocation: a closure, no attribute lookups; Python beyond this only to lease.
            memory = allocate(size)
            if memory.ptr or not size:
                return memory
            return slow(size)

        self.malloc = malloc

    def _malloc_slowly(self, size: int) -> Any:
        """A chunk leased here for a request the C path had no room for, and the C path again.
        Raises VmmdError RESOURCE_EXHAUSTED (a MemoryError, CuPy's OutOfMemoryError) when even after
        freeing what is held the daemon has no room."""
        if self._sleeping is not None:
            raise VmmdError("ASLEEP", STATUS["FAILED_PRECONDITION"], "vmmd's CuPy allocator is asleep: wake() it before allocating")
        device = self._device()
        for _ in range(GROW_ATTEMPTS):
            try:
                self.grow(device, size)
            except VmmdError as error:
                if not error.out_of_memory:
                    raise
                # What is cached goes back (held blocks free for every stream, empty chunks to the daemon), as CuPy does.
                self.counters["out_of_memory_retries"] += 1
                given = self.trim()
                memory = self._allocate(size)
                if memory.ptr:
                    return memory
                if given == 0:
                    raise
                self.grow(device, size)
            memory = self._allocate(size)
            if memory.ptr:
                return memory
        raise VmmdError("OUT_OF_MEMORY", STATUS["RESOURCE_EXHAUSTED"], f"CuPy allocation of {size} bytes: other threads took each chunk leased for it ({GROW_ATTEMPTS} times)")

    def grow(self, device: int, size: int) -> Chunk:
        """Leases and maps a chunk where a request of `size` bytes fits and hands it to the C library.
        Raises VmmdError RESOURCE_EXHAUSTED when even after giving back cached chunks the daemon has no room."""
        pool = self._pool_for(device)
        rounded = int(self.library.vmmd_cupy_size_class(size))
        own = rounded > self.large_threshold
        lease = -(-rounded // pool.granularity) * pool.granularity if own else pool.chunk_size
        memory = pool.client.vmm.allocate(lease, location=pool.location)
        chunk = Chunk(memory, int(memory.address), int(memory.size))
        segment = Segment(memory, pool.location) if self.prepare_copies else None
        with self._lock:
            self._chunks[chunk.base] = (pool, chunk)
            if segment is not None:
                self._segments[chunk.base] = segment
        if self.library.vmmd_cupy_add_chunk(device, chunk.base, chunk.size, int(own)) != 0:
            with self._lock:
                del self._chunks[chunk.base]
                self._segments.pop(chunk.base, None)
            pool._release([chunk])
            raise VmmdError("NO_MEMORY", STATUS["RESOURCE_EXHAUSTED"], "the allocation library could not record a chunk (out of host memory)")
        if segment is not None:
            _sleep.prepare(pool.client, [segment])
        self.counters["chunks_leased" if not own else "large"] += 1
        return chunk

    def trim(self) -> int:
        """Makes every held block free for every stream and returns every chunk with nothing in use
        to the daemon, once the devices' work is done; returns the bytes given back (none while asleep)."""
        if self._sleeping is not None:
            return 0
        self.library.vmmd_cupy_mark_held()
        with self._lock:
            devices = {chunk.memory.device for _, chunk in self._chunks.values() if getattr(chunk.memory, "is_device_memory", False)}
        for device in devices:
            _cuda.synchronize(device)
        self.library.vmmd_cupy_release_held()
        self.library.vmmd_cupy_stamp(1)
        return self._give_back(1e-9)

    def trim_if_idle(self) -> int:
        """Returns the chunks unused for `idle_seconds`; returns the bytes."""
        if self.idle_seconds <= 0:
            return 0
        self.library.vmmd_cupy_stamp(0)
        given = self._give_back(self.idle_seconds)
        if given:
            self.counters["idle_trims"] += 1
        return given

    def _give_back(self, idle: float) -> int:
        device, base, size = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_uint64()
        taken: Dict[int, Tuple[DevicePool, List[Chunk]]] = {}
        while self.library.vmmd_take_empty_chunk(TAKE_IDLE, ctypes.c_double(idle), ctypes.byref(device), ctypes.byref(base), ctypes.byref(size)):
            with self._lock:
                pool, chunk = self._chunks.pop(base.value)
                segment = self._segments.pop(chunk.base, None)
            if segment is not None:
                # Its copy (made ahead) goes with it, one still being made included.
                _sleep.forget(pool.client, [segment])
            taken.setdefault(id(pool), (pool, []))[1].append(chunk)
        if taken:
            self.library.vmmd_cupy_reindex()
        total = 0
        for pool, chunks in taken.values():
            # _release synchronizes the device first: the held blocks' work may still run.
            pool._release(chunks)
            total += sum(chunk.size for chunk in chunks)
        return total

    @property
    def asleep(self) -> bool:
        return self._sleeping is not None

    def sleep(self, mode: str = _sleep.OFFLOAD) -> int:
        """Gives the chunks' physical memory back, every address kept (DevicePool.sleep's contract):
        empty chunks go back as trim() gives them, the rest sleeps. Returns the bytes put to sleep.
        Raises VmmdError INVALID_ARGUMENT BAD_SLEEP_MODE, FAILED_PRECONDITION ASLEEP; OUT_OF_MEMORY
        (no host memory for the copies: still awake)."""
        _sleep.check_mode(mode)
        with self._sleep_lock:
            if self._sleeping is not None:
                raise VmmdError("ASLEEP", STATUS["FAILED_PRECONDITION"], "vmmd's CuPy allocator is already asleep")
            self.trim()
            # No malloc carves from them from now on; one that finds no room raises ASLEEP.
            self._sleeping = []
            self.library.vmmd_set_asleep(0, 1)
            with self._lock:
                held = list(self._chunks.values())
                segments = [self._segments.setdefault(chunk.base, Segment(chunk.memory, pool.location)) for pool, chunk in held]
            try:
                if segments:
                    _sleep.sleep(held[0][0].client, segments, mode)
            except BaseException:
                self.library.vmmd_set_asleep(0, 0)
                self._sleeping = None
                raise
            for _, chunk in held:
                chunk.share_key = None  # a key names an allocation, and the allocation is gone
            self._sleeping = segments
            self.counters["sleeps"] += 1
            self._sleep_client = held[0][0].client if held else None
        return sum(segment.memory.size for segment in segments)

    def wake(self, timeout: Optional[float] = None) -> int:
        """Maps new memory at every address the chunks held and copies offloaded contents back;
        returns the bytes woken (0 when awake). Raises VmmdError RESOURCE_EXHAUSTED OUT_OF_MEMORY
        (still asleep and intact)."""
        with self._sleep_lock:
            if self._sleeping is None:
                return 0
            if self._sleeping:
                _sleep.wake(self._sleep_client, self._sleeping, timeout)
            woken = sum(segment.memory.size for segment in self._sleeping)
            self.library.vmmd_set_asleep(0, 0)
            self._sleeping = None
            self.counters["wakes"] += 1
        return woken

    def stats(self, device: int) -> Dict[str, int]:
        """DevicePool.stats()'s keys for the chunks of `device`."""
        values = (ctypes.c_uint64 * 6)()
        self.library.vmmd_cupy_stats(device, values)
        chunks, held, used, blocks, stream_held, _ = (int(v) for v in values)
        pool = self._pool_for(device)
        with self._lock:
            segments = [self._segments[base] for base, (owner, _) in self._chunks.items() if base in self._segments and owner is pool]
        prepared = 0 if self._sleeping is not None else sum(int(s.copy.size) for s in segments if s.copy is not None)
        return {"chunks": chunks, "bytes": held, "used": used, "blocks": blocks, "large": 0, "large_bytes": 0, "idle_large_bytes": 0, "pending_frees": 0, "stream_held_bytes": stream_held,
                "prepared_bytes": prepared, "prepare_pending": sum(1 for s in segments if s.pending is not None)}

    @property
    def prepare_error(self) -> Optional[BaseException]:
        """Why making a chunk's host copy ahead failed (its next offload makes the copy itself), if it did."""
        with self._lock:
            return next((s.prepare_error for s in self._segments.values() if s.prepare_error is not None), None)

    def library_counters(self) -> Dict[str, int]:
        values = (ctypes.c_uint64 * len(COUNTERS))()
        self.library.vmmd_counters(values)
        return {name: int(value) for name, value in zip(COUNTERS, values) if name}
