"""The CUDA driver through cuda-bindings (`pip install vmmd[cuda]`), imported
on first use only: import, reserve, map and set access in this process, as
NVIDIA's memMapIPCDrv sample does; each sequence undoes its own steps on
failure. Everything runs in the device's primary context, the one Numba, CuPy
and PyTorch use."""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

from .errors import STATUS, VmmdError

_lock = threading.Lock()
_driver: Any = None
_uuids: Optional[Dict[str, int]] = None


def driver() -> Any:
    """cuda.bindings.driver, initialised. Raises VmmdError FAILED_PRECONDITION NO_CUDA."""
    global _driver
    if _driver is not None:
        return _driver
    with _lock:
        if _driver is not None:
            return _driver
        try:
            from cuda.bindings import driver as cu  # cuda-bindings >= 12.6
        except ImportError:
            try:
                from cuda import cuda as cu  # type: ignore[no-redef]  # older cuda-python
            except ImportError as error:
                raise VmmdError(
                    "NO_CUDA",
                    STATUS["FAILED_PRECONDITION"],
                    f"cuda-bindings is not installed ({error}): pip install 'vmmd[cuda]', or use the host backend",
                ) from None
        (result,) = cu.cuInit(0)
        if result != cu.CUresult.CUDA_SUCCESS:
            raise VmmdError("NO_CUDA", STATUS["FAILED_PRECONDITION"], f"cuInit failed: {_name(cu, result)}")
        _driver = cu
        return cu


def _name(cu: Any, result: Any) -> str:
    try:
        _, name = cu.cuGetErrorName(result)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return str(result)


def check(result: Any, call: str) -> None:
    cu = driver()
    if result != cu.CUresult.CUDA_SUCCESS:
        name = _name(cu, result)
        status = STATUS["RESOURCE_EXHAUSTED"] if name == "CUDA_ERROR_OUT_OF_MEMORY" else STATUS["INTERNAL"]
        raise VmmdError(name, status, f"{name}: {call}")


def native(obj: Any) -> int:
    """The value of a driver handle (CUcontext, CUdevice, CUdeviceptr) as an int."""
    try:
        return int(obj)
    except TypeError:
        from cuda.bindings.utils import get_cuda_native_handle

        return int(get_cuda_native_handle(obj))


def format_uuid(raw: bytes) -> str:
    """The daemon's spelling of a device UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)."""
    h = raw[:16].hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def local_device(daemon_index: int, uuid: str) -> int:
    """This process's index of the daemon's device: the same UUID where this
    process sees it (CUDA_VISIBLE_DEVICES may order devices differently),
    else the daemon's index."""
    global _uuids
    if not uuid:
        return daemon_index
    cu = driver()
    if _uuids is None:
        found: Dict[str, int] = {}
        try:
            result, count = cu.cuDeviceGetCount()
            check(result, "cuDeviceGetCount")
            get_uuid = getattr(cu, "cuDeviceGetUuid", None) or getattr(cu, "cuDeviceGetUuid_v2", None)
            for index in range(count if get_uuid is not None else 0):
                result, dev = cu.cuDeviceGet(index)
                check(result, "cuDeviceGet")
                # Not None here: without it the range is empty.
                result, raw = get_uuid(dev)  # type: ignore[misc]
                if result == cu.CUresult.CUDA_SUCCESS:
                    value = raw.bytes
                    found[format_uuid(value if isinstance(value, bytes) else bytes(ord(ch) & 0xFF for ch in value))] = index
        except Exception as error:  # the index is right unless CUDA_VISIBLE_DEVICES reorders
            import warnings

            warnings.warn(f"vmmd: cannot read device UUIDs ({error}); using the daemon's device indices", RuntimeWarning, stacklevel=2)
        _uuids = found
    return _uuids.get(uuid, daemon_index)


