"""Memory mapped into this process from what the daemon exported: a memfd on
the host backend (shared pages, a memoryview), or CUDA memory mapped into this
process's CUDA context (a device pointer with __cuda_array_interface__)."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from .errors import STATUS, VmmdError


def local_map_failed(error: BaseException, read_only: bool) -> VmmdError:
    """Why mapping memory here failed, with the status that fits: memory sealed
    read-only (it backs a read-only store) refuses write access with EPERM or
    EACCES; running out of memory or map slots is RESOURCE_EXHAUSTED."""
    message = f"cannot map the exported memory here: {error}"
    code = getattr(error, "errno", None)
    if not read_only and code in (errno.EPERM, errno.EACCES):
        return VmmdError(
            "LOCAL_MAP_FAILED",
            STATUS["PERMISSION_DENIED"],
            f"{message} (the memory is sealed read-only: it backs a read-only store; import it with read_only=True)",
        )
    if code in (errno.ENOMEM, errno.EMFILE) or "OUT_OF_MEMORY" in str(error):
        return VmmdError("LOCAL_MAP_FAILED", STATUS["RESOURCE_EXHAUSTED"], message)
    return VmmdError("LOCAL_MAP_FAILED", STATUS["INTERNAL"], message)


def _typestr(dtype: Any) -> Tuple[str, int]:
    """(array-interface type string, item size) of a numpy dtype or a type string."""
    if isinstance(dtype, str) and dtype[:1] in "<>|=" and dtype[1:2].isalpha():
        return dtype, int(dtype[2:])
    import numpy

    d = numpy.dtype(dtype)
    return d.str, d.itemsize


class ImportedMemory:
    """An allocation mapped into this process. `address` is valid until
    close(): a host address on the host backend, a device pointer in this
    process's context on the cuda backend. Usable as a context manager."""

    def __init__(self, allocation_id: int, address: int, size: int, device: int, read_only: bool) -> None:
        self.allocation_id = allocation_id
        self.address = address
        self.size = size
        self.device = device
        self.read_only = read_only
        self._closed = False
        # Invariant: while asleep the range stays reserved at `address` with nothing mapped, and allocation_id is 0.
        self._asleep = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def asleep(self) -> bool:
        """Whether the memory was given back with its range kept (suspend()) and not mapped again yet."""
        return self._asleep

    def suspend(self) -> None:
        """Unmaps the memory here and keeps its address range reserved, so that
        resume() maps other memory at the same address; the caller releases
        the allocation. Work queued on the range must be done.
        Raises VmmdError FAILED_PRECONDITION CLOSED, ASLEEP."""
        self._check_open()
        self._suspend()
        self._asleep = True
        self.allocation_id = 0

    def resume(self, allocation_id: int, fd: int) -> None:
        """Maps the descriptor `fd` (of at least `size` bytes) at this memory's
        address, with its access as before; takes fd (closed here).
        Raises VmmdError FAILED_PRECONDITION NOT_ASLEEP, LOCAL_MAP_FAILED (still asleep then)."""
        if not self._asleep or self._closed:
            os.close(fd)
            raise VmmdError("NOT_ASLEEP", STATUS["FAILED_PRECONDITION"], f"the memory at 0x{self.address:x} is not asleep: only suspended memory maps again at its address")
        self._resume(fd)
        self._asleep = False
        self.allocation_id = allocation_id

    def _suspend(self) -> None:
        raise NotImplementedError

    def _resume(self, fd: int) -> None:
        raise NotImplementedError

    @property
    def is_device_memory(self) -> bool:
        return False

    @property
    def buffer(self) -> memoryview:
        """The mapped bytes (host backend, or host memory with host access).
        Raises VmmdError FAILED_PRECONDITION NO_HOST_VIEW for device memory, CLOSED."""
        self._check_open()
        raise VmmdError("NO_HOST_VIEW", STATUS["FAILED_PRECONDITION"], "device memory has no host view; use read() and write() or __cuda_array_interface__")

    def read(self, offset: int = 0, length: Optional[int] = None) -> bytes:
        """Copies `length` bytes at `offset` out of the memory.
        Raises VmmdError OUT_OF_RANGE BEYOND_ALLOCATION, FAILED_PRECONDITION CLOSED."""
        length = self.size - offset if length is None else length
        self._check_range(offset, length)
        return self._copy_out(offset, length)

    def write(self, offset: int, data: Any) -> None:
        """Copies bytes (any buffer) into the memory at `offset`.
        Raises VmmdError FAILED_PRECONDITION READ_ONLY, CLOSED; OUT_OF_RANGE BEYOND_ALLOCATION."""
        view = memoryview(data).cast("B")
        self._check_range(offset, view.nbytes)
        if self.read_only:
            raise VmmdError("READ_ONLY", STATUS["FAILED_PRECONDITION"], f"allocation {self.allocation_id} is mapped read-only here")
        self._copy_in(offset, view)

    def array_interface(self, dtype: Any = "|u1", shape: Optional[Tuple[int, ...]] = None, offset: int = 0) -> Dict[str, Any]:
        """The array-interface dict (version 3) of [offset, +shape*itemsize) as `dtype`."""
        self._check_open()
        typestr, itemsize = _typestr(dtype)
        if shape is None:
            shape = ((self.size - offset) // itemsize,)
        count = 1
        for extent in shape:
            count *= int(extent)
        self._check_range(offset, count * itemsize)
        return {"shape": tuple(int(s) for s in shape), "typestr": typestr, "data": (self.address + offset, self.read_only), "version": 3, "strides": None}

    def view(self, dtype: Any = "|u1", shape: Optional[Tuple[int, ...]] = None, offset: int = 0) -> "ArrayView":
        """A typed view of the memory: `__cuda_array_interface__` for device
        memory (CuPy, Numba, PyTorch take it with zero copies), `__array_interface__`
        for host memory (numpy)."""
        return ArrayView(self, self.array_interface(dtype, shape, offset))

    def close(self) -> None:
        """Unmaps the memory from this process."""
        raise NotImplementedError

    def __enter__(self) -> "ImportedMemory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _copy_out(self, offset: int, length: int) -> bytes:
        raise NotImplementedError

    def _copy_in(self, offset: int, data: memoryview) -> None:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise VmmdError("CLOSED", STATUS["FAILED_PRECONDITION"], f"allocation {self.allocation_id} was unmapped here")
        if self._asleep:
            raise VmmdError("ASLEEP", STATUS["FAILED_PRECONDITION"], f"the memory at 0x{self.address:x} is asleep: its range is reserved with nothing mapped until it wakes")

    def _check_range(self, offset: int, length: int) -> None:
        self._check_open()
        if offset < 0 or length < 0 or offset + length > self.size:
            raise VmmdError(
                "BEYOND_ALLOCATION",
                STATUS["OUT_OF_RANGE"],
                f"[{offset}, {offset + length}) is outside allocation {self.allocation_id} of {self.size} bytes",
            )

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{'asleep ' if self._asleep else ''}at 0x{self.address:x}"
        return f"<{type(self).__name__} allocation {self.allocation_id}, {self.size} bytes {state}{', read-only' if self.read_only else ''}>"


class ArrayView:
    """A typed window on vmmd memory that CuPy, Numba, PyTorch (device memory)
    or numpy (host memory) take without copying. It keeps the memory object
    alive, not mapped: closing the memory invalidates the view."""

    def __init__(self, memory: ImportedMemory, interface: Dict[str, Any]) -> None:
        self.memory = memory
        self._interface = interface

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        if not self.memory.is_device_memory:
            raise AttributeError("__cuda_array_interface__: this vmmd memory is host memory (use numpy.asarray)")
        self.memory._check_open()
        return {**self._interface, "stream": None}

    @property
    def __array_interface__(self) -> Dict[str, Any]:
        if self.memory.is_device_memory:
            raise AttributeError("__array_interface__: this vmmd memory is device memory (use __cuda_array_interface__)")
        self.memory._check_open()
        return dict(self._interface)

    def __dlpack_device__(self) -> Tuple[int, int]:
        from ._dlpack import KDL_CPU, KDL_CUDA

        return (KDL_CUDA, self.memory.device) if self.memory.is_device_memory else (KDL_CPU, 0)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None) -> Any:
        """A DLPack capsule of the view (torch.from_dlpack, numpy.from_dlpack,
        cupy.from_dlpack). The memory must stay mapped while the consumer uses it.
        Raises VmmdError READ_ONLY for read-only memory, CLOSED."""
        from ._dlpack import capsule

        self.memory._check_open()
        if copy:
            raise BufferError("vmmd views are shared memory: DLPack with copy=True is not offered")
        device_type, device_id = self.__dlpack_device__()
        return capsule(self._interface, self, device_type, device_id)


