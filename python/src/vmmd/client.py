"""connect(): the session socket and the gRPC channel of one client process,
with one method per RPC of every service (the token sent on each), and the
local half of sharing: import() maps exported memory into this process."""
from __future__ import annotations

import fcntl
import mmap
import os
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import grpc
from google.protobuf import json_format

from . import _proto
from .errors import STATUS, VmmdError
from .memory import CudaImportedMemory, HostImportedMemory, ImportedMemory
from .paths import default_socket_dir, socket_paths
from .session import DEFAULT_BUSY_POLL_US, ClientSession, allocation_id, busy_poll_budget

from ._declared import DEFAULT_STAGING_BYTES, MAX_STAGING_BYTES, SESSION_METADATA_KEY, STAGED_MIN_BYTES

# Largest message a client stream sends.
STREAM_CHUNK_BYTES = 1 << 20

Message = Any
Request = Optional[Mapping[str, Any]]

_LOCATIONS = {"DEVICE": "LOCATION_TYPE_DEVICE", "HOST_NUMA": "LOCATION_TYPE_HOST_NUMA", "HOST": "LOCATION_TYPE_HOST"}


def sealed_memfd(name: str, size: int) -> int:
    """A memfd of `size` bytes that cannot shrink (F_SEAL_SHRINK): the daemon
    maps what clients send it and refuses descriptors that could shrink under
    its mapping."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Service:
    """Calls of one service: each sends the session token and turns gRPC errors into VmmdError."""

    def __init__(self, channel: grpc.Channel, name: str, metadata: Callable[[], List[Tuple[str, str]]], deadline: float) -> None:
        self._calls = _proto.stub(channel, name)
        self._methods = _proto.methods(name)
        self._metadata = metadata
        self._deadline = deadline

    def _request(self, method: str, request: Request, fields: Mapping[str, Any]) -> Message:
        cls = _proto.message(self._methods[method].input_type.name)
        if request is not None and not isinstance(request, Mapping):
            return request  # already a message
        values = {**(request or {}), **fields}
        try:
            return cls(**values)
        except (TypeError, ValueError) as error:
            raise VmmdError("BAD_REQUEST", STATUS["INVALID_ARGUMENT"], f"{method}: {error}") from None

    def unary(self, method: str, request: Request = None, **fields: Any) -> Message:
        message = self._request(method, request, fields)
        try:
            return self._calls[method](message, metadata=self._metadata(), timeout=self._deadline)
        except grpc.RpcError as error:
            raise VmmdError.from_rpc(error) from None

    def server_stream(self, method: str, request: Request = None, timeout: Optional[float] = -1.0, **fields: Any) -> Iterator[Message]:
        message = self._request(method, request, fields)
        call = self._calls[method](message, metadata=self._metadata(), timeout=self._deadline if timeout == -1.0 else timeout)
        try:
            for item in call:
                yield item
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                return
            raise VmmdError.from_rpc(error) from None
        finally:
            call.cancel()

    def unary_future(self, method: str, request: Request = None, **fields: Any) -> "_Future":
        """The call started; result() waits for it (and raises VmmdError)."""
        message = self._request(method, request, fields)
        return _Future(self._calls[method].future(message, metadata=self._metadata(), timeout=self._deadline))

    def client_stream(self, method: str, messages: Iterable[Message]) -> Message:
        try:
            return self._calls[method](iter(messages), metadata=self._metadata(), timeout=self._deadline)
        except grpc.RpcError as error:
            raise VmmdError.from_rpc(error) from None

    def call(self, method: str) -> Any:
        return self._calls[method]


class _Future:
    """A unary call in flight."""

    def __init__(self, future: Any) -> None:
        self._future = future

    def result(self) -> Message:
        try:
            return self._future.result()
        except grpc.RpcError as error:
            raise VmmdError.from_rpc(error) from None


class DevicesApi:
    """The Devices service."""

    def __init__(self, service: _Service) -> None:
        self._service = service

    def list_devices(self) -> Message:
        return self._service.unary("ListDevices")

    def get_memory_info(self, request: Request = None, **fields: Any) -> Message:
        """Raises VmmdError OUT_OF_RANGE UNKNOWN_DEVICE."""
        return self._service.unary("GetMemoryInfo", request, **fields)

    def get_granularity(self, request: Request = None, **fields: Any) -> Message:
        """Raises VmmdError OUT_OF_RANGE UNKNOWN_DEVICE."""
        return self._service.unary("GetGranularity", request, **fields)


class AdminApi:
    """The Admin service."""

    def __init__(self, service: _Service) -> None:
        self._service = service

    def get_stats(self, request: Request = None, **fields: Any) -> Message:
        return self._service.unary("GetStats", request, **fields)

    def get_report(self) -> Any:
        """The daemon's report, parsed from its JSON."""
        import json

        return json.loads(self._service.unary("GetReport").json)

    def list_sessions(self) -> Message:
        return self._service.unary("ListSessions")

    def list_objects(self, request: Request = None, **fields: Any) -> Message:
        return self._service.unary("ListObjects", request, **fields)

    def clear_caches(self) -> Message:
        return self._service.unary("ClearCaches")

    def get_version(self) -> Message:
        return self._service.unary("GetVersion")


