"""vmmd's CuPy allocator in C: cupy.cuda.memory.CFunctionAllocator over the
library _cupy_allocator.c, its chunks kept by vmmd._cupy_chunks. Python runs
only when a chunk must be leased; the stream a block follows is read from
CuPy's C API (cupy.cuda.stream's get_current_stream_ptr capsule).

One C path per process (the library's state is the process's): the first
allocator that asks for it gets it, a later one with the same client and
settings shares it, any other runs in Python (vmmd.pool)."""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable, Optional, Tuple

import cupy

from . import _cupy_chunks
from .errors import VmmdError
from .pool import DevicePool

# The C signature Cython gives the capsule of `cdef intptr_t get_current_stream_ptr()`.
STREAM_GETTER_SIGNATURE = "intptr_t(void)"

_lock = threading.Lock()
# Invariant: set once, never dropped: the chunks must outlive every array carved from them.
_carver: Optional[_cupy_chunks.Carver] = None
_settings: Optional[Tuple[int, int, int, Optional[float], str, bool]] = None
# The client and CuPy's allocator object the carver uses, kept with it.
_kept: Tuple[Any, ...] = ()


def stream_getter() -> int:
    """The address of CuPy's C function that answers the current stream, or 0 where this CuPy has none."""
    capsule = getattr(cupy.cuda.stream, "__pyx_capi__", {}).get("get_current_stream_ptr")
    if capsule is None:
        return 0
    api = ctypes.PyDLL(None)
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    name = api.PyCapsule_GetName(capsule)
    if not name or not name.decode().replace(" ", "").startswith(STREAM_GETTER_SIGNATURE):
        return 0
    return int(api.PyCapsule_GetPointer(capsule, name) or 0)


def carver(client: Any, pool_for: Callable[[int], DevicePool], chunk_size: int, large_threshold: int, idle_seconds: Optional[float], tag: str, prepare_copies: bool = False) -> Optional[_cupy_chunks.Carver]:
    """The process's C path for these settings, made on first call; None where it
    cannot run here (no C compiler, no libcuda, a CuPy without the C API it
    needs) or another client or settings hold it."""
    global _carver, _settings, _kept
    settings = (id(client), chunk_size, large_threshold, idle_seconds, tag, prepare_copies)
    with _lock:
        if _carver is not None:
            return _carver if _settings == settings else None
        getter = stream_getter()
        if not getter:
            return None
        try:
            library = _cupy_chunks.load()
        except (VmmdError, OSError):
            return None
        native = cupy.cuda.memory.CFunctionAllocator(0, _cupy_chunks.function_address(library, "vmmd_cupy_malloc"), _cupy_chunks.function_address(library, "vmmd_cupy_free"), library)
        _carver = _cupy_chunks.Carver(library, pool_for, native.malloc, cupy.cuda.runtime.getDevice, min(large_threshold, chunk_size), idle_seconds, getter, prepare_copies)
        _settings, _kept = settings, (client, native)
        return _carver