class HostImportedMemory(ImportedMemory):
    """Host backend: shared pages of a memfd. `buffer` is a memoryview of them;
    close() refuses (VIEWS_ALIVE) while views of it are alive, so no view ever
    outlives the mapping."""

    def __init__(self, allocation_id: int, fd: Union[int, List[int]], size: int, read_only: bool) -> None:
        """Maps `fd` (and closes it: the mapping keeps the pages). `fd` may be
        a one-item list that owns it: taken out (-1) as this takes it over, so
        that a caller cut short before then still closes it.
        Raises VmmdError LOCAL_MAP_FAILED (PERMISSION_DENIED for sealed memory asked writable)."""
        owner = fd if isinstance(fd, list) else [fd]
        descriptor, owner[0] = owner[0], -1
        try:
            # ACCESS_READ: MAP_SHARED, PROT_READ, and a read-only buffer (a store through it raises, never faults).
            self._map = mmap.mmap(descriptor, size, access=mmap.ACCESS_READ if read_only else mmap.ACCESS_WRITE)
        except OSError as error:
            raise local_map_failed(error, read_only) from None
        finally:
            os.close(descriptor)
        super().__init__(allocation_id, buffer_address(self._map), size, 0, read_only)

    @property
    def buffer(self) -> memoryview:
        self._check_open()
        return memoryview(self._map)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._map.close()
        except BufferError:
            raise VmmdError("VIEWS_ALIVE", STATUS["FAILED_PRECONDITION"], f"allocation {self.allocation_id} still has views in this process (numpy arrays, memoryviews); drop them before close()") from None
        self._closed = True

    def _suspend(self) -> None:
        # Anonymous, inaccessible pages over the range (MAP_FIXED replaces the shared ones at once): the
        # address stays ours, a touch faults as an unmapped device range does, and close() unmaps it all.
        _fixed_map(self.address, self.size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1)

    def _resume(self, fd: int) -> None:
        try:
            _fixed_map(self.address, self.size, PROT_READ | (0 if self.read_only else PROT_WRITE), MAP_SHARED, fd)
        finally:
            os.close(fd)

    def _copy_out(self, offset: int, length: int) -> bytes:
        return self._map[offset : offset + length]

    def _copy_in(self, offset: int, data: memoryview) -> None:
        self._map[offset : offset + data.nbytes] = data


PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def _fixed_map(address: int, size: int, protection: int, flags: int, fd: int) -> None:
    """mmap(MAP_FIXED) over [address, +size) of a mapping of ours. Raises VmmdError LOCAL_MAP_FAILED."""
    if _libc.mmap(address, size, protection, flags | MAP_FIXED, fd, 0) in (None, ctypes.c_void_p(-1).value):
        code = ctypes.get_errno()
        raise local_map_failed(OSError(code, os.strerror(code)), protection == PROT_READ)


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]


def buffer_address(obj: Any) -> int:
    """The address of an object's buffer (read-only ones too: ctypes.from_buffer
    wants writable buffers), through an export released at once."""
    view = _PyBuffer()
    if _get_buffer(obj, ctypes.byref(view), 0) != 0:  # PyBUF_SIMPLE
        raise VmmdError("NO_BUFFER", STATUS["INVALID_ARGUMENT"], f"{type(obj).__name__} does not export a buffer")
    try:
        return int(view.buf or 0)
    finally:
        _release_buffer(ctypes.byref(view))


class CudaImportedMemory(ImportedMemory):
    """Cuda backend: the allocation mapped into this process's primary context
    of `device` (imported, reserved, mapped, access set); `__cuda_array_interface__`
    exposes it as bytes, view() as any dtype and shape."""

    def __init__(self, allocation_id: int, address: int, size: int, device: int, read_only: bool, host_view: bool = False, host_numa: Optional[int] = None) -> None:
        super().__init__(allocation_id, address, size, device, read_only)
        self._host_view = host_view
        self._host_numa = host_numa
        self._lock = threading.Lock()
        # Invariant: _copies counts the reads and writes running in any thread; close() waits for 0.
        self._copies = 0
        self._idle = threading.Condition(self._lock)

    @classmethod
    def map(cls, allocation_id: int, fd: int, size: int, granularity: int, device: int, read_only: bool, host_numa: Optional[int] = None) -> "CudaImportedMemory":
        """Imports the descriptor into this process's CUDA context, reserves,
        maps and sets access; closes the descriptor and drops the import
        handle (the mapping keeps the memory). Rolls back on failure.
        Raises VmmdError FAILED_PRECONDITION NO_CUDA, LOCAL_MAP_FAILED."""
        from . import _cuda

        try:
            address = _cuda.import_and_map(fd, size, granularity, device, read_only, host_numa)
        except VmmdError:
            raise
        except Exception as error:
            raise local_map_failed(error, read_only) from None
        return cls(allocation_id, address, size, device, read_only, host_view=host_numa is not None, host_numa=host_numa)

    @property
    def is_device_memory(self) -> bool:
        return not self._host_view

    @property
    def buffer(self) -> memoryview:
        self._check_open()
        if not self._host_view:
            return super().buffer
        return memoryview((ctypes.c_ubyte * self.size).from_address(self.address)).cast("B")

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        return {**self.array_interface(), "stream": None}

    def close(self) -> None:
        """Unmaps, once every read and write running in any thread has finished
        and the context has been synchronized (as cuMemFree does: kernels of this
        process may still use the range); later reads and writes fail CLOSED."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._copies > 0:
                self._idle.wait()
        from . import _cuda

        try:
            _cuda.synchronize(self.device)
        except VmmdError:
            pass  # no usable context (interpreter exit, a reset device): nothing of ours can still run
        _cuda.unmap(self.address, self.size, self.device, mapped=not self._asleep)

    def _suspend(self) -> None:
        from . import _cuda

        with self._lock:
            while self._copies > 0:
                self._idle.wait()
            _cuda.unmap_keep_range(self.address, self.size)

    def _resume(self, fd: int) -> None:
        from . import _cuda

        try:
            _cuda.map_at(fd, self.address, self.size, self.device, self.read_only, self._host_numa)
        except VmmdError:
            raise
        except Exception as error:
            raise local_map_failed(error, self.read_only) from None

    def _copy_out(self, offset: int, length: int) -> bytes:
        from . import _cuda

        with self._copy():
            return _cuda.copy_from_device(self.device, self.address + offset, length)

    def _copy_in(self, offset: int, data: memoryview) -> None:
        from . import _cuda

        with self._copy():
            _cuda.copy_to_device(self.device, self.address + offset, data)

    @contextlib.contextmanager
    def _copy(self) -> Iterator[None]:
        """Counts a copy in flight for close(); refuses one that starts after close()."""
        with self._lock:
            self._check_open()
            self._copies += 1
        try:
            yield
        finally:
            with self._lock:
                self._copies -= 1
                if self._copies == 0:
                    self._idle.notify_all()
