"""Weights loaded once, used by many workers: a file copied into a named,
read-only store that the daemon keeps (it outlives the loading process), and
opened by any number of processes as arrays with zero copies.

    # once
    vmmd.weights.load_file("model.bin", "llama-8b")
    # in every worker
    store = vmmd.weights.open_store("llama-8b")
    w = vmmd.weights.as_torch(store, "float16", (n,))   # or as_cupy, as_numba
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Dict, Optional, Tuple

from .client import OpenedStore, VmmdClient, shared_client
from .errors import STATUS, VmmdError
from .memory import ArrayView, _typestr

# Bytes read from the file per copy.
COPY_BYTES = 64 << 20


def load_file(path: str, name: str, client: Optional[VmmdClient] = None, device: int = 0, read_only: bool = True, location: Optional[Dict[str, Any]] = None, timeout: Optional[float] = None) -> Any:
    """Copies the file at `path` into a new allocation of the daemon's (device
    memory on cuda, host memory on the host backend) and makes it a store
    called `name`, handed over to the daemon: it stays after this process
    ends, until someone detaches it. Returns the Store. `timeout`: each
    call to the daemon's (None: the client's deadline).
    Raises VmmdError NAME_TAKEN, OUT_OF_MEMORY…; OSError for the file."""
    client = client or shared_client()
    size = os.path.getsize(path)
    if size == 0:
        raise VmmdError("ZERO_SIZE", STATUS["INVALID_ARGUMENT"], f"{path} is empty: a store holds at least one byte")
    location = location or {"type": "LOCATION_TYPE_DEVICE", "id": device}
    granularity = int(client.devices.get_granularity(location=location, timeout=timeout).minimum)
    memory = client.vmm.allocate(-(-size // granularity) * granularity, location=location, timeout=timeout)
    try:
        buffer = bytearray(min(COPY_BYTES, size))
        view = memoryview(buffer)
        with open(path, "rb", buffering=0) as source:
            offset = 0
            while offset < size:
                count = source.readinto(view[: min(len(buffer), size - offset)])
                if not count:
                    raise VmmdError("FILE_CHANGED", STATUS["ABORTED"], f"{path} ended at {offset} bytes, not {size}")
                memory.write(offset, view[:count])
                offset += count
        if memory.is_device_memory:
            from . import _cuda

            _cuda.synchronize(memory.device)
        store = client.stores.create_store(allocation_id=memory.allocation_id, name=name, read_only=read_only, hand_over=True, size=size, timeout=timeout)
    except BaseException:
        memory.close()
        try:
            client.vmm.release(allocation_id=memory.allocation_id)
        except VmmdError:
            pass
        raise
    # The store holds the memory; this process's mapping and handle go.
    memory.close()
    client.vmm.release(allocation_id=memory.allocation_id, timeout=timeout)
    return store


def open_store(name: str, client: Optional[VmmdClient] = None, writable: bool = False, timeout: Optional[float] = None) -> OpenedStore:
    """Opens a store by name and maps it here (read-only unless `writable`)."""
    return (client or shared_client()).stores.open(name, writable=writable, timeout=timeout)


def _interface(store: OpenedStore, dtype: Any, shape: Optional[Tuple[int, ...]], offset: int) -> ArrayView:
    if shape is None:
        shape = ((store.size - offset) // _typestr(dtype)[1],)
    return store.memory.view(dtype, shape, offset)


def as_cupy(store: OpenedStore, dtype: Any = "|u1", shape: Optional[Tuple[int, ...]] = None, offset: int = 0) -> Any:
    """The store as a CuPy array (zero copies; the store must stay open)."""
    import cupy

    view = _interface(store, dtype, shape, offset)
    try:
        return cupy.asarray(view)
    except (ValueError, TypeError, NotImplementedError):
        # Where CuPy refuses the read-only flag: the pages stay read-only for the GPU.
        return cupy.asarray(_Writable(view))


def as_numba(store: OpenedStore, dtype: Any = "|u1", shape: Optional[Tuple[int, ...]] = None, offset: int = 0) -> Any:
    """The store as a Numba device array (zero copies; the store must stay open)."""
    from numba import cuda

    return cuda.as_cuda_array(_interface(store, dtype, shape, offset))


class _Writable:
    """A CUDA array interface that reports a read-only mapping writable:
    PyTorch refuses the read-only flag ("not supported"). The pages stay
    read-only for the GPU: a write faults instead of changing the weights."""

    def __init__(self, view: ArrayView) -> None:
        self._view = view

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        interface = dict(self._view.__cuda_array_interface__)
        interface["data"] = (interface["data"][0], False)
        return interface


def as_torch(store: OpenedStore, dtype: Any = "|u1", shape: Optional[Tuple[int, ...]] = None, offset: int = 0) -> Any:
    """The store as a PyTorch CUDA tensor (zero copies; the store must stay
    open). `dtype` is a numpy dtype or name ("float16"; "bfloat16" is read as
    int16 bits and viewed)."""
    import torch

    bfloat16 = str(dtype) == "bfloat16"
    view = _interface(store, "<i2" if bfloat16 else dtype, shape, offset)
    tensor = torch.as_tensor(_Writable(view), device=f"cuda:{store.memory.device}")
    return tensor.view(torch.bfloat16) if bfloat16 else tensor


def read_safetensors_header(store: OpenedStore) -> Tuple[Dict[str, Any], int]:
    """The header of a .safetensors file held in a store, and where its data
    starts: each entry's data_offsets are relative to that."""
    (length,) = struct.unpack("<Q", store.memory.read(0, 8))
    header = json.loads(store.memory.read(8, length))
    return header, 8 + length


_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "bfloat16", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "|i1", "U8": "|u1", "BOOL": "|b1"}


def safetensors_as_torch(store: OpenedStore) -> Dict[str, Any]:
    """Every tensor of a .safetensors file held in a store, as PyTorch CUDA
    tensors viewing the store (zero copies)."""
    header, start = read_safetensors_header(store)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, _ = entry["data_offsets"]
        tensors[name] = as_torch(store, _DTYPES[entry["dtype"]], tuple(entry["shape"]) or (1,), start + begin)
    return tensors
