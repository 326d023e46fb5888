"""The C allocation library that PyTorch's pluggable allocator loads
(_torch_allocator.c): where it is, building it when needed, and its functions'
types."""
from __future__ import annotations

import ctypes
import os
from typing import Optional

from ._compile import shared_library
from .errors import STATUS, VmmdError

HERE = os.path.dirname(os.path.abspath(__file__))


def library_path() -> str:
    """The built allocation library (vmmd._compile: built with the host's C compiler on first use, then cached).
    Raises VmmdError NO_COMPILER."""
    return shared_library(os.path.join(HERE, "_torch_allocator.c"))


def load(path: Optional[str] = None) -> ctypes.CDLL:
    """The library (library_path(), or `path`), its functions typed (their
    calls release the GIL: the refill thread waits in vmmd_next_request
    without holding it)."""
    library = ctypes.CDLL(path or library_path())
    u64, pointer = ctypes.c_uint64, ctypes.c_void_p
    library.vmmd_set_driver.argtypes = [pointer] * 5
    library.vmmd_configure.argtypes = [ctypes.c_double, u64, ctypes.c_double]
    library.vmmd_counters.argtypes = [ctypes.POINTER(u64)]
    library.vmmd_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, pointer]
    library.vmmd_torch_malloc.restype = pointer
    library.vmmd_torch_free.argtypes = [pointer, ctypes.c_ssize_t, ctypes.c_int, pointer]
    library.vmmd_add_chunk.argtypes = [ctypes.c_int, u64, u64]
    library.vmmd_refill_failed.argtypes = [ctypes.c_int]
    library.vmmd_next_request.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(u64), ctypes.c_double]
    library.vmmd_add_tagged_chunk.argtypes = [ctypes.c_int, ctypes.c_int, u64, u64]
    library.vmmd_refill_failed_tag.argtypes = [ctypes.c_int, ctypes.c_int]
    library.vmmd_next_tagged_request.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int), ctypes.POINTER(u64), ctypes.c_double]
    library.vmmd_set_tag.argtypes = [ctypes.c_int]
    library.vmmd_set_asleep.argtypes = [ctypes.c_int, ctypes.c_int]
    library.vmmd_set_asleep.restype = u64
    library.vmmd_take_empty_chunk.argtypes = [ctypes.c_int, ctypes.c_double, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(u64), ctypes.POINTER(u64)]
    return library


def driver_events() -> tuple:
    """The driver's event functions (cuEventCreate, cuEventRecord, cuEventQuery,
    cuEventSynchronize, cuEventDestroy) as addresses, for vmmd_set_driver."""
    cuda = ctypes.CDLL("libcuda.so.1")
    names = ("cuEventCreate", "cuEventRecord", "cuEventQuery", "cuEventSynchronize", ("cuEventDestroy_v2", "cuEventDestroy"))
    found = []
    for name in names:
        for candidate in (name if isinstance(name, tuple) else (name,)):
            if hasattr(cuda, candidate):
                found.append(ctypes.cast(getattr(cuda, candidate), ctypes.c_void_p).value)
                break
        else:
            raise VmmdError("NO_CUDA", STATUS["FAILED_PRECONDITION"], f"libcuda.so.1 has no {name}")
    return tuple(found)
