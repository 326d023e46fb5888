"""The C allocation library that PyTorch's pluggable allocator loads
(_torch_allocator.c): where it is, building it when needed, and the types of
the Python callbacks it calls."""
from __future__ import annotations

import ctypes
import os
import sys

from ._compile import shared_library

MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
HERE = os.path.dirname(os.path.abspath(__file__))


def library_path() -> str:
    """The built allocation library (vmmd._compile: built with the host's C compiler on first use, then cached).
    Raises VmmdError NO_COMPILER."""
    return shared_library(os.path.join(HERE, "_torch_allocator.c"))


def load(allocate, release):  # type: ignore[no-untyped-def]
    """Loads the library with `allocate(size, device, stream) -> address` and
    `release(pointer, size, device, stream)` as its callbacks; returns
    (path, library, callbacks) — keep the callbacks referenced."""
    path = library_path()
    library = ctypes.CDLL(path)

    # ctypes returns garbage when a callback raises: PyTorch must see NULL (its out of memory).
    def safe_allocate(size: int, device: int, stream: int) -> int:
        try:
            return int(allocate(size, device, stream) or 0)
        except BaseException as error:  # noqa: BLE001 - nothing may cross into C
            sys.stderr.write(f"vmmd: allocating {size} bytes on device {device} for PyTorch failed: {error}\n")
            return 0

    def safe_release(pointer: int, size: int, device: int, stream: int) -> None:
        try:
            release(pointer, size, device, stream)
        except BaseException as error:  # noqa: BLE001
            sys.stderr.write(f"vmmd: freeing 0x{pointer or 0:x} for PyTorch failed: {error}\n")

    callbacks = (MALLOC(safe_allocate), FREE(safe_release))
    library.vmmd_set_callbacks(*callbacks)
    return path, library, callbacks

