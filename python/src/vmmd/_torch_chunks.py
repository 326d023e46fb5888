"""The chunks behind vmmd's PyTorch MemPool, kept by a thread of this package:
it leases and maps chunks for the C library that PyTorch calls
(_torch_allocator.c) before and when a malloc needs them, and gives back the
chunks with nothing in use: at once those PyTorch emptied (empty_cache(), a
MemPool destroyed), after `idle_seconds` those unused since they were leased.

The thread waits inside the C library without the GIL and never calls into
PyTorch: PyTorch's allocator mutex is held while malloc waits for it, and a
thread of PyTorch holding the GIL may wait for that mutex. Nothing here
imports torch, so the host tests drive it through the C library alone."""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import _sleep
from ._sleep import Segment
from ._values import seconds_setting
from .pool import Chunk, DevicePool, idle_seconds_setting
from .errors import STATUS, VmmdError

NEXT_TICK, NEXT_REFILL, NEXT_RETURN, NEXT_STOP = range(4)
TAKE_FREED, TAKE_IDLE = range(2)
REFILL_SECONDS = 5.0
# Share of the held chunks kept free ahead of need.
AHEAD_FRACTION = 0.25
COUNTERS = ("mallocs", "frees", "same_stream_reused", "stream_waits", "refill_waits", "refill_timeouts", "refill_failures", "unknown_frees")


def refill_seconds_setting(value: Optional[float]) -> float:
    """How long a malloc waits for a chunk: `value`, else VMMD_TORCH_REFILL_SECONDS, else REFILL_SECONDS.
    Raises VmmdError INVALID_ARGUMENT BAD_REFILL_SECONDS."""
    return seconds_setting(value, "VMMD_TORCH_REFILL_SECONDS", REFILL_SECONDS, keyword="refill_seconds", code="BAD_REFILL_SECONDS", what="refill wait", zero_allowed=False)


