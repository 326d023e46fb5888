"""Sleep and wake of memory mapped here, at the same addresses: the one
sequence that DevicePool, the PyTorch MemPool, CuPy's and Numba's pools
share.

Sleep waits for the device, copies what must be kept into host memory the
daemon makes for it and charges to this session (`offload`) or nothing
(`discard`), unmaps each range while keeping it reserved, and releases the
physical memory to the daemon. A store's mapping is unmapped and its open
dropped: the store stays with the daemon, nothing is copied.

Wake asks the daemon for all the memory at once (all or none), maps each
piece at its old address with the access it had, maps the stores again and
copies the offloaded bytes back (device memory: the copy engines, in chunks
over two streams; host backend: memmove). A wake that fails leaves every
range asleep and every offloaded copy where it was.

With `retain`, wake keeps the host copies (charged to the session while the
memory is awake) and the next offload writes into them: a cycle then costs
the copies only, not making and pinning host memory each time (as
torch_memory_saver's retain_cpu_backup).

With prepare(), the host copies are made ahead, on a thread of this
module's, as soon as the memory exists, and kept while it is awake: the first
offload then costs the copy alone, not the daemon making (and the driver
pinning) host memory as large as the memory first. A sleep that meets a copy
still being made waits for it; a copy refused (no room, a quota) is made by
the sleep itself, as without preparation."""
from __future__ import annotations

import ctypes
import os
import queue
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .errors import STATUS, VmmdError
from .memory import ImportedMemory

OFFLOAD = "offload"
DISCARD = "discard"
MODES = (OFFLOAD, DISCARD)
# Where offloaded contents go where the device's nearest node is not known: host memory of the daemon,
# mapped here for the device (pinned: the copy engines reach it).
HOST_LOCATION: Dict[str, Any] = {"type": "LOCATION_TYPE_HOST_NUMA", "id": 0}


def check_mode(mode: str) -> str:
    """Raises VmmdError INVALID_ARGUMENT BAD_SLEEP_MODE."""
    if mode not in MODES:
        raise VmmdError("BAD_SLEEP_MODE", STATUS["INVALID_ARGUMENT"], f"sleep mode {mode!r}: it is 'offload' (contents kept in the daemon's host memory) or 'discard' (contents dropped)")
    return mode


class Segment:
    """One range that sleeps and wakes: `memory` mapped here; new memory for it
    comes from `location`, or it maps the opened `store` (never copied).
    While asleep with offload, `copy` holds its bytes; with retain or prepare, also after wake.
    `pending` is set while prepare() makes its copy; `prepare_error` says why the last one failed."""

    __slots__ = ("memory", "location", "store", "mode", "copy", "pending", "prepare_error", "gone", "prepared")

    def __init__(self, memory: ImportedMemory, location: Any = None, store: Any = None) -> None:
        self.memory = memory
        self.location = location
        self.store = store
        self.mode = DISCARD
        self.copy: Optional[ImportedMemory] = None
        self.pending: Optional[threading.Event] = None
        self.prepare_error: Optional[BaseException] = None
        # Forgotten (its memory released): a copy that arrives for it goes back at once.
        self.gone = False
        # Its copy is made ahead (prepare()) and kept while awake.
        self.prepared = False


# madvise(2)'s MADV_POPULATE_WRITE (Linux 5.14): every page faulted in, writable.
MADV_POPULATE_WRITE = 23


def _populate(address: int, size: int) -> None:
    """Faults a host-backend copy's pages in now (a memfd's pages are made on first touch), so that
    the sleep's copy takes no fault; on cuda the driver made and pinned them with the allocation.
    Where the kernel has no MADV_POPULATE_WRITE the pages are left to the copy."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), MADV_POPULATE_WRITE)


class _Preparer:
    """The thread that makes host copies ahead (prepare()), one at a time, in order.
    Invariant: a segment's `pending` is set from its queuing until its copy is in
    `copy` (or refused), and a prepared copy is written to `copy` only under `_lock`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: "queue.SimpleQueue[Tuple[Any, Segment]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    def prepare(self, client: Any, segments: Sequence[Segment]) -> None:
        with self._lock:
            queued = False
            for segment in segments:
                if segment.store is not None or segment.gone:
                    continue
                segment.prepared = True
                if segment.copy is not None or segment.pending is not None:
                    continue
                segment.pending = threading.Event()
                self._queue.put((client, segment))
                queued = True
            if queued and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._run, name="vmmd-offload-prepare", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            client, segment = self._queue.get()
            copy: Optional[ImportedMemory] = None
            error: Optional[BaseException] = None
            try:
                if not segment.gone:
                    # A plain allocation, never queued: it must not wait behind a wake that waits for memory.
                    copy = client.vmm.allocate(segment.memory.size, location=_nearest_host_memory(client)(segment.location), host_access=True)
                    if getattr(client.vmm, "backend", "") != "cuda":
                        _populate(int(copy.address), int(copy.size))
            except Exception as failure:  # kept for the caller to read: the sleep makes the copy itself
                error = failure
            unwanted: List[ImportedMemory] = []
            with self._lock:
                if copy is not None and (segment.gone or segment.copy is not None):
                    unwanted.append(copy)
                elif copy is not None:
                    segment.copy = copy
                segment.prepare_error = error
                event, segment.pending = segment.pending, None
            _drop_copies(client, unwanted)
            if event is not None:
                event.set()