class StagingBuffer:
    """The session's staging buffer: a sealed memfd mapped here and, once sent
    (OpenStaging), in the daemon; large reads and writes go through its two
    halves so that only offsets travel over gRPC. One staged copy at a time."""

    def __init__(self, size: int, service: _Service, session: ClientSession) -> None:
        self.size = size
        self._service = service
        self._session = session
        self._map: Optional[mmap.mmap] = None
        self._lock = threading.Lock()

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            fd = sealed_memfd("vmmd:staging", self.size)
            try:
                staging = mmap.mmap(fd, self.size, access=mmap.ACCESS_WRITE)
                try:
                    self._service.unary("OpenStaging", transfer_id=int(self._session.send_descriptor(fd)))
                except BaseException:
                    staging.close()
                    raise
            finally:
                os.close(fd)
            self._map = staging
        return self._map

    def read(self, address: int, length: int, into: Optional[memoryview] = None) -> memoryview:
        """Copies `length` bytes at `address` out of the daemon's memory: the
        daemon fills one half while this process copies the other out."""
        with self._lock:
            staging = memoryview(self._mapped())
            half = self.size // 2
            out = into if into is not None else memoryview(bytearray(length))
            pending: Optional[_Future] = self._service.unary_future("ReadStaged", address=address, length=min(half, length), staging_offset=0)
            offset, slot = 0, 0
            try:
                while offset < length:
                    count = min(half, length - offset)
                    assert pending is not None
                    pending.result()
                    pending = None
                    following = offset + count
                    if following < length:
                        pending = self._service.unary_future("ReadStaged", address=address + following, length=min(half, length - following), staging_offset=(1 - slot) * half)
                    out[offset:following] = staging[slot * half : slot * half + count]
                    offset, slot = following, 1 - slot
            finally:
                if pending is not None:  # a copy still in flight must finish before the buffer is reused
                    try:
                        pending.result()
                    except VmmdError:
                        pass
                staging.release()
            return out

    def write(self, address: int, data: memoryview) -> None:
        """Copies `data` into the daemon's memory at `address`: this process
        fills one half while the daemon copies the other in."""
        with self._lock:
            staging = memoryview(self._mapped())
            half = self.size // 2
            in_flight: List[Optional[_Future]] = [None, None]
            offset, slot = 0, 0
            try:
                while offset < data.nbytes:
                    count = min(half, data.nbytes - offset)
                    # A half is free again once the daemon's copy out of it is done.
                    if in_flight[slot] is not None:
                        in_flight[slot].result()  # type: ignore[union-attr]
                    staging[slot * half : slot * half + count] = data[offset : offset + count]
                    in_flight[slot] = self._service.unary_future("WriteStaged", address=address + offset, length=count, staging_offset=slot * half)
                    offset, slot = offset + count, 1 - slot
            finally:
                for future in in_flight:
                    if future is not None:
                        future.result()
                staging.release()

    def close(self) -> None:
        with self._lock:
            if self._map is not None:
                self._map.close()
                self._map = None


