"""PyTorch tensors in vmmd memory: a torch.cuda.MemPool whose segments come
from vmmd, through torch.cuda.memory.CUDAPluggableAllocator and a small C
library (_torch_allocator.c) that carves them from chunks leased ahead by a
thread of this package (_torch_chunks.py): PyTorch calls it under its
allocator mutex, so it never runs Python. torch.cuda.empty_cache() gives
the emptied chunks back to the daemon; unused ones go back after
VMMD_POOL_IDLE_SECONDS.

    pool = vmmd.torch.mem_pool()
    with torch.cuda.use_mem_pool(pool):
        model.to("cuda")                 # the weights live in vmmd memory
    spec = vmmd.torch.export_tensors(model.state_dict())   # picklable
    # in another process:
    tensors = vmmd.torch.import_tensors(spec)              # zero copies

Sleep and wake by tag (_torch_sleep.py): torch_memory_saver's API
(`from vmmd.torch import torch_memory_saver`: region, cuda_graph, pause,
resume) and vLLM's sleep mode (sleep(level), wake_up(tags)), also as this
module's functions.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Tuple

import torch

from . import _allocator_lib
from ._torch_chunks import ChunkSupply
from .client import VmmdClient, shared_client
from .errors import STATUS, VmmdError
from .memory import ImportedMemory
from .pool import DevicePool
from ._torch_sleep import TorchMemorySaver


class VmmdTorchAllocator:
    """The pluggable allocator: PyTorch's segments carved in C from per-device
    vmmd chunks. One per process (the C library's state is the process's):
    use allocator(). `idle_seconds` as DevicePool's; `refill_seconds` bounds
    how long a malloc waits for a chunk (VMMD_TORCH_REFILL_SECONDS, default 5)
    before PyTorch sees out of memory."""

    def __init__(self, client: Optional[VmmdClient] = None, chunk_size: int = 64 << 20, idle_seconds: Optional[float] = None, refill_seconds: Optional[float] = None) -> None:
        self.client = client or shared_client()
        self._chunk_size = chunk_size
        self._pools: Dict[int, DevicePool] = {}
        self._lock = threading.Lock()
        self._daemon_devices = {d.uuid: int(d.index) for d in self.client.devices.list_devices().devices}
        self._library = _allocator_lib.load()
        self._library.vmmd_set_driver(*_allocator_lib.driver_events())
        self.path = self._library._name
        self.supply = ChunkSupply(self._library, self.pool, chunk_size, idle_seconds, refill_seconds)
        # A first chunk of the current device now: the first tensors wait for no refill.
        self.supply.add(torch.cuda.current_device(), 1)
        self.pluggable = torch.cuda.memory.CUDAPluggableAllocator(self.path, "vmmd_torch_malloc", "vmmd_torch_free")

    def pool(self, device: int) -> DevicePool:
        """The pool that leases chunks for PyTorch's `device` (never called under PyTorch's mutex)."""
        with self._lock:
            pool = self._pools.get(device)
            if pool is None:
                uuid = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
                pool = self._pools[device] = DevicePool(self.client, device=self._daemon_devices.get(uuid, device), chunk_size=self._chunk_size, idle_seconds=0)
            return pool

    def locate(self, address: int) -> Tuple[int, int, str]:
        """(allocation id, offset, share key) of an address in vmmd memory this allocator handed out.
        Raises VmmdError NOT_FOUND NOT_VMMD_MEMORY."""
        found = self.supply.locate(address)
        if found is None:
            raise VmmdError("NOT_VMMD_MEMORY", STATUS["NOT_FOUND"], f"address 0x{address:x} is not in memory of the vmmd MemPool")
        pool, chunk, offset = found
        return int(chunk.memory.allocation_id), offset, pool.share_key(chunk)

    def stats(self) -> Dict[str, int]:
        return self.supply.counters()

    def sleep(self, mode: str = "offload") -> int:
        """Puts the memory of mem_pool() MemPools (outside every region) to
        sleep, every address kept; returns the bytes. Tagged regions sleep by
        torch_memory_saver.pause() or sleep(level).
        Raises VmmdError BAD_SLEEP_MODE, ASLEEP, OUT_OF_MEMORY (no host memory for the copies)."""
        return self.supply.sleep(0, mode)

    def wake(self, timeout: Optional[float] = None) -> int:
        """Wakes what sleep() put to sleep; returns the bytes. Raises VmmdError NOT_ASLEEP, OUT_OF_MEMORY (still asleep)."""
        return self.supply.wake([0], timeout)


_allocator: Optional[VmmdTorchAllocator] = None
_allocator_lock = threading.Lock()


def allocator(client: Optional[VmmdClient] = None, **settings: Any) -> VmmdTorchAllocator:
    """This process's vmmd allocator for PyTorch (made on first call)."""
    global _allocator
    with _allocator_lock:
        if _allocator is None:
            _allocator = VmmdTorchAllocator(client, **settings)
        return _allocator