def ensure_context(device: int) -> None:
    """Makes a context of `device` current on this thread: the current one if
    it is that device's, else the device's primary context (the one Numba,
    CuPy and PyTorch use). The primary context is retained each time, not
    remembered: a device reset (numba.cuda.close()) makes a new one."""
    cu = driver()
    result, ctx = cu.cuCtxGetCurrent()
    if result == cu.CUresult.CUDA_SUCCESS and ctx is not None and native(ctx) != 0:
        result, current = cu.cuCtxGetDevice()
        if result == cu.CUresult.CUDA_SUCCESS and native(current) == device:
            return
    result, dev = cu.cuDeviceGet(device)
    check(result, f"cuDeviceGet({device})")
    result, primary = cu.cuDevicePrimaryCtxRetain(dev)
    check(result, f"cuDevicePrimaryCtxRetain({device})")
    # The retain is kept (a count the driver holds until exit), as CuPy and PyTorch keep theirs.
    (result,) = cu.cuCtxSetCurrent(primary)
    check(result, "cuCtxSetCurrent")


_peer_cache: Dict[int, List[int]] = {}
# A mapping opens to the peers of its device that this process maps memory on too (_used), and a device's
# first mapping opens the mappings made before it to that device: copies between two devices' arrays work,
# and a process that uses one device never pays for a peer's page tables (on two H200s a peer grant cost
# each map and unmap about a millisecond). Both under _peer_lock, with every mapping made here (_mapped).
# Reentrant: a finalizer that unmaps may run on a thread that holds it.
_peer_lock = threading.RLock()
_used: Set[int] = set()
# Invariant: every range mapped and access-set by this module and not yet unmapped: address -> (size, device, read-only).
_mapped: Dict[int, Tuple[int, int, bool]] = {}


def _peers_of(device: int) -> List[int]:
    found = _peer_cache.get(device)
    if found is None:
        found = _peer_cache[device] = peers(device)
    return found


def _join(cu: Any, device: int) -> None:
    """Under _peer_lock: before `device`'s first mapping, opens every mapping of another device it can reach to it.
    Raises VmmdError (`device` not counted: the next mapping tries again; a grant made twice is harmless)."""
    if device in _used:
        return
    for address, (size, owner, read_only) in list(_mapped.items()):
        if owner != device and device in _peers_of(owner):
            grant = _location(cu, cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, device, read_only)
            (result,) = cu.cuMemSetAccess(address, size, [grant], 1)
            check(result, f"cuMemSetAccess({size} at 0x{address:x} for peer device {device})")
    _used.add(device)


def _location(cu: Any, kind: Any, index: int, read_only: bool) -> Any:
    desc = cu.CUmemAccessDesc()
    desc.location.type = kind
    desc.location.id = index
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ if read_only else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def _access(cu: Any, device: int, read_only: bool, host_numa: Optional[int]) -> List[Any]:
    """Under _peer_lock: `device`, the peers this process maps on too (code written for cuMemAlloc reaches this
    memory from a peer device's context), and the host NUMA node, if named (host memory opens to the CPU too)."""
    device_kind = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    descs = [_location(cu, device_kind, device, read_only)]
    descs += [_location(cu, device_kind, peer, read_only) for peer in _peers_of(device) if peer in _used]
    if host_numa is not None:
        descs.append(_location(cu, cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA, host_numa, read_only))
    return descs


def import_and_map(fd: int, size: int, granularity: int, device: int, read_only: bool, host_numa: Optional[int] = None) -> int:
    """Imports a POSIX-fd handle, reserves, maps and sets access for `device`;
    returns the address. Takes ownership of fd (closed here); the import
    handle is released once mapped (the mapping keeps the memory)."""
    return _import_and_map(fd, 0, size, granularity, device, read_only, host_numa)


def map_at(fd: int, address: int, size: int, device: int, read_only: bool, host_numa: Optional[int] = None) -> None:
    """As import_and_map, at `address` of a range this process keeps reserved
    (memory put to sleep): the range stays reserved whatever happens."""
    _import_and_map(fd, address, size, 0, device, read_only, host_numa)


def _import_and_map(fd: int, at: int, size: int, granularity: int, device: int, read_only: bool, host_numa: Optional[int]) -> int:
    # In `device`'s context, and the caller's context current again after: Numba's
    # `with cuda.gpus[n]` pops the context it pushed and checks that it is its own.
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(in_context(device))
        except BaseException:
            os.close(fd)
            raise
        return _import_and_map_here(fd, at, size, granularity, device, read_only, host_numa)


