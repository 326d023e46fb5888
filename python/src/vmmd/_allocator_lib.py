"""The C allocation library that PyTorch's pluggable allocator loads
(_torch_allocator.c): where it is, building it when needed, and the types of
the Python callbacks it calls."""
from __future__ import annotations

import ctypes
import glob
import importlib.machinery
import os
import subprocess
import sys
import tempfile

from .errors import STATUS, VmmdError

MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
HERE = os.path.dirname(os.path.abspath(__file__))


def library_path() -> str:
    """The built allocation library: the one built on install, else one built
    now with the host's C compiler (cached under VMMD_CACHE_DIR or ~/.cache/vmmd)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        found = glob.glob(os.path.join(HERE, f"_torch_allocator{suffix}"))
        if found:
            return found[0]
    source = os.path.join(HERE, "_torch_allocator.c")
    cache = os.environ.get("VMMD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "vmmd")
    os.makedirs(cache, exist_ok=True)
    target = os.path.join(cache, f"_torch_allocator-{int(os.path.getmtime(source))}.so")
    if not os.path.exists(target):
        compiler = os.environ.get("CC", "cc")
        with tempfile.NamedTemporaryFile(dir=cache, suffix=".so", delete=False) as partial:
            pass
        result = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", partial.name, source], capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(partial.name)
            raise VmmdError("NO_COMPILER", STATUS["FAILED_PRECONDITION"], f"building {source} with {compiler} failed: {result.stderr.strip()[:500]}; reinstall vmmd with a C compiler present")
        os.replace(partial.name, target)
    return target


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

