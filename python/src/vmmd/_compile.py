"""A C source of the package built into a plain shared library with the
host's C compiler, once, into a cache (VMMD_CACHE_DIR, else ~/.cache/vmmd):
loaded with ctypes, so the wheel stays pure Python (py3-none-any) and the
library does not depend on the interpreter's ABI."""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile

from .errors import STATUS, VmmdError


# A plain shared library; the allocation library waits on condition variables (pthread).
BUILD_FLAGS = ("-shared", "-fPIC", "-O2", "-pthread")


def cache_dir() -> str:
    return os.environ.get("VMMD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "vmmd")


def shared_library(source: str, includes: tuple = ()) -> str:
    """The library built from `source` (and the files it `#include`s from the
    package, named in `includes`: they count in the cache key): from the cache, or built now with
    CC (default cc) into a temporary file renamed into place only once the
    build succeeded (a failed or interrupted build leaves nothing).
    Raises VmmdError FAILED_PRECONDITION NO_COMPILER when no compiler is
    found or the build fails (its message says which and how to fix it),
    NO_CACHE_DIR when the cache cannot be written."""
    compiler = shlex.split(os.environ.get("CC") or "cc")
    text = b""
    for path in (source, *includes):
        with open(path, "rb") as file:
            text += file.read()
    digest = hashlib.sha256(text + " ".join([*compiler, *BUILD_FLAGS]).encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(source))[0]
    directory = cache_dir()
    target = os.path.join(directory, f"{stem}-{digest}.so")
    if os.path.exists(target):
        return target
    if not compiler or shutil.which(compiler[0]) is None:
        raise VmmdError("NO_COMPILER", STATUS["FAILED_PRECONDITION"], f"no C compiler to build {os.path.basename(source)}: {compiler[0] if compiler else 'CC'!r} not found; install one (apt-get install gcc) or set CC to one")
    try:
        os.makedirs(directory, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=directory, prefix=f".{stem}-", suffix=".so.partial")
        os.close(handle)
    except OSError as error:
        raise VmmdError("NO_CACHE_DIR", STATUS["FAILED_PRECONDITION"], f"cannot write the build cache {directory}: {error.strerror or error}; set VMMD_CACHE_DIR to a writable directory") from None
    try:
        try:
            result = subprocess.run([*compiler, *BUILD_FLAGS, "-o", partial, source], capture_output=True, text=True)
        except OSError as error:
            raise VmmdError("NO_COMPILER", STATUS["FAILED_PRECONDITION"], f"running {compiler[0]} failed: {error.strerror or error}; install a C compiler or set CC") from None
        if result.returncode != 0:
            raise VmmdError("NO_COMPILER", STATUS["FAILED_PRECONDITION"], f"building {source} with {' '.join(compiler)} failed: {result.stderr.strip()[:500]}; install a working C compiler or set CC")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target