def _import_and_map_here(fd: int, at: int, size: int, granularity: int, device: int, read_only: bool, host_numa: Optional[int]) -> int:
    try:
        cu = driver()
        _peers_of(device)  # asked before the mapping starts: nothing to undo if it fails
        result, handle = cu.cuMemImportFromShareableHandle(fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        check(result, f"cuMemImportFromShareableHandle(fd {fd})")
    finally:
        os.close(fd)
    address = at
    reserved = False
    mapped = False
    try:
        if not at:
            result, pointer = cu.cuMemAddressReserve(size, granularity, 0, 0)
            check(result, f"cuMemAddressReserve({size})")
            address = native(pointer)
            reserved = True
        (result,) = cu.cuMemMap(address, size, 0, handle, 0)
        check(result, f"cuMemMap({size} at 0x{address:x})")
        mapped = True
        with _peer_lock:
            _join(cu, device)
            descs = _access(cu, device, read_only, host_numa)
            (result,) = cu.cuMemSetAccess(address, size, descs, len(descs))
            check(result, f"cuMemSetAccess({size})")
            _mapped[address] = (size, device, read_only)
        return address
    except BaseException:
        if mapped:
            with _peer_lock:
                _mapped.pop(address, None)
            cu.cuMemUnmap(address, size)
        if reserved:
            cu.cuMemAddressFree(address, size)
        raise
    finally:
        cu.cuMemRelease(handle)


def unmap(address: int, size: int, device: int, mapped: bool = True) -> None:
    """Unmaps (unless `mapped` is False: a range kept asleep) and frees the
    address range (no context needed; safe at exit while the driver is
    loaded). Work queued on the memory must be done."""
    cu = _driver
    if cu is None:
        return
    if mapped:
        # Under the lock, and out of _mapped once unmapped: no grant meets the range half gone, and memory
        # an unmap failed to take stays open to the devices that join.
        with _peer_lock:
            (result,) = cu.cuMemUnmap(address, size)
            check(result, f"cuMemUnmap({size})")
            _mapped.pop(address, None)
    (result,) = cu.cuMemAddressFree(address, size)
    check(result, f"cuMemAddressFree({size})")


def unmap_keep_range(address: int, size: int) -> None:
    """Unmaps the memory at [address, +size) and keeps the range reserved (sleep). Work queued on it must be done."""
    cu = driver()
    with _peer_lock:
        (result,) = cu.cuMemUnmap(address, size)
        check(result, f"cuMemUnmap({size} at 0x{address:x})")
        _mapped.pop(address, None)


# Bytes per copy of a sleep or a wake, alternating between two streams so that the copy engines overlap them.
COPY_CHUNK_BYTES = 64 << 20


def copy_between(device: int, pairs: List[Any]) -> None:
    """Copies each (target, source, length) of device-visible addresses (device
    memory, and host memory the daemon made and this process mapped for the
    device: pinned, so the copy engines reach it) in chunks over two streams
    of this package's own; returns once every byte has landed."""
    cu = driver()
    with in_context(device):
        streams = []
        try:
            for _ in range(2):
                result, stream = cu.cuStreamCreate(1)  # CU_STREAM_NON_BLOCKING: never waits for the default stream
                check(result, "cuStreamCreate")
                streams.append(stream)
            turn = 0
            for target, source, length in pairs:
                for offset in range(0, length, COPY_CHUNK_BYTES):
                    count = min(COPY_CHUNK_BYTES, length - offset)
                    (result,) = cu.cuMemcpyAsync(target + offset, source + offset, count, streams[turn % 2])
                    check(result, f"cuMemcpyAsync({count})")
                    turn += 1
            for stream in streams:
                (result,) = cu.cuStreamSynchronize(stream)
                check(result, "cuStreamSynchronize")
        finally:
            for stream in streams:
                cu.cuStreamDestroy(stream)


def copy_to_device(device: int, address: int, data: memoryview) -> None:
    from .memory import buffer_address

    cu = driver()
    with in_context(device):
        # By address: every cuda-bindings version takes an int for a host pointer; `data` stays alive meanwhile.
        (result,) = cu.cuMemcpyHtoD(address, buffer_address(data), data.nbytes)
        check(result, f"cuMemcpyHtoD({data.nbytes})")
        # NOTE: from pageable memory cuMemcpyHtoD returns once the bytes are staged,
        # before the DMA lands; a caller that unmapped the range then would fault the context.
        # The copy ran on the legacy default stream: synchronizing that stream waits for it.
        (result,) = cu.cuStreamSynchronize(cu.CUstream(0))
        check(result, "cuStreamSynchronize")


def copy_from_device(device: int, address: int, length: int) -> bytes:
    cu = driver()
    from .memory import buffer_address

    out = bytearray(length)
    with in_context(device):
        (result,) = cu.cuMemcpyDtoH(buffer_address(out) if length else 0, address, length)
        check(result, f"cuMemcpyDtoH({length})")
    return bytes(out)


def synchronize(device: int) -> None:
    cu = driver()
    with in_context(device):
        (result,) = cu.cuCtxSynchronize()
        check(result, "cuCtxSynchronize")


def memory_info(device: int) -> tuple:
    """(free, total) bytes of `device`, as the driver sees them here."""
    cu = driver()
    with in_context(device):
        result, free, total = cu.cuMemGetInfo()
        check(result, "cuMemGetInfo")
    return int(free), int(total)


# -- stream order: events that say when work queued on a stream is done -------

CU_EVENT_DISABLE_TIMING = 0x2
# The legacy default stream: work on it waits for every blocking stream of the
# context, so an event on it covers work whose stream is not known.
LEGACY_STREAM = 0


@contextlib.contextmanager
def in_context(device: int) -> Iterator[None]:
    """Runs the block in `device`'s primary context and leaves the thread's
    current context as it found it: a pool's frees of one device may settle
    while the caller works on another (Numba's multi-GPU code)."""
    cu = driver()
    result, ctx = cu.cuCtxGetCurrent()
    if result == cu.CUresult.CUDA_SUCCESS and ctx is not None and native(ctx) != 0:
        result, current = cu.cuCtxGetDevice()
        if result == cu.CUresult.CUDA_SUCCESS and native(current) == device:
            yield
            return
    else:
        # No context current: the primary one stays current, as ensure_context leaves it.
        ensure_context(device)
        yield
        return
    result, dev = cu.cuDeviceGet(device)
    check(result, f"cuDeviceGet({device})")
    result, primary = cu.cuDevicePrimaryCtxRetain(dev)
    check(result, f"cuDevicePrimaryCtxRetain({device})")
    (result,) = cu.cuCtxPushCurrent(primary)
    check(result, "cuCtxPushCurrent")
    try:
        yield
    finally:
        cu.cuCtxPopCurrent()
        cu.cuDevicePrimaryCtxRelease(dev)


def record_event(device: int, stream: Optional[int]) -> Any:
    """An event recorded now on `stream` (None: the legacy default stream) in
    `device`'s context: done once all work queued there before now is done."""
    cu = driver()
    with in_context(device):
        return _record(cu, stream)


def _record(cu: Any, stream: Optional[int]) -> Any:
    result, event = cu.cuEventCreate(CU_EVENT_DISABLE_TIMING)
    check(result, "cuEventCreate")
    (result,) = cu.cuEventRecord(event, cu.CUstream(LEGACY_STREAM if stream is None else stream))
    if result != cu.CUresult.CUDA_SUCCESS:
        cu.cuEventDestroy(event)
        check(result, f"cuEventRecord(stream 0x{stream or 0:x})")
    return event


def event_done(event: Any) -> bool:
    """Whether the work before the event is done (cuEventQuery, never waits)."""
    cu = driver()
    (result,) = cu.cuEventQuery(event)
    if result == cu.CUresult.CUDA_ERROR_NOT_READY:
        return False
    check(result, "cuEventQuery")
    return True


def wait_event(event: Any) -> None:
    cu = driver()
    (result,) = cu.cuEventSynchronize(event)
    check(result, "cuEventSynchronize")


def destroy_event(event: Any) -> None:
    cu = _driver
    if cu is not None:
        cu.cuEventDestroy(event)


def peers(device: int) -> List[int]:
    """The devices that can access `device`'s memory (cuDeviceCanAccessPeer):
    memory mapped for `device` opens to those this process maps memory on too,
    as cuMemAlloc memory does to the peers that enabled peer access."""
    cu = driver()
    result, count = cu.cuDeviceGetCount()
    check(result, "cuDeviceGetCount")
    found = []
    for other in range(int(count)):
        if other == device:
            continue
        result, can = cu.cuDeviceCanAccessPeer(other, device)
        if result == cu.CUresult.CUDA_SUCCESS and int(can):
            found.append(other)
    return found