def _location_message(location: Any) -> Optional[Dict[str, Any]]:
    """A CreateRequest's location as the session socket's allocate message
    names it; None when it cannot (by UUID, HOST), and the RPC takes it."""
    if location is None:
        return {}
    if isinstance(location, Mapping):
        if location.get("device_uuid"):
            return None
        kind = location.get("type", "LOCATION_TYPE_DEVICE")
        ident = int(location.get("id", 0))
    else:
        if getattr(location, "device_uuid", ""):
            return None
        kind, ident = location.type, int(location.id)
    if isinstance(kind, int):
        kind = {0: "LOCATION_TYPE_DEVICE", 1: "LOCATION_TYPE_DEVICE", 2: "LOCATION_TYPE_HOST", 3: "LOCATION_TYPE_HOST_NUMA"}.get(kind, "?")
    if kind in ("LOCATION_TYPE_DEVICE", "LOCATION_TYPE_UNSPECIFIED", "DEVICE"):
        return {"type": "DEVICE", "id": ident}
    if kind in ("LOCATION_TYPE_HOST_NUMA", "HOST_NUMA"):
        return {"type": "HOST_NUMA", "id": ident}
    return None


def _release_response(answer: Dict[str, Any]) -> Message:
    """A session-socket `released` answer as the Release RPC's ReleaseResponse."""
    return _proto.message("ReleaseResponse")(
        freed=bool(answer["freed"]), handle_references=int(answer["handleReferences"]), mapping_count=int(answer["mappingCount"])
    )