_PREPARER = _Preparer()


def prepare(client: Any, segments: Sequence[Segment]) -> None:
    """Queues the making of each segment's host copy (those without one and
    not mapping a store) on the preparing thread; returns at once. The copies
    are allocations of this session's, charged while the memory is awake."""
    _PREPARER.prepare(client, segments)


def settle(segments: Sequence[Segment]) -> None:
    """Waits until no segment's copy is being made."""
    for segment in segments:
        event = segment.pending
        if event is not None:
            event.wait()


def _copy(pairs: List[Any], device_memory: bool, device: int) -> None:
    """Copies (target, source, length) triples; returns once done."""
    if not pairs:
        return
    if device_memory:
        from . import _cuda

        _cuda.copy_between(device, pairs)
        return
    for target, source, length in pairs:
        ctypes.memmove(target, source, length)


def _release(client: Any, allocation_ids: List[int]) -> List[VmmdError]:
    if not allocation_ids:
        return []
    try:
        results = client.vmm.release_many(allocation_ids)
    except VmmdError as error:
        if error.code == "SESSION_LOST":
            return []  # the session's end released them
        return [error]
    return [result for result in results if isinstance(result, VmmdError) and result.code != "SESSION_LOST"]


def _nearest_host_memory(client: Any) -> Any:
    """Where a segment's copy goes: the host memory nearest its device (on a
    host of two sockets the far node halves the copy's bandwidth), as the
    daemon's ListDevices names it on cuda; node 0 where it is not known."""
    numa: Dict[int, int] = {}
    if getattr(client.vmm, "backend", "") == "cuda":
        numa = {int(d.index): int(d.host_numa_id) for d in client.devices.list_devices().devices}

    def near(location: Any) -> Dict[str, Any]:
        device = location.get("id", 0) if isinstance(location, dict) and location.get("type", "LOCATION_TYPE_DEVICE") == "LOCATION_TYPE_DEVICE" else None
        node = numa.get(int(device), -1) if device is not None else -1
        return {"type": "LOCATION_TYPE_HOST_NUMA", "id": node} if node >= 0 else HOST_LOCATION

    return near


def sleep(client: Any, segments: Sequence[Segment], mode: str) -> None:
    """Puts every segment to sleep (see the module's documentation). Nothing
    changes when the offload copies cannot be made.
    Raises VmmdError BAD_SLEEP_MODE, ASLEEP, OUT_OF_MEMORY (host memory for the copies)."""
    check_mode(mode)
    for segment in segments:
        segment.memory._check_open()
    # A copy still being made ahead is used, never raced.
    settle(segments)
    devices = sorted({segment.memory.device for segment in segments if segment.memory.is_device_memory})
    if devices:
        from . import _cuda

        # As cuMemFree: kernels queued on the memory finish before it goes.
        for device in devices:
            _cuda.synchronize(device)
    kept = [segment for segment in segments if segment.store is None]
    copies: List[ImportedMemory] = []
    made: List[ImportedMemory] = []
    try:
        if mode == OFFLOAD and kept:
            # Plain allocations, never queued: a sleep is what frees memory, and a queued request for its
            # copies could wait behind a wake that waits for this very sleep (the host backend has one queue).
            near = _nearest_host_memory(client)
            for segment in kept:
                copy = segment.copy  # retained from the last wake
                if copy is None or copy.size < segment.memory.size:
                    copy = client.vmm.allocate(segment.memory.size, location=near(segment.location), host_access=True)
                    made.append(copy)
                copies.append(copy)
            for device in devices or [-1]:
                pairs = [(copy.address, s.memory.address, s.memory.size) for copy, s in zip(copies, kept) if device < 0 or s.memory.device == device]
                _copy(pairs, device >= 0, device)
    except BaseException:
        _drop_copies(client, made)
        raise
    stale = [segment.copy for segment in kept if segment.copy is not None and all(segment.copy is not copy for copy in copies)]
    failed: List[VmmdError] = []
    released: List[int] = []
    for index, segment in enumerate(kept):
        segment.mode = mode
        segment.copy = copies[index] if copies else None
        released.append(int(segment.memory.allocation_id))
        segment.memory.suspend()
    for segment in segments:
        if segment.store is not None:
            segment.memory.suspend()
            try:
                client.stores.close(int(segment.store.store.id))
            except VmmdError as error:
                failed.append(error)
    failed += _release(client, released)
    # Retained copies a discard or a larger range made useless.
    _drop_copies(client, [copy for copy in stale if copy is not None])
    if failed:
        raise failed[0]


