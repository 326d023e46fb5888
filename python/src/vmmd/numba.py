"""vmmd as Numba's memory manager (NBEP 7, interface version 1):

    NUMBA_CUDA_MEMORY_MANAGER=vmmd.numba python3 program.py

memalloc carves blocks from chunks the session leases from the daemon (a
client-side pool, vmmd.pool); pinned and mapped host memory stay Numba's own
(HostOnlyCUDAMemoryManager, as NBEP 7 recommends); get_memory_info asks the
daemon; get_ipc_handle names the allocation, the offset and a Share key in
the 64 bytes of a CUipcMemHandle, so that Numba's own open path
(IpcHandle.open, cuda.open_ipc_array) maps it in another process through the
daemon (the legacy cuIpc* API does not work on VMM memory). Frees go through
Numba's deferred deallocations and return blocks to the pool in pure Python:
a finalizer never calls the daemon or the driver.

sleep() gives the context's pool back to the daemon with every address kept
(device arrays stay valid, untouched until wake()); wake() maps new memory at
the same addresses and copies back what was offloaded.

With VMMD_NUMBA_PREPARE_COPIES=1 each chunk's host copy is made ahead, as
the chunk is leased, and kept while awake (DevicePool's prepare_copies): the
first offload costs the copy alone, for host memory as large as the pool held
meanwhile.

The daemon's socket directory comes from VMMD_SOCKET_DIR (or the default);
VMMD_NUMBA_CHUNK_BYTES and VMMD_NUMBA_LARGE_BYTES tune the pool.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Dict, Optional, Tuple

from . import _numba_check  # noqa: F401,I001 - first: ImportError naming the fix under Numba's built-in numba.cuda
from numba.cuda import HostOnlyCUDAMemoryManager, IpcHandle, MemoryInfo, MemoryPointer
from numba.cuda.cudadrv import driver as _driver

from .client import shared_client
from .errors import STATUS, VmmdError
from .ipc import decode_ipc_handle, encode_ipc_handle
from ._values import switch_setting
from .pool import Block, DevicePool

try:
    binding = _driver.binding  # numba-cuda: cuda.bindings.driver
except AttributeError:  # Numba's built-in CUDA target with its ctypes binding
    from cuda.bindings import driver as binding  # type: ignore[no-redef]


def _free_block(handle: Tuple[DevicePool, Block]) -> None:
    pool, block = handle
    pool.free(block)


def _pool_finalizer(manager: "VmmdNumbaMemoryManager", block: Block, size: int) -> Any:
    allocations = manager.allocations
    deallocations = manager.deallocations
    pool = manager.pool
    key = block.address

    # Pure Python: runs whenever the pointer dies (even after the context is
    # gone, or at exit), so it only queues the block for the pool.
    def core() -> None:
        if allocations:
            allocations.pop(key, None)
        deallocations.add_item(_free_block, (pool, block), size)

    return core



def _device_ordinal(device: Any) -> int:
    """The CUDA ordinal of a Numba context's device. Numba's own Device has `.id`;
    a context attached to a primary context made by someone else (Numba's
    Test3rdPartyContext) carries the cuda-bindings `CUdevice` itself, whose int()
    is the ordinal."""
    ordinal = getattr(device, "id", None)
    if ordinal is None:
        ordinal = int(device)
    return int(ordinal)

class VmmdNumbaMemoryManager(HostOnlyCUDAMemoryManager):
    """NBEP 7 memory manager over vmmd (see the module's documentation)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Numba makes one with context=None only to read interface_version: nothing is connected then.
        self._pool: Optional[DevicePool] = None
        self._daemon_device = 0
        self._lock = threading.Lock()

    @property
    def interface_version(self) -> int:
        return 1

    @property
    def pool(self) -> DevicePool:
        if self._pool is None:
            self.initialize()
        assert self._pool is not None
        return self._pool

    def initialize(self) -> None:
        with self._lock:
            if self._pool is not None:
                return
            client = shared_client()
            device = self.context.device
            uuid = getattr(device, "uuid", "")
            daemon_device = _device_ordinal(device)
            for candidate in client.devices.list_devices().devices:
                if uuid and candidate.uuid == uuid:
                    daemon_device = int(candidate.index)
            self._daemon_device = daemon_device
            self._pool = DevicePool(
                client,
                device=daemon_device,
                chunk_size=int(os.environ.get("VMMD_NUMBA_CHUNK_BYTES", 32 << 20)),
                large_threshold=int(os.environ.get("VMMD_NUMBA_LARGE_BYTES", 16 << 20)),
                prepare_copies=switch_setting("VMMD_NUMBA_PREPARE_COPIES", False, "host copies made ahead for an offload sleep"),
            )
        if self.deallocations.memory_capacity == _driver._SizeNotSet:
            self.deallocations.memory_capacity = self.get_memory_info().total

    def memalloc(self, size: int) -> Any:
        pool = self.pool
        try:
            block = pool.allocate(max(int(size), 1))
        except VmmdError as error:
            if not error.out_of_memory:
                raise
            # As Numba does: run the pending frees, give back what is cached, try once more.
            self.deallocations.clear()
            pool.trim()
            try:
                block = pool.allocate(max(int(size), 1))
            except VmmdError as again:
                if again.out_of_memory:
                    raise _driver.CudaAPIError(binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"vmmd: {again.message}") from again
                raise
        finalizer = _pool_finalizer(self, block, size)
        ctx = weakref.proxy(self.context)
        mem = _driver.AutoFreePointer(ctx, binding.CUdeviceptr(block.address), size, finalizer=finalizer)
        self.allocations[block.address] = mem
        return mem.own()

    def get_memory_info(self) -> Any:
        info = shared_client().devices.get_memory_info(device=self._daemon_device)
        return MemoryInfo(free=int(info.free_bytes), total=int(info.total_bytes))

    def get_ipc_handle(self, memory: Any) -> Any:
        pointer = int(memory.handle)
        found = self.pool.lookup(pointer)
        if found is None:
            # Not vmmd memory (allocated before this manager, or by another library): the driver's own IPC.
            return _driver.GetIpcHandleMixin.get_ipc_handle(self, memory)
        chunk, offset = found
        handle = binding.CUipcMemHandle()
        handle.reserved = encode_ipc_handle(int(chunk.memory.allocation_id), offset, self.pool.share_key(chunk))
        source_info = self.context.device.get_device_identity()
        return IpcHandle(memory, handle, memory.size, source_info, offset=0)

    def reset(self) -> None:
        # Pending frees run, Numba's own host allocations go; chunks with no
        # block in use go back to the daemon. Blocks still referenced stay
        # valid, as they do under Numba's own manager.
        super().reset()
        if self._pool is not None:
            self._pool.trim()

    def stats(self) -> Dict[str, int]:
        return {**self.pool.stats(), **dict(self.pool.counters)}

    def sleep(self, mode: str = "offload") -> int:
        """Runs the pending frees, then puts the pool to sleep (DevicePool.sleep); returns the bytes.
        Raises VmmdError BAD_SLEEP_MODE, ASLEEP, OUT_OF_MEMORY."""
        self.deallocations.clear()
        return self.pool.sleep(mode)

    def wake(self, timeout: Optional[float] = None) -> int:
        """Wakes the pool (DevicePool.wake); returns the bytes. Raises VmmdError OUT_OF_MEMORY (still asleep)."""
        return self.pool.wake(timeout)


def _manager() -> VmmdNumbaMemoryManager:
    from numba import cuda

    manager = cuda.current_context().memory_manager
    if not isinstance(manager, VmmdNumbaMemoryManager):
        raise VmmdError("NOT_VMMD_MEMORY", STATUS["NOT_FOUND"], f"the current context's memory manager is {type(manager).__name__}: set NUMBA_CUDA_MEMORY_MANAGER=vmmd.numba")
    return manager


def sleep(mode: str = "offload") -> int:
    """Puts the current context's vmmd pool to sleep (VmmdNumbaMemoryManager.sleep).
    Raises VmmdError NOT_FOUND NOT_VMMD_MEMORY when Numba does not use vmmd.numba."""
    return _manager().sleep(mode)


def wake(timeout: Optional[float] = None) -> int:
    """Wakes the current context's vmmd pool (VmmdNumbaMemoryManager.wake)."""
    return _manager().wake(timeout)


_numba_memory_manager = VmmdNumbaMemoryManager

# -- Numba's IPC open path for vmmd handles -----------------------------------
# Context.open_ipc_handle calls cuIpcOpenMemHandle, and _CudaIpcImpl.close
# cuIpcCloseMemHandle, on whatever 64 bytes the handle holds. A handle that
# names vmmd memory is opened through the daemon instead (Export with the
# Share key, then import and map here); every other handle goes to Numba.
# NOTE: wraps two Numba internals (numba-cuda 0.30): the IPC paths have no hook.

# Mappings opened through a vmmd IPC handle, by the pointer handed to Numba.
_opened: Dict[int, Any] = {}
_original_open = _driver.Context.open_ipc_handle
_original_close = _driver._CudaIpcImpl.close


def _open_ipc_handle(self: Any, handle: Any, size: int) -> Any:
    decoded = decode_ipc_handle(handle)
    if decoded is None:
        return _original_open(self, handle, size)
    allocation_id, offset, share_key = decoded
    memory = shared_client().vmm.import_(allocation_id, share_key=share_key)
    if offset + size > memory.size:
        memory.close()
        raise VmmdError("BEYOND_ALLOCATION", 11, f"an IPC handle of {size} bytes at offset {offset} is outside allocation {allocation_id} of {memory.size} bytes")
    pointer = memory.address + offset
    _opened[pointer] = memory
    return MemoryPointer(weakref.proxy(self), binding.CUdeviceptr(pointer), size)


def _close_ipc(self: Any) -> None:
    opened = self._opened_mem
    if opened is not None:
        memory = _opened.pop(int(opened.handle), None)
        if memory is not None:
            self._opened_mem = None
            if memory.is_device_memory:
                from . import _cuda

                _cuda.synchronize(memory.device)
            memory.close()
            return
    _original_close(self)


if not getattr(_driver.Context.open_ipc_handle, "_vmmd", False):
    _open_ipc_handle._vmmd = True  # type: ignore[attr-defined]
    _driver.Context.open_ipc_handle = _open_ipc_handle
    _driver._CudaIpcImpl.close = _close_ipc
