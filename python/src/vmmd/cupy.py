"""CuPy arrays in vmmd memory, pooled:

    import vmmd.cupy
    vmmd.cupy.use()                # cupy.cuda.set_allocator(...) with a vmmd pool
    x = cupy.arange(10)            # lives in a chunk the session leased from vmmd

or, for one block of code, `with vmmd.cupy.using():`. Frees are CuPy's: a
block goes back to the pool when the last array using it is gone (reuse is
stream-ordered as with CuPy's own MemoryPool: a block is reused at once by
later work on the stream current when it was allocated, by other streams once
the work queued there before the free is done). The blocks are carved in C
(vmmd._cupy_native: CuPy's CFunctionAllocator, other streams reuse a block
once the device is synchronized) where a C compiler and CuPy's C API are
there, else by the pool in Python (also with native=False). free_all_blocks() gives what
the pool holds free back to the daemon; an idle pool does so by itself after
VMMD_POOL_IDLE_SECONDS.

sleep() gives the allocator's memory back to the daemon with every address
kept (arrays stay valid, untouched until wake()); wake() maps new memory at
the same addresses and copies back what was offloaded. With
prepare_copies=True each chunk's host copy is made ahead, as the chunk is
leased, and kept while awake (DevicePool's option): the first offload costs
the copy alone, for host memory as large as the pool held meanwhile.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional

import cupy

from . import _cupy_native
from .client import VmmdClient, shared_client
from .pool import DEFAULT_TAG, Block, DevicePool, check_tag


class _BlockOwner:
    """Keeps a block handed to CuPy; gives it back when CuPy drops it."""

    __slots__ = ("pool", "block")

    def __init__(self, pool: DevicePool, block: Block) -> None:
        self.pool = pool
        self.block = block

    def __del__(self) -> None:
        self.pool.free(self.block)


class VmmdAllocator:
    """An allocator for cupy.cuda.set_allocator: malloc(size) → MemoryPointer
    of vmmd memory. One pool per device, leased by `client` (default: this
    process's shared session); `idle_seconds` and `tag` as DevicePool's.
    `native`: blocks carved in C (vmmd._cupy_native) where it can run, else
    in Python. `prepare_copies` as DevicePool's: host copies for an offload
    sleep made ahead and kept while awake (`prepare_error`, and stats()'s
    `prepared_bytes` and `prepare_pending`, say how that goes)."""

    def __init__(self, client: Optional[VmmdClient] = None, chunk_size: int = 32 << 20, large_threshold: int = 16 << 20, idle_seconds: Optional[float] = None, tag: str = DEFAULT_TAG, native: bool = True, prepare_copies: bool = False) -> None:
        if client is None:
            client = shared_client()
        self.client = client
        self.tag = check_tag(tag)
        self._settings = (chunk_size, large_threshold, idle_seconds)
        self.prepare_copies = bool(prepare_copies)
        self._pools: Dict[int, DevicePool] = {}
        self._daemon_devices: Dict[str, int] = {d.uuid: int(d.index) for d in client.devices.list_devices().devices}
        self._carver = _cupy_native.carver(client, self.pool, chunk_size, large_threshold, idle_seconds, self.tag, self.prepare_copies) if native else None
        if self._carver is not None:
            # What CuPy calls: the C path, Python only to lease a chunk.
            self.malloc = self._carver.malloc  # type: ignore[method-assign]

    def pool(self, device: Optional[int] = None) -> DevicePool:
        device = cupy.cuda.runtime.getDevice() if device is None else device
        pool = self._pools.get(device)
        if pool is None:
            uuid = _device_uuid(device)
            pool = self._pools[device] = DevicePool(self.client, device=self._daemon_devices.get(uuid, device), chunk_size=self._settings[0], large_threshold=self._settings[1], idle_seconds=self._settings[2], tag=self.tag, prepare_copies=self.prepare_copies)
        return pool

    def malloc(self, size: int) -> Any:
        if size == 0:
            return cupy.cuda.MemoryPointer(cupy.cuda.memory.Memory(0), 0)
        device = cupy.cuda.runtime.getDevice()
        pool = self.pool(device)
        # Reused in the order of the stream current now, as CuPy's MemoryPool does; the Stream object, not its
        # handle: the block keeps the stream alive until its free is settled (an event is recorded on it then).
        block = pool.allocate(size, stream=cupy.cuda.get_current_stream())
        memory = cupy.cuda.UnownedMemory(block.address, size, _BlockOwner(pool, block), device_id=device)
        return cupy.cuda.MemoryPointer(memory, 0)

    __call__ = malloc

    def free_all_blocks(self) -> int:
        """Gives every empty chunk back to the daemon, once the work queued
        before the frees is done; returns the bytes."""
        return sum(pool.trim() for pool in self._pools.values()) + (self._carver.trim() if self._carver is not None else 0)

    def sleep(self, mode: str = "offload") -> int:
        """Puts every device's pool to sleep (DevicePool.sleep); returns the bytes.
        Raises VmmdError BAD_SLEEP_MODE, ASLEEP, OUT_OF_MEMORY (host memory for the copies)."""
        done: List[Any] = []
        total = 0
        try:
            sleepers: List[Any] = [*self._pools.values(), *([self._carver] if self._carver is not None else [])]
            for pool in sleepers:
                total += pool.sleep(mode)
                done.append(pool)
        except BaseException:
            for pool in done:
                pool.wake()
            raise
        return total

    def wake(self, timeout: Optional[float] = None) -> int:
        """Wakes every device's pool (DevicePool.wake); returns the bytes.
        Raises VmmdError OUT_OF_MEMORY (the pools not woken stay asleep and intact)."""
        return sum(pool.wake(timeout) for pool in self._pools.values()) + (self._carver.wake(timeout) if self._carver is not None else 0)

    @property
    def prepare_error(self) -> Optional[BaseException]:
        """Why making a chunk's host copy ahead failed (prepare_copies; the next offload makes that copy itself), if it did."""
        if self._carver is not None and self._carver.prepare_error is not None:
            return self._carver.prepare_error
        return next((pool.prepare_error for pool in self._pools.values() if pool.prepare_error is not None), None)

    def stats(self) -> Dict[int, Dict[str, int]]:
        if self._carver is not None:
            return {device: self._carver.stats(device) for device in self._pools}
        return {device: pool.stats() for device, pool in self._pools.items()}


def _device_uuid(device: int) -> str:
    try:
        raw = cupy.cuda.runtime.getDeviceProperties(device).get("uuid", b"")
        from ._cuda import format_uuid

        return format_uuid(bytes(raw)) if raw else ""
    except Exception:
        return ""


_allocator: Optional[VmmdAllocator] = None


def use(client: Optional[VmmdClient] = None, **settings: Any) -> VmmdAllocator:
    """Makes vmmd CuPy's allocator (cupy.cuda.set_allocator) and returns it."""
    global _allocator
    _allocator = VmmdAllocator(client, **settings)
    cupy.cuda.set_allocator(_allocator.malloc)
    return _allocator


@contextlib.contextmanager
def using(client: Optional[VmmdClient] = None, **settings: Any) -> Iterator[VmmdAllocator]:
    """vmmd as CuPy's allocator inside the block (cupy.cuda.using_allocator)."""
    allocator = VmmdAllocator(client, **settings)
    with cupy.cuda.using_allocator(allocator.malloc):
        yield allocator