def _drop_copies(client: Any, copies: List[ImportedMemory]) -> None:
    ids = []
    for copy in copies:
        ids.append(int(copy.allocation_id))
        try:
            copy.close()
        except VmmdError:
            pass
    _release(client, ids)


def wake(client: Any, segments: Sequence[Segment], timeout: Optional[float] = None, retain: bool = False) -> None:
    """Wakes every segment at its address (see the module's documentation);
    prepared segments keep their copies (as with `retain`) and those missing are made ahead again.
    Raises VmmdError OUT_OF_MEMORY (the daemon had no room by the deadline),
    STORE_DETACHED, LOCAL_MAP_FAILED: every segment is still asleep then."""
    if not segments:
        return
    for segment in segments:
        if not segment.memory.asleep:
            raise VmmdError("NOT_ASLEEP", STATUS["FAILED_PRECONDITION"], f"the memory at 0x{segment.memory.address:x} is not asleep")
    kept = [segment for segment in segments if segment.store is None]
    stores = [segment for segment in segments if segment.store is not None]
    granted = client.vmm.allocate_for_wake([(segment.memory.size, segment.location) for segment in kept], timeout=timeout)
    fds = [fd for _, fd in granted]
    ids = [allocation for allocation, _ in granted]
    resumed: List[Segment] = []
    reopened: List[Any] = []
    try:
        for segment in stores:
            _, fd = client.session.open_store({"id": int(segment.store.store.id)}, not segment.memory.read_only, client.vmm._service.seconds(None))
            reopened.append(segment)
            fds.append(fd)
            ids.append(int(segment.store.store.allocation_id))
        for index, segment in enumerate(kept + stores):
            fd, fds[index] = fds[index], -1
            segment.memory.resume(ids[index], fd)
            resumed.append(segment)
    except BaseException:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        _undo_wake(client, resumed, reopened, ids[: len(kept)])
        raise
    offloaded = [segment for segment in kept if segment.copy is not None]
    try:
        for device in sorted({s.memory.device for s in offloaded if s.memory.is_device_memory}) or [-1]:
            pairs = [(s.memory.address, s.copy.address, s.memory.size) for s in offloaded if s.copy is not None and (device < 0 or s.memory.device == device)]
            _copy(pairs, device >= 0, device)
    except BaseException:
        # The bytes did not come back: asleep again, the copies kept for another wake.
        _undo_wake(client, resumed, reopened, ids[: len(kept)])
        raise
    prepare(client, [segment for segment in kept if segment.prepared])
    if retain:
        return
    copies = [segment.copy for segment in offloaded if segment.copy is not None and not segment.prepared]
    for segment in kept:
        if not segment.prepared:
            segment.copy = None
    _drop_copies(client, copies)


def _undo_wake(client: Any, resumed: Sequence[Segment], reopened: Sequence[Segment], granted: List[int]) -> None:
    """Puts a wake that failed part-way back to sleep: the memories resumed so
    far suspended again, the stores reopened closed, the allocations granted
    for the kept segments released. The copies stay, for another wake."""
    for segment in resumed:
        segment.memory.suspend()
    for segment in reopened:
        try:
            client.stores.close(int(segment.store.store.id))
        except VmmdError:
            pass
    _release(client, granted)


def forget(client: Any, segments: Sequence[Segment]) -> None:
    """Drops what segments keep in the daemon (their offloaded or retained
    copies, those still being made ahead included); the caller closes or releases the memories."""
    for segment in segments:
        segment.gone = True
    settle(segments)
    copies = [segment.copy for segment in segments if segment.copy is not None]
    for segment in segments:
        segment.copy = None
    _drop_copies(client, copies)
