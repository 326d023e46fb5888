"""The VirtualMemory service, and mapping memory of the daemon here: one
round trip on the session socket while the session is open, the RPC after."""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from . import _proto
from ._rpc import STREAM_CHUNK_BYTES, Message, Request, _Service
from ._staging import STAGED_MIN_BYTES, StagingBuffer, StagingRefused
from .errors import STATUS, VmmdError
from .memory import CudaImportedMemory, HostImportedMemory, ImportedMemory
from ._declared import MAX_ALLOCATE_ALL_SIZES, MAX_ALLOCATE_ALL_WAIT_MS
from ._locks import surely
from ._reading import close_fd
from .session import ClientSession, allocation_id

# How long a wake waits by default for memory another process's sleep frees, and at most.
WAKE_SECONDS = 60.0
MAX_WAKE_SECONDS = MAX_ALLOCATE_ALL_WAIT_MS / 1000


class VirtualMemoryApi:
    """The VirtualMemory service, and mapping exported memory here."""

    def __init__(self, service: _Service, session: ClientSession, backend: str, staging_bytes: int) -> None:
        self._service = service
        self._session = session
        self.backend = backend
        self._staging = StagingBuffer(staging_bytes, service, session) if staging_bytes > 0 else None

    def reserve(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """Raises VmmdError INVALID_ARGUMENT ZERO_SIZE, NOT_ALIGNED, BAD_ALIGNMENT."""
        return self._service.unary("Reserve", request, timeout=timeout, **fields)

    def free_address(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """Raises VmmdError NOT_FOUND NOT_RESERVED, INVALID_ARGUMENT PARTIAL_FREE, FAILED_PRECONDITION RESERVATION_MAPPED."""
        return self._service.unary("FreeAddress", request, timeout=timeout, **fields)

    def create(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """Raises VmmdError INVALID_ARGUMENT ZERO_SIZE, NOT_ALIGNED; RESOURCE_EXHAUSTED OUT_OF_MEMORY; OUT_OF_RANGE UNKNOWN_DEVICE."""
        return self._service.unary("Create", request, timeout=timeout, **fields)

    def release(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """Drops this session's reference to an allocation: on the session
        socket (one round trip), or the Release RPC where the socket is gone.
        Returns a ReleaseResponse either way.
        Raises VmmdError NOT_FOUND UNKNOWN_ALLOCATION, FAILED_PRECONDITION ALREADY_RELEASED, PERMISSION_DENIED NOT_OWNER."""
        message = self._service._request("Release", request, fields)
        if self._session.closed:
            return self._service.unary("Release", message, timeout=timeout)
        return self._session.release(int(message.allocation_id), self._service.seconds(timeout))

    def release_many(self, allocation_ids: List[int], timeout: Optional[float] = None) -> List[Union[Message, VmmdError]]:
        """Releases several allocations: on the session socket in one round
        trip (every request sent before any answer is waited for), else one
        Release RPC each. Returns, in order, each ReleaseResponse or the
        VmmdError that refused it; a refusal does not stop the others.
        Raises VmmdError BAD_ID (nothing released) for an id that is not a
        uint64, or SESSION_LOST / NO_ANSWER when the session fails."""
        if not self._session.closed:
            # The session checks every id before it sends any.
            answers = self._session.release_many(list(allocation_ids), self._service.seconds(timeout))
            return list(answers)
        ids = [int(allocation_id(allocation)) for allocation in allocation_ids]
        results: List[Union[Message, VmmdError]] = []
        for allocation in ids:
            try:
                results.append(self._service.unary("Release", allocation_id=allocation, timeout=timeout))
            except VmmdError as error:
                results.append(error)
        return results

    def map(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """Raises VmmdError ALREADY_MAPPED, NOT_ALIGNED, NONZERO_OFFSET, BEYOND_ALLOCATION, BEYOND_RESERVATION."""
        return self._service.unary("Map", request, timeout=timeout, **fields)

    def unmap(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """Raises VmmdError NOT_FOUND NOT_MAPPED, INVALID_ARGUMENT PARTIAL_UNMAP."""
        return self._service.unary("Unmap", request, timeout=timeout, **fields)

    def set_access(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """Raises VmmdError FAILED_PRECONDITION NOT_FULLY_MAPPED, INVALID_ARGUMENT PARTIAL_MAPPING."""
        return self._service.unary("SetAccess", request, timeout=timeout, **fields)

    def get_access(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """Raises VmmdError NOT_FOUND NOT_MAPPED."""
        return self._service.unary("GetAccess", request, timeout=timeout, **fields)

    def export(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """The raw Export call; import_() maps the descriptor. Raises VmmdError NOT_OWNER, NO_SESSION."""
        return self._service.unary("Export", request, timeout=timeout, **fields)

    def share(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """A key that lets another session import the allocation (on the
        session socket, or the Share RPC where it is gone). Raises VmmdError PERMISSION_DENIED NOT_OWNER."""
        message = self._service._request("Share", request, fields)
        if self._session.closed:
            return self._service.unary("Share", message, timeout=timeout)
        return _proto.message("ShareResponse")(share_key=self._session.share(int(message.allocation_id), self._service.seconds(timeout)))

    def import_transfer(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """The raw Import call; import_descriptor() sends the descriptor first."""
        return self._service.unary("Import", request, timeout=timeout, **fields)

    def get_properties(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """Raises VmmdError NOT_FOUND UNKNOWN_ALLOCATION."""
        return self._service.unary("GetProperties", request, timeout=timeout, **fields)

    def retain_handle(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """Raises VmmdError NOT_FOUND NOT_MAPPED."""
        return self._service.unary("RetainHandle", request, timeout=timeout, **fields)

    def allocate_raw(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """The raw Allocate RPC: the descriptor waits on the session socket under the returned transfer id."""
        return self._service.unary("Allocate", request, timeout=timeout, **fields)

    def allocate_all(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """The raw AllocateAll RPC (sizes, location, deadline_ms): the descriptors wait on the session
        socket under the answer's transfer ids; allocate_for_wake() takes them.
        Raises VmmdError OUT_OF_MEMORY (at the deadline), ZERO_SIZE, NOT_ALIGNED, TOO_MANY_SIZES, BEYOND_DEVICE, BAD_DEADLINE, BUDGET_EXCEEDED."""
        return self._service.unary("AllocateAll", request, timeout=timeout, **fields)

    def open_staging(self, transfer_id: int, timeout: Optional[float] = None) -> Message:
        return self._service.unary("OpenStaging", transfer_id=transfer_id, timeout=timeout)

    def read_staged(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        return self._service.unary("ReadStaged", request, timeout=timeout, **fields)

    def write_staged(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        return self._service.unary("WriteStaged", request, timeout=timeout, **fields)

    def import_(self, allocation_id: int, share_key: str = "", read_only: bool = False, host_access: bool = False, timeout: Optional[float] = None) -> ImportedMemory:
        """Exports an allocation and maps it into this process: shared pages on
        the host backend, a device pointer in this process's CUDA context on
        cuda. (import is a Python keyword: hence the underscore.)
        Raises VmmdError from Export, TRANSFER_NOT_RECEIVED, NO_CUDA, LOCAL_MAP_FAILED; VmmdTimeoutError past `timeout`."""
        seconds = self._service.seconds(timeout)
        if not self._session.closed:
            # The session socket: the descriptor comes with the answer, one round trip.
            # The session socket: the descriptor comes with the answer, one round trip.
            exported, fd = self._session.export(int(allocation_id), share_key, seconds)
            owner = [fd]
        else:
            exported = self.export(allocation_id=int(allocation_id), share_key=share_key, handle_type="HANDLE_TYPE_POSIX_FD", timeout=seconds)
            owner = [self._session.take_transfer(exported.transfer_id, seconds)]
        try:
            return self._map_export(exported, owner, read_only, host_access)
        finally:
            surely(lambda: _close_owned(owner))  # (-1 once the mapping took it)

    def allocate(self, size: int, location: Any = None, host_access: bool = False, timeout: Optional[float] = None) -> ImportedMemory:
        """A new allocation, owned by this session and mapped into this
        process, in one round trip (the session socket's allocate; the RPC for
        locations the message cannot name). close() unmaps it here; release()
        frees it in the daemon. Cut short anywhere (an interrupt, a timeout),
        it leaves nothing: what the daemon made for it is released.
        Raises VmmdError from Create (OUT_OF_MEMORY, NOT_ALIGNED…), NO_CUDA, LOCAL_MAP_FAILED; VmmdTimeoutError past `timeout`."""
        seconds = self._service.seconds(timeout)
        # A session that ended answers SESSION_LOST (saying why), as every session-socket call does.
        response, fd = self._session.allocate(size, location, seconds)
        # Owned from here by `owner` (until the mapping takes it) and by the except below: no gap before the try.
        owner = [fd]
        try:
            return self._map_export(response, owner, False, host_access)
        except BaseException as error:
            # A second interrupt in this clean-up runs it again (surely): the allocation is never left unowned.
            surely(lambda: _close_owned(owner))
            surely(lambda failure=error: self._give_back(str(response.allocation_id), failure))  # type: ignore[misc]
            raise

    def _map_export(self, exported: Any, owner: List[int], read_only: bool, host_access: bool) -> ImportedMemory:
        """Maps the descriptor in `owner` of an ExportResponse (the Export or Allocate RPC's, or the session socket's)."""
        return self._map_descriptor(
            int(exported.allocation_id), owner, int(exported.size), int(exported.granularity), int(exported.device), exported.device_uuid,
            _proto_location_type(exported.location), int(exported.location.id), read_only, host_access,
        )

    def allocate_for_wake(self, pieces: List[Tuple[int, Any]], timeout: Optional[float] = None) -> List[Tuple[int, int]]:
        """New allocations of this session for memory that wakes: one per
        (size, location), all or none; returns (allocation id, descriptor)
        pairs in order, the descriptors the caller's. The daemon serves each
        location's pieces as one AllocateAll: serialized with other wakes of
        that device, and queued up to `timeout` seconds (None: WAKE_SECONDS)
        until releases free the memory.
        Raises VmmdError OUT_OF_MEMORY (at the deadline; nothing kept), BEYOND_DEVICE, SESSION_LOST."""
        wait = WAKE_SECONDS if timeout is None else float(timeout)
        if not (0 <= wait <= MAX_WAKE_SECONDS):
            raise VmmdError("BAD_TIMEOUT", STATUS["INVALID_ARGUMENT"], f"a wake's timeout of {timeout!r} s: it is 0 to {MAX_WAKE_SECONDS:g} s")
        groups: Dict[str, List[int]] = {}
        locations: Dict[str, Any] = {}
        for index, (_, location) in enumerate(pieces):
            key = repr(sorted(location.items())) if isinstance(location, Mapping) else repr(location)
            groups.setdefault(key, []).append(index)
            locations[key] = location
        granted: List[Optional[Tuple[int, int]]] = [None] * len(pieces)
        try:
            for key, indices in groups.items():
                # At most MAX_ALLOCATE_ALL_SIZES a request: a larger wake is several, undone together on a failure.
                for start in range(0, len(indices), MAX_ALLOCATE_ALL_SIZES):
                    batch = indices[start : start + MAX_ALLOCATE_ALL_SIZES]
                    for index, answer in zip(batch, self._allocate_all([int(pieces[i][0]) for i in batch], locations[key], wait)):
                        granted[index] = answer
        except BaseException as error:
            for got in granted:
                if got is not None:
                    close_fd(got[1])
                    self._give_back(str(got[0]), error)
            raise
        return [got for got in granted if got is not None]

    def _allocate_all(self, sizes: List[int], location: Any, wait: float) -> List[Tuple[int, int]]:
        """One AllocateAll and its descriptors, taken from the session socket; all or none."""
        fields: Dict[str, Any] = {"sizes": sizes, "deadline_ms": int(wait * 1000)}
        if location is not None:
            fields["location"] = location
        # The call outlives the daemon's deadline: the daemon answers OUT_OF_MEMORY, not the channel DEADLINE_EXCEEDED.
        response = self.allocate_all(timeout=wait + self._service.seconds(None), **fields)
        taken: List[Tuple[int, int]] = []
        try:
            for allocation in response.allocations:
                taken.append((int(allocation.allocation_id), self._session.take_transfer(allocation.transfer_id, self._service.seconds(None))))
        except BaseException as error:
            for allocation_id, fd in taken:
                close_fd(fd)
            for allocation in response.allocations:
                self._give_back(str(allocation.allocation_id), error)
            raise
        return taken

    def _give_back(self, allocation: str, error: BaseException) -> None:
        """Releases an allocation its caller will not get: at once after a
        failure (a map refused), with the session's next send after an
        interrupt (nothing waits in its way)."""
        if isinstance(error, Exception):
            try:
                self._session.release(int(allocation))
                return
            except VmmdError:
                pass
        self._session.disown(allocation)

    def _map_descriptor(self, allocation_id: int, owner: List[int], size: int, granularity: int, device: int, device_uuid: str, location_type: str, location_id: int, read_only: bool, host_access: bool) -> ImportedMemory:
        """Maps the descriptor in `owner` (a one-item list): the mapping takes it
        out (-1) as it takes it over, so that a caller cut short closes it only
        while it is still there."""
        if self.backend == "cuda":
            from . import _cuda

            local = _cuda.local_device(device, device_uuid)
            host_numa = location_id if host_access and location_type == "LOCATION_TYPE_HOST_NUMA" else None
            fd, owner[0] = owner[0], -1
            return CudaImportedMemory.map(allocation_id, fd, size, granularity, local, read_only, host_numa)
        return HostImportedMemory(allocation_id, owner, size, read_only)

    def import_descriptor(self, fd: int, size: int = 0, device: int = 0, timeout: Optional[float] = None) -> Message:
        """Sends a descriptor of this process to the daemon and makes an
        allocation of it, owned by this session. The caller keeps its fd.
        Raises VmmdError INVALID_ARGUMENT BAD_DESCRIPTOR, SESSION_LOST."""
        transfer = self._session.send_descriptor(fd, self._service.seconds(timeout))
        return self.import_transfer(transfer_id=int(transfer), device=device, size=size, timeout=timeout)

    def read(self, address: int, length: int, timeout: Optional[float] = None) -> bytes:
        """Reads bytes at a mapped address the daemon may read: through the
        staging buffer from STAGED_MIN_BYTES up, else (or when the daemon refuses
        the buffer for its staging budget) streamed over gRPC.
        Raises VmmdError NOT_MAPPED, NO_ACCESS, NOT_FULLY_MAPPED."""
        if self._stages(length):
            try:
                return bytes(self._staging.read(int(address), int(length), timeout=timeout))  # type: ignore[union-attr]
            except StagingRefused:
                pass
        chunks = [chunk.data for chunk in self._service.server_stream("Read", address=int(address), length=int(length), timeout=self._service.seconds(timeout))]
        return b"".join(chunks)

    def read_into(self, address: int, into: Any, timeout: Optional[float] = None) -> memoryview:
        """As read(), into a writable buffer of the caller's (its whole length):
        no new buffer, for callers that read repeatedly. Returns a view of `into`."""
        target = memoryview(into).cast("B")
        if target.readonly:
            raise VmmdError("READ_ONLY_BUFFER", STATUS["INVALID_ARGUMENT"], "read_into needs a writable buffer (a bytearray, a numpy array…)")
        if self._stages(target.nbytes):
            try:
                return self._staging.read(int(address), target.nbytes, target, timeout=timeout)  # type: ignore[union-attr]
            except StagingRefused:
                pass
        offset = 0
        for chunk in self._service.server_stream("Read", address=int(address), length=target.nbytes, timeout=self._service.seconds(timeout)):
            target[offset : offset + len(chunk.data)] = chunk.data
            offset += len(chunk.data)
        return target

    def write(self, address: int, data: Any, timeout: Optional[float] = None) -> int:
        """Writes bytes to a mapped address the daemon may write (staged from
        STAGED_MIN_BYTES up; streamed when the daemon refuses the buffer for its
        staging budget). Returns the bytes written.
        Raises VmmdError NOT_MAPPED, NO_ACCESS, NOT_FULLY_MAPPED, READ_ONLY_MEMORY."""
        view = memoryview(data).cast("B")
        if self._stages(view.nbytes):
            try:
                self._staging.write(int(address), view, timeout=timeout)  # type: ignore[union-attr]
                return view.nbytes
            except StagingRefused:
                pass
        Write = _proto.message("WriteRequest")

        def messages() -> Iterator[Message]:
            for offset in range(0, max(view.nbytes, 1), STREAM_CHUNK_BYTES):
                yield Write(address=int(address) if offset == 0 else 0, data=bytes(view[offset : offset + STREAM_CHUNK_BYTES]))

        return int(self._service.client_stream("Write", messages(), timeout).bytes_written)

    def _stages(self, length: int) -> bool:
        """Whether a copy of `length` bytes goes through the staging buffer (not once the daemon refused it)."""
        return self._staging is not None and not self._staging.refused and length >= STAGED_MIN_BYTES and not self._session.closed

    def close_staging(self) -> None:
        if self._staging is not None:
            self._staging.close()


def _proto_location_type(location: Any) -> str:
    if location is None:
        return "LOCATION_TYPE_DEVICE"
    Location = _proto.message("Location")
    return Location.DESCRIPTOR.fields_by_name["type"].enum_type.values_by_number[location.type].name


def _close_owned(owner: List[int]) -> None:
    """Closes the descriptor in `owner` (a one-item list), taken out first: run twice, it never closes a number twice."""
    fd, owner[0] = owner[0], -1
    close_fd(fd)