class ChunkSupply:
    """Leases chunks for the C library from per-device pools (`pool_for(device)`,
    device as PyTorch numbers it) and takes them back; `locate` finds the
    chunk of an address. One per loaded library."""

    def __init__(self, library: Any, pool_for: Callable[[int], DevicePool], chunk_size: int, idle_seconds: Optional[float] = None, refill_seconds: Optional[float] = None) -> None:
        self.library = library
        self._pool_for = pool_for
        self.chunk_size = chunk_size
        self.idle_seconds = idle_seconds_setting(idle_seconds)
        # Invariant: every chunk the C library holds, by base, with the pool that leased it and its tag.
        self._chunks: Dict[int, Tuple[DevicePool, Chunk, int]] = {}
        # Tags whose chunks are asleep, with the client their pools lease from and their segments; a refill
        # for one of them fails (PyTorch's out of memory).
        self._asleep: Dict[int, Tuple[Any, List[Segment]]] = {}
        # CUDA graph captures under way: no chunk goes back meanwhile (a give-back synchronizes the
        # device, which a capture in global mode refuses and is invalidated by).
        self.captures = 0
        # The sleep record of every chunk that has slept, by base; with `retain`, its host copy stays after wake.
        self._segments: Dict[int, Segment] = {}
        self.retain = False
        # Tag numbers whose chunks get their host copies made ahead as they are leased (_sleep.prepare).
        self.prepared_tags: set = set()
        self._lock = threading.Lock()
        self.errors: List[BaseException] = []
        # Room ahead (half a chunk, the largest malloc and a quarter of what is held): most mallocs never wait for this thread.
        library.vmmd_configure(refill_seconds_setting(refill_seconds), chunk_size // 2, AHEAD_FRACTION)
        self._thread = threading.Thread(target=self._run, name="vmmd-torch-chunks", daemon=True)
        self._thread.start()

    def add(self, device: int, wanted: int, tag: int = 0) -> Chunk:
        """Leases and maps a chunk of at least `wanted` bytes for `device` and `tag` and hands it to the C library.
        Raises VmmdError ASLEEP for a tag asleep (also one that fell asleep while the chunk was leased: it goes back)."""
        if tag in self._asleep:
            raise VmmdError("ASLEEP", STATUS["FAILED_PRECONDITION"], f"tag number {tag} is asleep: no memory is allocated for it until it wakes")
        pool = self._pool_for(device)
        size = max(pool.chunk_size, -(-wanted // pool.granularity) * pool.granularity)
        memory = pool._lease(size)
        chunk = Chunk(memory, int(memory.address), int(memory.size))
        segment: Optional[Segment] = None
        # The check, the record and the hand-over under one lock: a sleep marks its tag under it and then collects
        # the tag's chunks, and prepare() reads the prepared tags under it, so a chunk is either one they see or
        # one that sees them, never a chunk awake in the C library for a tag asleep nor two records of one chunk.
        with self._lock:
            asleep = tag in self._asleep
            if not asleep:
                self._chunks[chunk.base] = (pool, chunk, tag)
                added = self.library.vmmd_add_tagged_chunk(device, tag, chunk.base, chunk.size) == 0
                if not added:
                    del self._chunks[chunk.base]
                elif tag in self.prepared_tags:
                    segment = self._segments.setdefault(chunk.base, Segment(chunk.memory, pool.location))
        if asleep or not added:
            pool._release([chunk])
            if asleep:
                raise VmmdError("ASLEEP", STATUS["FAILED_PRECONDITION"], f"tag number {tag} fell asleep while a chunk was leased for it: the chunk went back")
            raise VmmdError("NO_MEMORY", STATUS["RESOURCE_EXHAUSTED"], "the allocation library could not record a chunk (out of host memory)")
        if segment is not None:
            _sleep.prepare(pool.client, [segment])
        return chunk

    def give_back(self, mode: int) -> int:
        """Takes the chunks the C library lets go (TAKE_FREED or TAKE_IDLE) back to the daemon; returns the bytes."""
        device, base, size = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_uint64()
        taken: Dict[int, Tuple[DevicePool, List[Chunk]]] = {}
        while True:
            # The take and the pop under one lock: a sleep that marks a tag asleep between them would
            # otherwise find a chunk this is giving back (it marks first, then collects under this lock).
            with self._lock:
                if not self.library.vmmd_take_empty_chunk(mode, ctypes.c_double(self.idle_seconds), ctypes.byref(device), ctypes.byref(base), ctypes.byref(size)):
                    break
                pool, chunk, _ = self._chunks.pop(base.value)
                segment = self._segments.pop(chunk.base, None)
            if segment is not None:
                _sleep.forget(pool.client, [segment])
            taken.setdefault(id(pool), (pool, []))[1].append(chunk)
        total = 0
        for pool, chunks in taken.values():
            # _release synchronizes the device first: the held blocks' work may still run.
            pool._release(chunks)
            total += sum(chunk.size for chunk in chunks)
        return total

    def locate(self, address: int) -> Optional[Tuple[DevicePool, Chunk, int]]:
        with self._lock:
            for pool, chunk, _ in self._chunks.values():
                if chunk.base <= address < chunk.base + chunk.size:
                    return pool, chunk, address - chunk.base
        return None

    def counters(self) -> Dict[str, int]:
        values = (ctypes.c_uint64 * len(COUNTERS))()
        self.library.vmmd_counters(values)
        with self._lock:
            held = sum(chunk.size for _, chunk, _ in self._chunks.values())
            asleep = sum(segment.memory.size for _, segments in self._asleep.values() for segment in segments)
        return {**dict(zip(COUNTERS, (int(v) for v in values))), "chunks": len(self._chunks), "bytes": held, "asleep_bytes": asleep}

    def prepare(self, tag: int) -> None:
        """Makes the host copies of `tag`'s chunks ahead from now on: those held now and every one leased later."""
        with self._lock:
            self.prepared_tags.add(tag)
            if tag in self._asleep:
                return  # its copies are made at wake
            held = [(pool, self._segments.setdefault(chunk.base, Segment(chunk.memory, pool.location))) for pool, chunk, chunk_tag in self._chunks.values() if chunk_tag == tag]
        for pool, segment in held:
            _sleep.prepare(pool.client, [segment])

    def asleep(self, tag: int) -> bool:
        return tag in self._asleep

    def sleep(self, tag: int, mode: str) -> int:
        """Puts the chunks of `tag` to sleep (`offload` or `discard`, _sleep.py); returns their bytes.
        Raises VmmdError BAD_SLEEP_MODE, ASLEEP, OUT_OF_MEMORY (no host memory for the copies: still awake)."""
        _sleep.check_mode(mode)
        with self._lock:
            if tag in self._asleep:
                raise VmmdError("ASLEEP", STATUS["FAILED_PRECONDITION"], f"tag number {tag} is already asleep")
            # Marked first: from here no malloc carves from them and the refill thread gives none of them back.
            self._asleep[tag] = (None, [])
        self.library.vmmd_set_asleep(tag, 1)
        try:
            with self._lock:
                tagged = [(pool, chunk) for pool, chunk, chunk_tag in self._chunks.values() if chunk_tag == tag]
                segments = [self._segments.setdefault(chunk.base, Segment(chunk.memory, pool.location)) for pool, chunk in tagged]
            client = tagged[0][0].client if tagged else None
            _sleep.sleep(client, segments, mode)
        except BaseException:
            with self._lock:
                del self._asleep[tag]
            self.library.vmmd_set_asleep(tag, 0)
            raise
        with self._lock:
            self._asleep[tag] = (client, segments)
            for _, chunk in tagged:
                chunk.share_key = None
        return sum(segment.memory.size for segment in segments)

    def wake(self, tags: Sequence[int], timeout: Optional[float] = None) -> int:
        """Maps new memory at the addresses of the chunks of every tag in
        `tags`, asked of the daemon in one request, and copies offloaded
        contents back; returns the bytes.
        Raises VmmdError NOT_ASLEEP (nothing done), OUT_OF_MEMORY (all still asleep and intact)."""
        with self._lock:
            missing = [tag for tag in tags if tag not in self._asleep]
            segments = [segment for tag in tags for segment in self._asleep.get(tag, (None, []))[1]]
            clients = [self._asleep[tag][0] for tag in tags if tag in self._asleep and self._asleep[tag][0] is not None]
        if missing:
            raise VmmdError("NOT_ASLEEP", STATUS["FAILED_PRECONDITION"], f"tag number {missing[0]} is not asleep")
        _sleep.wake(clients[0] if clients else None, segments, timeout, retain=self.retain)
        with self._lock:
            for tag in tags:
                del self._asleep[tag]
        for tag in tags:
            self.library.vmmd_set_asleep(tag, 0)
        return sum(segment.memory.size for segment in segments)

    def stop(self) -> None:
        """Stops the thread (mallocs fail from now on); the chunks stay with the session."""
        self.library.vmmd_stop()
        self._thread.join(10)

    def _run(self) -> None:
        device, tag, wanted = ctypes.c_int(), ctypes.c_int(), ctypes.c_uint64()
        tick = ctypes.c_double(min(1.0, self.idle_seconds / 4) if self.idle_seconds > 0 else 1.0)
        while True:
            kind = self.library.vmmd_next_tagged_request(ctypes.byref(device), ctypes.byref(tag), ctypes.byref(wanted), tick)
            if kind == NEXT_STOP:
                return
            try:
                # Emptied chunks first: their memory may be what the refill needs.
                if not self.captures:
                    self.give_back(TAKE_FREED)
                if kind == NEXT_TICK and self.idle_seconds > 0 and not self.captures:
                    self.give_back(TAKE_IDLE)
            except BaseException as error:  # noqa: BLE001 - the thread must live on; kept for stats and tests
                self.errors.append(error)
            if kind == NEXT_REFILL:
                try:
                    self.add(device.value, int(wanted.value), tag.value)
                except BaseException as error:  # noqa: BLE001 - the waiting malloc gets NULL: PyTorch's out of memory
                    self.errors.append(error)
                    self.library.vmmd_refill_failed_tag(device.value, tag.value)