def mem_pool(client: Optional[VmmdClient] = None, **settings: Any) -> Any:
    """A torch.cuda.MemPool backed by vmmd: inside torch.cuda.use_mem_pool(pool),
    PyTorch's allocations come from vmmd memory."""
    return torch.cuda.MemPool(allocator(client, **settings).pluggable.allocator())


def export_tensors(tensors: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """A picklable description of tensors that live in the vmmd MemPool (the
    allocation, offset and Share key of each), for import_tensors() in other
    processes. This process's session must stay open while they import."""
    if _allocator is None:
        raise VmmdError("NO_MEMPOOL", STATUS["FAILED_PRECONDITION"], "no vmmd MemPool in this process: make one with vmmd.torch.mem_pool()")
    spec = {}
    for name, tensor in tensors.items():
        if not tensor.is_cuda or not tensor.is_contiguous():
            raise VmmdError("NOT_SHAREABLE", STATUS["INVALID_ARGUMENT"], f"tensor {name!r} must be a contiguous CUDA tensor")
        allocation, offset, key = _allocator.locate(tensor.data_ptr())
        spec[name] = {"allocation": allocation, "offset": offset, "share_key": key, "dtype": str(tensor.dtype).replace("torch.", ""), "shape": list(tensor.shape)}
    return spec


class _Interface:
    def __init__(self, address: int, shape: Tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (address, False), "version": 3, "strides": None, "stream": None}


def import_tensors(spec: Dict[str, Dict[str, Any]], client: Optional[VmmdClient] = None, read_only: bool = False) -> Dict[str, Any]:
    """Tensors another process exported (export_tensors), mapped here with zero
    copies: each allocation is imported once. The mappings live as long as the
    returned dict's `_vmmd_memory` entries are kept (the dict keeps them)."""
    client = client or shared_client()
    memories: Dict[int, ImportedMemory] = {}
    tensors: Dict[str, Any] = {}
    for name, entry in spec.items():
        allocation = int(entry["allocation"])
        memory = memories.get(allocation)
        if memory is None:
            memory = memories[allocation] = client.vmm.import_(allocation, share_key=entry["share_key"], read_only=read_only)
        dtype = getattr(torch, entry["dtype"])
        element = torch.empty((), dtype=dtype).element_size()
        shape = tuple(entry["shape"])
        count = 1
        for extent in shape:
            count *= extent
        if int(entry["offset"]) + count * element > memory.size:
            raise VmmdError("BEYOND_ALLOCATION", STATUS["OUT_OF_RANGE"], f"tensor {name!r} lies outside allocation {allocation}")
        raw = torch.as_tensor(_Interface(memory.address + int(entry["offset"]), (count * element,), "|u1"), device=f"cuda:{memory.device}")
        tensors[name] = raw.view(dtype).view(shape)
    return _Tensors(tensors, memories)


class _Tensors(dict):
    """A dict of tensors that keeps the mappings they view."""

    def __init__(self, tensors: Dict[str, Any], memories: Dict[int, ImportedMemory]) -> None:
        super().__init__(tensors)
        self.memories = memories


# torch_memory_saver's singleton, and its calls as this module's functions.
torch_memory_saver = TorchMemorySaver()
region = torch_memory_saver.region
cuda_graph = torch_memory_saver.cuda_graph
pause = torch_memory_saver.pause
resume = torch_memory_saver.resume
disable = torch_memory_saver.disable
sleep = torch_memory_saver.sleep
wake_up = torch_memory_saver.wake_up
use_memory_pool = torch_memory_saver.use_memory_pool