class VirtualMemoryApi:
    """The VirtualMemory service, and mapping exported memory here."""

    def __init__(self, service: _Service, session: ClientSession, backend: str, staging_bytes: int) -> None:
        self._service = service
        self._session = session
        self.backend = backend
        self._staging = StagingBuffer(staging_bytes, service, session) if staging_bytes > 0 else None

    def reserve(self, request: Request = None, **fields: Any) -> Message:
        """Raises VmmdError INVALID_ARGUMENT ZERO_SIZE, NOT_ALIGNED, BAD_ALIGNMENT."""
        return self._service.unary("Reserve", request, **fields)

    def free_address(self, request: Request = None, **fields: Any) -> Message:
        """Raises VmmdError NOT_FOUND NOT_RESERVED, INVALID_ARGUMENT PARTIAL_FREE, FAILED_PRECONDITION RESERVATION_MAPPED."""
        return self._service.unary("FreeAddress", request, **fields)

    def create(self, request: Request = None, **fields: Any) -> Message:
        """Raises VmmdError INVALID_ARGUMENT ZERO_SIZE, NOT_ALIGNED; RESOURCE_EXHAUSTED OUT_OF_MEMORY; OUT_OF_RANGE UNKNOWN_DEVICE."""
        return self._service.unary("Create", request, **fields)

    def release(self, request: Request = None, **fields: Any) -> Message:
        """Drops this session's reference to an allocation: on the session
        socket (one round trip), or the Release RPC where the socket is gone.
        Returns a ReleaseResponse either way.
        Raises VmmdError NOT_FOUND UNKNOWN_ALLOCATION, FAILED_PRECONDITION ALREADY_RELEASED, PERMISSION_DENIED NOT_OWNER."""
        message = self._service._request("Release", request, fields)
        if self._session.closed:
            return self._service.unary("Release", message)
        return _release_response(self._session.release(int(message.allocation_id)))

    def release_many(self, allocation_ids: List[int]) -> List[Union[Message, VmmdError]]:
        """Releases several allocations: on the session socket in one round
        trip (every request sent before any answer is waited for), else one
        Release RPC each. Returns, in order, each ReleaseResponse or the
        VmmdError that refused it; a refusal does not stop the others.
        Raises VmmdError BAD_ID (nothing released) for an id that is not a
        uint64, or SESSION_LOST / NO_ANSWER when the session fails."""
        if not self._session.closed:
            # The session checks every id before it sends any.
            answers = self._session.release_many(list(allocation_ids))
            return [answer if isinstance(answer, VmmdError) else _release_response(answer) for answer in answers]
        ids = [int(allocation_id(allocation)) for allocation in allocation_ids]
        results: List[Union[Message, VmmdError]] = []
        for allocation in ids:
            try:
                results.append(self._service.unary("Release", allocation_id=allocation))
            except VmmdError as error:
                results.append(error)
        return results

    def map(self, request: Request = None, **fields: Any) -> Message:
        """Raises VmmdError ALREADY_MAPPED, NOT_ALIGNED, NONZERO_OFFSET, BEYOND_ALLOCATION, BEYOND_RESERVATION."""
        return self._service.unary("Map", request, **fields)

    def unmap(self, request: Request = None, **fields: Any) -> Message:
        """Raises VmmdError NOT_FOUND NOT_MAPPED, INVALID_ARGUMENT PARTIAL_UNMAP."""
        return self._service.unary("Unmap", request, **fields)

    def set_access(self, request: Request = None, **fields: Any) -> Message:
        """Raises VmmdError FAILED_PRECONDITION NOT_FULLY_MAPPED, INVALID_ARGUMENT PARTIAL_MAPPING."""
        return self._service.unary("SetAccess", request, **fields)

    def get_access(self, request: Request = None, **fields: Any) -> Message:
        """Raises VmmdError NOT_FOUND NOT_MAPPED."""
        return self._service.unary("GetAccess", request, **fields)

    def export(self, request: Request = None, **fields: Any) -> Message:
        """The raw Export call; import_() maps the descriptor. Raises VmmdError NOT_OWNER, NO_SESSION."""
        return self._service.unary("Export", request, **fields)

    def share(self, request: Request = None, **fields: Any) -> Message:
        """A key that lets another session import the allocation (on the
        session socket, or the Share RPC where it is gone). Raises VmmdError PERMISSION_DENIED NOT_OWNER."""
        message = self._service._request("Share", request, fields)
        if self._session.closed:
            return self._service.unary("Share", message)
        return _proto.message("ShareResponse")(share_key=self._session.share(int(message.allocation_id)))

    def import_transfer(self, request: Request = None, **fields: Any) -> Message:
        """The raw Import call; import_descriptor() sends the descriptor first."""
        return self._service.unary("Import", request, **fields)

    def get_properties(self, request: Request = None, **fields: Any) -> Message:
        """Raises VmmdError NOT_FOUND UNKNOWN_ALLOCATION."""
        return self._service.unary("GetProperties", request, **fields)

    def retain_handle(self, request: Request = None, **fields: Any) -> Message:
        """Raises VmmdError NOT_FOUND NOT_MAPPED."""
        return self._service.unary("RetainHandle", request, **fields)

    def allocate_raw(self, request: Request = None, **fields: Any) -> Message:
        """The raw Allocate RPC: the descriptor waits on the session socket under the returned transfer id."""
        return self._service.unary("Allocate", request, **fields)

    def open_staging(self, transfer_id: int) -> Message:
        return self._service.unary("OpenStaging", transfer_id=transfer_id)

    def read_staged(self, request: Request = None, **fields: Any) -> Message:
        return self._service.unary("ReadStaged", request, **fields)

    def write_staged(self, request: Request = None, **fields: Any) -> Message:
        return self._service.unary("WriteStaged", request, **fields)

    def import_(self, allocation_id: int, share_key: str = "", read_only: bool = False, host_access: bool = False) -> ImportedMemory:
        """Exports an allocation and maps it into this process: shared pages on
        the host backend, a device pointer in this process's CUDA context on
        cuda. (import is a Python keyword: hence the underscore.)
        Raises VmmdError from Export, TRANSFER_NOT_RECEIVED, NO_CUDA, LOCAL_MAP_FAILED."""
        if not self._session.closed:
            # The session socket: the descriptor comes with the answer, one round trip.
            answer, fd = self._session.export(int(allocation_id), share_key)
            loc = answer.get("location") or {}
            return self._map_descriptor(
                int(answer["allocation"]), fd, int(answer["size"]), int(answer["granularity"]), int(answer.get("device", 0)), str(answer.get("deviceUuid", "")),
                _LOCATIONS.get(loc.get("type", "DEVICE"), "LOCATION_TYPE_DEVICE"), int(loc.get("id", 0)), read_only, host_access,
            )
        exported = self.export(allocation_id=int(allocation_id), share_key=share_key, handle_type="HANDLE_TYPE_POSIX_FD")
        fd = self._session.take_transfer(exported.transfer_id)
        location = exported.location
        return self._map_descriptor(
            int(exported.allocation_id), fd, int(exported.size), int(exported.granularity), int(exported.device), exported.device_uuid,
            _proto_location_type(location), int(location.id), read_only, host_access,
        )

    def allocate(self, size: int, location: Any = None, host_access: bool = False) -> ImportedMemory:
        """A new allocation, owned by this session and mapped into this
        process, in one round trip (the session socket's allocate; the RPC for
        locations the message cannot name). close() unmaps it here; release()
        frees it in the daemon.
        Raises VmmdError from Create (OUT_OF_MEMORY, NOT_ALIGNED…), NO_CUDA, LOCAL_MAP_FAILED."""
        on_socket = _location_message(location)
        if on_socket is not None:
            answer, fd = self._session.allocate(size, on_socket or None)
            allocation = int(answer["allocation"])
            loc = answer.get("location") or {}
            args = (allocation, fd, int(answer["size"]), int(answer["granularity"]), int(answer.get("device", 0)), str(answer.get("deviceUuid", "")), _LOCATIONS.get(loc.get("type", "DEVICE"), "LOCATION_TYPE_DEVICE"), int(loc.get("id", 0)))
        else:
            response = self.allocate_raw(size=size, location=location)
            fd = self._session.take_transfer(response.transfer_id)
            allocation = int(response.allocation_id)
            args = (allocation, fd, int(response.size), int(response.granularity), int(response.device), response.device_uuid, _proto_location_type(response.location), int(response.location.id))
        try:
            return self._map_descriptor(*args, read_only=False, host_access=host_access)
        except BaseException:
            try:
                self.release(allocation_id=allocation)
            except VmmdError:
                pass
            raise

    def _map_descriptor(self, allocation_id: int, fd: int, size: int, granularity: int, device: int, device_uuid: str, location_type: str, location_id: int, read_only: bool, host_access: bool) -> ImportedMemory:
        if self.backend == "cuda":
            from . import _cuda

            try:
                local = _cuda.local_device(device, device_uuid)
            except BaseException:
                os.close(fd)
                raise
            host_numa = location_id if host_access and location_type == "LOCATION_TYPE_HOST_NUMA" else None
            return CudaImportedMemory.map(allocation_id, fd, size, granularity, local, read_only, host_numa)
        return HostImportedMemory(allocation_id, fd, size, read_only)

    def import_descriptor(self, fd: int, size: int = 0, device: int = 0) -> Message:
        """Sends a descriptor of this process to the daemon and makes an
        allocation of it, owned by this session. The caller keeps its fd.
        Raises VmmdError INVALID_ARGUMENT BAD_DESCRIPTOR, SESSION_LOST."""
        transfer = self._session.send_descriptor(fd)
        return self.import_transfer(transfer_id=int(transfer), device=device, size=size)

    def read(self, address: int, length: int) -> bytes:
        """Reads bytes at a mapped address the daemon may read: through the
        staging buffer from STAGED_MIN_BYTES up, else streamed over gRPC.
        Raises VmmdError NOT_MAPPED, NO_ACCESS, NOT_FULLY_MAPPED."""
        if self._staging is not None and length >= STAGED_MIN_BYTES and not self._session.closed:
            return bytes(self._staging.read(int(address), int(length)))
        chunks = [chunk.data for chunk in self._service.server_stream("Read", address=int(address), length=int(length))]
        return b"".join(chunks)

    def read_into(self, address: int, into: Any) -> memoryview:
        """As read(), into a writable buffer of the caller's (its whole length):
        no new buffer, for callers that read repeatedly. Returns a view of `into`."""
        target = memoryview(into).cast("B")
        if target.readonly:
            raise VmmdError("READ_ONLY_BUFFER", STATUS["INVALID_ARGUMENT"], "read_into needs a writable buffer (a bytearray, a numpy array…)")
        if self._staging is not None and target.nbytes >= STAGED_MIN_BYTES and not self._session.closed:
            return self._staging.read(int(address), target.nbytes, target)
        offset = 0
        for chunk in self._service.server_stream("Read", address=int(address), length=target.nbytes):
            target[offset : offset + len(chunk.data)] = chunk.data
            offset += len(chunk.data)
        return target

    def write(self, address: int, data: Any) -> int:
        """Writes bytes to a mapped address the daemon may write (staged from
        STAGED_MIN_BYTES up). Returns the bytes written.
        Raises VmmdError NOT_MAPPED, NO_ACCESS, NOT_FULLY_MAPPED, READ_ONLY_MEMORY."""
        view = memoryview(data).cast("B")
        if self._staging is not None and view.nbytes >= STAGED_MIN_BYTES and not self._session.closed:
            self._staging.write(int(address), view)
            return view.nbytes
        Write = _proto.message("WriteRequest")

        def messages() -> Iterator[Message]:
            for offset in range(0, max(view.nbytes, 1), STREAM_CHUNK_BYTES):
                yield Write(address=int(address) if offset == 0 else 0, data=bytes(view[offset : offset + STREAM_CHUNK_BYTES]))

        return int(self._service.client_stream("Write", messages()).bytes_written)

    def close_staging(self) -> None:
        if self._staging is not None:
            self._staging.close()


