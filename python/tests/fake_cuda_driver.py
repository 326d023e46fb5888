"""A stand-in for cuda.bindings.driver with the calls vmmd._cuda makes, on
host memory: "device memory" is the memfd the daemon exported, reserved,
mapped and protected with mmap/mprotect, copied with memmove. It checks the
client's call sequence, argument shapes and rollback on a machine without a
GPU; the real driver runs in test/gpu/python."""
from __future__ import annotations

import ctypes
import enum
import mmap
import os
import types
from typing import Any, Dict, List

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_LAUNCH_FAILED = 719


class CUmemAllocationHandleType(enum.IntEnum):
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_DEVICE = 1
    CU_MEM_LOCATION_TYPE_HOST_NUMA = 3


class CUmemAccess_flags(enum.IntEnum):
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAccessDesc:
    def __init__(self) -> None:
        self.location = types.SimpleNamespace(type=None, id=None)
        self.flags = None


class Handle:
    def __init__(self, fd: int) -> None:
        self.fd = fd


def build() -> types.ModuleType:
    """A fresh module; `calls` records every call, `fail` names a call to fail once."""
    m = types.ModuleType("cuda.bindings.driver")
    m.CUresult = CUresult  # type: ignore[attr-defined]
    m.CUmemAllocationHandleType = CUmemAllocationHandleType  # type: ignore[attr-defined]
    m.CUmemLocationType = CUmemLocationType  # type: ignore[attr-defined]
    m.CUmemAccess_flags = CUmemAccess_flags  # type: ignore[attr-defined]
    m.CUmemAccessDesc = CUmemAccessDesc  # type: ignore[attr-defined]
    calls: List[str] = []
    fail: Dict[str, CUresult] = {}
    live: Dict[str, set] = {"handles": set(), "reservations": set(), "mappings": set(), "streams": set()}
    m.calls, m.fail, m.live = calls, fail, live  # type: ignore[attr-defined]
    current = {"context": 0}
    # As the real driver does from pageable memory, cuMemcpyHtoD returns once the bytes are
    # staged; they land at the next synchronization (or device-to-host copy). An unmap of a
    # range with bytes still in flight poisons the context: every later call fails with
    # CUDA_ERROR_LAUNCH_FAILED, as the real driver's does.
    in_flight: List[Any] = []
    poisoned: List[bool] = []
    m.in_flight, m.poisoned = in_flight, poisoned  # type: ignore[attr-defined]
    # Devices and which can reach which (cuDeviceCanAccessPeer: accessor -> owners), and the
    # access descriptors each cuMemSetAccess was given ([(type, id, flags)] per call).
    topology: Dict[str, Any] = {"devices": 1, "peers": set()}
    access: List[List[Any]] = []
    m.topology, m.access = topology, access  # type: ignore[attr-defined]
    # Streams are ints; an event recorded on a stream is done once that stream's work is:
    # `busy` holds the streams whose queued work has not finished, and an event recorded while
    # its stream was busy stays pending until finish(stream) (or a synchronization).
    busy: set = set()
    events: Dict[int, Dict[str, Any]] = {}
    m.busy, m.events = busy, events  # type: ignore[attr-defined]

    def finish(stream: Any = None) -> None:
        for event in events.values():
            if stream is None or event["stream"] == stream:
                event["done"] = True
        if stream is None:
            busy.clear()
        else:
            busy.discard(stream)

    m.finish = finish  # type: ignore[attr-defined]

    def land() -> None:
        for device, data in in_flight:
            ctypes.memmove(device, data, len(data))
        in_flight.clear()

    def api(function: Any) -> Any:
        def call(*args: Any) -> Any:
            calls.append(function.__name__)
            if poisoned and function.__name__ not in ("cuGetErrorName",):
                return (CUresult.CUDA_ERROR_LAUNCH_FAILED,) + (None,) * (function.__code__.co_posonlyargcount)
            if function.__name__ in fail:
                return (fail.pop(function.__name__),) + (None,) * (function.__code__.co_posonlyargcount)
            return function(*args)

        call.__name__ = function.__name__
        setattr(m, function.__name__, call)
        return call

    @api
    def cuInit(flags: int) -> Any:
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuGetErrorName(result: Any) -> Any:
        return (CUresult.CUDA_SUCCESS, CUresult(result).name.encode())

    @api
    def cuDeviceGetCount() -> Any:
        return (CUresult.CUDA_SUCCESS, topology["devices"])

    @api
    def cuDeviceCanAccessPeer(device: int, peer: int) -> Any:
        return (CUresult.CUDA_SUCCESS, 1 if (device, peer) in topology["peers"] else 0)

    @api
    def cuEventCreate(flags: int) -> Any:
        event = len(events) + 1
        events[event] = {"stream": None, "done": True, "destroyed": False}
        return (CUresult.CUDA_SUCCESS, event)

    # Streams destroyed, and every call that named one afterwards: undefined behaviour on a real driver
    # (the handle may be another stream's by then), answered here as success, as the worst case would be.
    destroyed: set = set()
    misuse: List[str] = []
    m.destroyed_streams, m.misuse = destroyed, misuse  # type: ignore[attr-defined]

    @api
    def cuEventRecord(event: int, stream: Any) -> Any:
        if int(stream) in destroyed:
            misuse.append(f"cuEventRecord on destroyed stream 0x{int(stream):x}")
        events[event].update(stream=int(stream), done=int(stream) not in busy)
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuEventQuery(event: int) -> Any:
        return (CUresult.CUDA_SUCCESS if events[event]["done"] else CUresult.CUDA_ERROR_NOT_READY,)

    @api
    def cuEventSynchronize(event: int) -> Any:
        finish(events[event]["stream"])
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuEventDestroy(event: int) -> Any:
        events[event]["destroyed"] = True
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuDeviceGet(index: int) -> Any:
        return (CUresult.CUDA_SUCCESS, index)

    @api
    def cuDeviceGetUuid(device: int) -> Any:
        return (CUresult.CUDA_SUCCESS, types.SimpleNamespace(bytes=bytes(range(16))))

    @api
    def cuCtxGetCurrent() -> Any:
        return (CUresult.CUDA_SUCCESS, current["context"])

    @api
    def cuCtxGetDevice() -> Any:
        context = current["context"]
        return (CUresult.CUDA_SUCCESS, context - 0x1000 if context else 0)

    @api
    def cuDevicePrimaryCtxRetain(device: int) -> Any:
        return (CUresult.CUDA_SUCCESS, 0x1000 + device)

    @api
    def cuCtxSetCurrent(context: int) -> Any:
        current["context"] = context
        return (CUresult.CUDA_SUCCESS,)

    pushed: List[Any] = []

    @api
    def cuCtxPushCurrent(context: int) -> Any:
        pushed.append(current["context"])
        current["context"] = context
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuCtxPopCurrent() -> Any:
        popped, current["context"] = current["context"], pushed.pop()
        return (CUresult.CUDA_SUCCESS, popped)

    @api
    def cuDevicePrimaryCtxRelease(device: int) -> Any:
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuCtxSynchronize() -> Any:
        land()
        finish()
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuStreamSynchronize(stream: Any) -> Any:
        land()  # one legacy stream here: every copy is on it
        return (CUresult.CUDA_SUCCESS,)

    m.CUstream = lambda value=0: int(value)  # type: ignore[attr-defined]

    @api
    def cuMemGetInfo() -> Any:
        return (CUresult.CUDA_SUCCESS, 1 << 30, 2 << 30)

    @api
    def cuMemImportFromShareableHandle(fd: int, kind: Any) -> Any:
        assert isinstance(fd, int) and kind == CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        handle = Handle(os.dup(fd))
        live["handles"].add(handle)
        return (CUresult.CUDA_SUCCESS, handle)

    @api
    def cuMemRelease(handle: Handle) -> Any:
        live["handles"].discard(handle)
        os.close(handle.fd)
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuMemAddressReserve(size: int, alignment: int, address: int, flags: int) -> Any:
        assert size % alignment == 0
        pointer = libc.mmap(None, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        live["reservations"].add((pointer, size))
        return (CUresult.CUDA_SUCCESS, pointer)

    @api
    def cuMemAddressFree(address: int, size: int) -> Any:
        live["reservations"].remove((address, size))
        libc.munmap(address, size)
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuMemMap(address: int, size: int, offset: int, handle: Handle, flags: int) -> Any:
        assert isinstance(address, int) and offset == 0 and handle in live["handles"]
        pointer = libc.mmap(address, size, 0, mmap.MAP_SHARED | MAP_FIXED, handle.fd, 0)
        assert pointer == address
        live["mappings"].add((address, size))
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuMemUnmap(address: int, size: int) -> Any:
        if any(address <= device < address + size for device, _ in in_flight):
            in_flight.clear()
            poisoned.append(True)  # the DMA faults under the unmap; the driver says so at the next call
        live["mappings"].remove((address, size))
        libc.mmap(address, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0)
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuMemSetAccess(address: int, size: int, descs: List[CUmemAccessDesc], count: int) -> Any:
        assert count == len(descs) and (address, size) in live["mappings"]
        assert descs[0].location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        writable = descs[0].flags == CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        access.append([(d.location.type, d.location.id, d.flags) for d in descs])
        libc.mprotect(address, size, mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuMemcpyHtoD(device: int, host: int, count: int) -> Any:
        assert isinstance(device, int) and isinstance(host, int)
        in_flight.append((device, ctypes.string_at(host, count)))
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuStreamCreate(flags: int) -> Any:
        stream = 0x5000 + len(calls)
        live["streams"].add(stream)
        return (CUresult.CUDA_SUCCESS, stream)

    @api
    def cuStreamDestroy(stream: int) -> Any:
        live["streams"].remove(stream)
        destroyed.add(stream)
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuMemcpyAsync(target: int, source: int, count: int, stream: int) -> Any:
        # Both ends must be mapped (device memory, or host memory mapped for the device); the bytes are
        # read now and land at the stream's synchronization.
        assert isinstance(target, int) and isinstance(source, int) and stream in live["streams"]
        for end in (target, source):
            assert any(address <= end and end + count <= address + size for address, size in live["mappings"]), f"cuMemcpyAsync on unmapped 0x{end:x}"
        in_flight.append((target, ctypes.string_at(source, count)))
        return (CUresult.CUDA_SUCCESS,)

    @api
    def cuMemcpyDtoH(host: int, device: int, count: int) -> Any:
        assert isinstance(device, int) and isinstance(host, int)
        land()  # ordered after earlier copies on the legacy stream
        ctypes.memmove(host, device, count)
        return (CUresult.CUDA_SUCCESS,)

    return m