def _proto_location_type(location: Any) -> str:
    if location is None:
        return "LOCATION_TYPE_DEVICE"
    Location = _proto.message("Location")
    return Location.DESCRIPTOR.fields_by_name["type"].enum_type.values_by_number[location.type].name


StoreName = Union[str, int, Mapping[str, Any]]


def _store_ref(store: StoreName) -> Dict[str, Any]:
    if isinstance(store, bool):
        raise VmmdError("BAD_STORE", STATUS["INVALID_ARGUMENT"], f"store {store!r} is neither a name nor an id")
    if isinstance(store, int):
        return {"id": store}
    if isinstance(store, str):
        return {"name": store}
    if isinstance(store, Mapping):
        return {"id": int(store.get("id", 0)), "name": str(store.get("name", ""))}
    raise VmmdError("BAD_STORE", STATUS["INVALID_ARGUMENT"], f"store {store!r} is neither a name nor an id")


class OpenedStore:
    """A store opened by this process: its memory mapped here (`memory`), with
    `__cuda_array_interface__` on the cuda backend. close() unmaps it and
    drops the open."""

    def __init__(self, store: Message, memory: ImportedMemory, api: "StoresApi") -> None:
        self.store = store
        self.memory = memory
        self._api = api
        self._closed = False

    @property
    def size(self) -> int:
        """The store's length (the mapping may be longer: the whole allocation)."""
        return int(self.store.size)

    def view(self, dtype: Any = "|u1", shape: Optional[Tuple[int, ...]] = None, offset: int = 0) -> Any:
        """A typed view of the store (see ImportedMemory.view); the default shape covers the store's length."""
        from .memory import _typestr

        if shape is None:
            shape = ((self.size - offset) // _typestr(dtype)[1],)
        return self.memory.view(dtype, shape, offset)

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        return self.view().__cuda_array_interface__

    def close(self) -> None:
        if self._closed:
            return
        self.memory.close()
        self._closed = True
        self._api.close(int(self.store.id))

    def __enter__(self) -> "OpenedStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class StoresApi:
    """The Stores service: typed calls, opening (the descriptor mapped here,
    read-only for read-only stores), watching events, and the data path."""

    def __init__(self, service: _Service, session: ClientSession, backend: str) -> None:
        self._service = service
        self._session = session
        self.backend = backend

    def create_store(self, request: Request = None, **fields: Any) -> Message:
        """A store of an allocation; hand_over gives it to the daemon (it outlives this session).
        Raises VmmdError NAME_TAKEN, UNKNOWN_ALLOCATION, NOT_OWNER…"""
        return self._service.unary("CreateStore", request, **fields)

    def attach_descriptor(self, fd: int, target: str = "STORE_TARGET_SYSMEM", device: int = 0, size: int = 0, read_only: bool = False, name: str = "", has_deleter: bool = False) -> Message:
        """Sends a descriptor and makes a store of it (the caller keeps its fd).
        Raises VmmdError NO_CUDA_BACKEND, UNKNOWN_DEVICE, BAD_DESCRIPTOR, NAME_TAKEN."""
        transfer = self._session.send_descriptor(fd)
        return self._service.unary("Attach", transfer_id=int(transfer), target=target, device=device, size=size, read_only=read_only, name=name, has_deleter=has_deleter)

    def attach_bytes(self, data: Any, name: str = "", read_only: bool = False) -> Message:
        """Copies `data` into a new sealed memfd and attaches it as a SYSMEM store."""
        view = memoryview(data).cast("B")
        page = mmap.PAGESIZE
        fd = sealed_memfd("vmmd:sysmem", max(page, (view.nbytes + page - 1) // page * page))
        try:
            os.pwrite(fd, view, 0) if view.nbytes else None
            return self.attach_descriptor(fd, "STORE_TARGET_SYSMEM", 0, view.nbytes, read_only, name)
        finally:
            os.close(fd)

    def open(self, store: StoreName, writable: bool = False) -> OpenedStore:
        """Opens a store and maps it here: read-only unless `writable`.
        Raises VmmdError UNKNOWN_STORE, STORE_DETACHED, STORE_READ_ONLY (asked writable)."""
        if not self._session.closed:
            # The session socket: the descriptor comes with the answer, one round trip.
            answer, fd = self._session.open_store(_store_ref(store), writable)
            try:
                opened = json_format.ParseDict(answer, _proto.message("OpenResponse")(), ignore_unknown_fields=True)
            except BaseException:
                os.close(fd)
                raise
            info = opened.store
        else:
            opened = self._service.unary("Open", store=_store_ref(store), writable=writable)
            info = opened.store
            fd = self._session.take_transfer(opened.transfer_id)
        read_only = info.read_only or opened.descriptor_read_only or not writable
        size = int(opened.mapped_size)
        granularity = int(opened.granularity)
        sysmem = info.target == _proto.enum_value("StoreTarget", "STORE_TARGET_SYSMEM")
        try:
            if sysmem or self.backend != "cuda":
                memory: ImportedMemory = HostImportedMemory(int(info.allocation_id), fd, size, read_only)
            else:
                from . import _cuda

                try:
                    device = _cuda.local_device(int(info.device), "")
                except BaseException:
                    os.close(fd)
                    raise
                memory = CudaImportedMemory.map(int(info.allocation_id), fd, size, granularity, device, read_only)
        except BaseException:
            try:
                self.close(int(info.id))
            except VmmdError:
                pass
            raise
        return OpenedStore(info, memory, self)

    def close(self, store_id: int) -> Message:
        """Drops one open of this session."""
        return self._service.unary("Close", store_id=int(store_id))

    def detach(self, store: StoreName) -> Message:
        """No new opens; returns once every daemon operation on the store has ended."""
        return self._service.unary("Detach", store=_store_ref(store))

    def list(self) -> List[Message]:
        return list(self._service.unary("List").stores)

    def watch(self, since: int = 0, timeout: Optional[float] = None) -> Iterator[Message]:
        """Store events after `since`, as they happen (an iterator; close it to stop)."""
        return self._service.server_stream("Watch", since=since, timeout=timeout)

    def read(self, span: Mapping[str, Any], length: int) -> bytes:
        """Bytes of a store (span: store_id/offset or address)."""
        return b"".join(chunk.data for chunk in self._service.server_stream("Read", span=dict(span), length=length))

    def write(self, span: Mapping[str, Any], data: Any) -> int:
        """Writes bytes through to a store; returns once they are in its memory."""
        view = memoryview(data).cast("B")
        Write = _proto.message("DataWriteRequest")

        def messages() -> Iterator[Message]:
            for offset in range(0, max(view.nbytes, 1), STREAM_CHUNK_BYTES):
                yield Write(span=dict(span) if offset == 0 else None, data=bytes(view[offset : offset + STREAM_CHUNK_BYTES]))

        return int(self._service.client_stream("Write", messages()).bytes_written)

    def fill(self, span: Mapping[str, Any], length: int, value: int) -> Message:
        return self._service.unary("Fill", span=dict(span), length=length, value=value)

    def copy(self, source: Mapping[str, Any], target: Mapping[str, Any], length: int) -> Message:
        return self._service.unary("Copy", source=dict(source), target=dict(target), length=length)


class VmmdClient:
    """A connected client: the session (the lease on everything it creates)
    and the services: devices, vmm, stores, admin. Usable as a context manager."""

    def __init__(self, session: ClientSession, socket_dir: str, channel: grpc.Channel, deadline: float, staging_bytes: int, busy_poll_us: int = DEFAULT_BUSY_POLL_US) -> None:
        self.session = session
        self.socket_dir = socket_dir
        self._channel = channel
        self._closing = False
        self.lost = False
        self.on_session_lost: List[Callable[[VmmdError], None]] = []
        metadata = lambda: [(SESSION_METADATA_KEY, session.token)]  # noqa: E731
        self.devices = DevicesApi(_Service(channel, "Devices", metadata, deadline))
        self.admin = AdminApi(_Service(channel, "Admin", metadata, deadline))
        # The hello names the backend; a daemon whose hello does not is asked (an RPC: the channel's first connection).
        self.backend: str = session.backend if session.backend is not None else self.devices.list_devices().backend
        self.vmm = VirtualMemoryApi(_Service(channel, "VirtualMemory", metadata, deadline), session, self.backend, staging_bytes)
        self.stores = StoresApi(_Service(channel, "Stores", metadata, deadline), session, self.backend)
        self._options = (deadline, staging_bytes, busy_poll_us)
        session.on_close.append(self._on_session_close)

    def _on_session_close(self) -> None:
        if self._closing:
            return
        self.lost = True
        error = VmmdError(
            "SESSION_LOST",
            STATUS["UNAVAILABLE"],
            f"session {self.session.id} with vmmd at {self.socket_dir} ended: the daemon went away; everything the session held in the daemon is gone (memory mapped in this process stays valid); reconnect() opens a new session",
        )
        for callback in list(self.on_session_lost):
            callback(error)

    def reconnect(self) -> "VmmdClient":
        """A new session with the daemon at the same socket directory (after a
        restart of the daemon, say). This client stays closed.
        Raises VmmdError UNAVAILABLE DAEMON_UNREACHABLE while no daemon serves the directory."""
        self.close()
        return connect(self.socket_dir, deadline=self._options[0], staging_bytes=self._options[1], busy_poll_us=self._options[2])

    def close(self) -> None:
        """Ends the session: the daemon reclaims everything it owns. Local mappings stay valid."""
        self._closing = True
        self.vmm.close_staging()
        self.session.close()
        self._channel.close()

    def __enter__(self) -> "VmmdClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect(
    socket_dir: Optional[str] = None,
    deadline: float = 30.0,
    connect_timeout: float = 5.0,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    busy_poll_us: Optional[int] = None,
) -> VmmdClient:
    """Opens a session with the daemon and a gRPC channel to it.

    socket_dir: the daemon's socket directory (default VMMD_SOCKET_DIR, then the
    daemon's own default); deadline: seconds per call; staging_bytes: the
    staging buffer of large reads and writes (0: stream everything over gRPC);
    busy_poll_us: how long a caller spins for its answer on the session
    socket before it sleeps (default VMMD_CLIENT_BUSY_POLL_US, else 200; 0:
    never). Raises VmmdError UNAVAILABLE DAEMON_UNREACHABLE when no daemon
    serves the directory, INVALID_ARGUMENT BAD_STAGING_SIZE, BAD_OPTION."""
    page = mmap.PAGESIZE
    if not isinstance(staging_bytes, int) or staging_bytes < 0 or staging_bytes % (2 * page) != 0 or staging_bytes > MAX_STAGING_BYTES:
        raise VmmdError("BAD_STAGING_SIZE", STATUS["INVALID_ARGUMENT"], f"staging_bytes {staging_bytes!r} must be 0 or a positive multiple of twice the page size ({2 * page}), at most 1 GiB")
    spin = busy_poll_budget(busy_poll_us)
    directory = socket_dir or default_socket_dir()
    grpc_path, session_path = socket_paths(directory)
    session = ClientSession.open(session_path, connect_timeout, spin)
    channel = grpc.insecure_channel(f"unix://{grpc_path}")
    try:
        return VmmdClient(session, directory, channel, deadline, staging_bytes, spin)
    except BaseException:
        session.close()
        channel.close()
        raise


_shared_lock = threading.Lock()
_shared: Optional[VmmdClient] = None


def shared_client() -> VmmdClient:
    """This process's one session with the daemon, for the allocators that
    Numba, CuPy and PyTorch load (made on first use with connect()'s
    defaults; made again if the daemon went away)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.session.closed:
            _shared = connect()
        return _shared
