"""The Stores service: typed calls, opening a store (its memory mapped
here), watching events, and the data path."""
from __future__ import annotations

import mmap
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from . import _proto
from ._rpc import STREAM_CHUNK_BYTES, Message, Request, _Service, sealed_memfd
from .errors import STATUS, VmmdError
from .memory import ArrayView, CudaImportedMemory, HostImportedMemory, ImportedMemory
from .session import ClientSession

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

    def view(self, dtype: Any = "|u1", shape: Optional[Tuple[int, ...]] = None, offset: int = 0) -> ArrayView:
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

    def create_store(self, request: Request = None, timeout: Optional[float] = None, **fields: Any) -> Message:
        """A store of an allocation; hand_over gives it to the daemon (it outlives this session).
        Raises VmmdError NAME_TAKEN, UNKNOWN_ALLOCATION, NOT_OWNER…"""
        return self._service.unary("CreateStore", request, timeout=timeout, **fields)

    def attach_descriptor(self, fd: int, target: str = "STORE_TARGET_SYSMEM", device: int = 0, size: int = 0, read_only: bool = False, name: str = "", has_deleter: bool = False, timeout: Optional[float] = None) -> Message:
        """Sends a descriptor and makes a store of it (the caller keeps its fd).
        Raises VmmdError NO_CUDA_BACKEND, UNKNOWN_DEVICE, BAD_DESCRIPTOR, NAME_TAKEN."""
        transfer = self._session.send_descriptor(fd, self._service.seconds(timeout))
        return self._service.unary("Attach", transfer_id=int(transfer), target=target, device=device, size=size, read_only=read_only, name=name, has_deleter=has_deleter, timeout=timeout)

    def attach_bytes(self, data: Any, name: str = "", read_only: bool = False, timeout: Optional[float] = None) -> Message:
        """Copies `data` into a new sealed memfd and attaches it as a SYSMEM store."""
        view = memoryview(data).cast("B")
        page = mmap.PAGESIZE
        fd = sealed_memfd("vmmd:sysmem", max(page, (view.nbytes + page - 1) // page * page))
        try:
            os.pwrite(fd, view, 0) if view.nbytes else None
            return self.attach_descriptor(fd, "STORE_TARGET_SYSMEM", 0, view.nbytes, read_only, name, timeout=timeout)
        finally:
            os.close(fd)

    def open(self, store: StoreName, writable: bool = False, timeout: Optional[float] = None) -> OpenedStore:
        """Opens a store and maps it here: read-only unless `writable`.
        Raises VmmdError UNKNOWN_STORE, STORE_DETACHED, STORE_READ_ONLY (asked writable); VmmdTimeoutError past `timeout`."""
        seconds = self._service.seconds(timeout)
        if not self._session.closed:
            # The session socket: the descriptor comes with the answer, one round trip.
            opened, fd = self._session.open_store(_store_ref(store), writable, seconds)
            info = opened.store
        else:
            opened = self._service.unary("Open", store=_store_ref(store), writable=writable, timeout=seconds)
            info = opened.store
            fd = self._session.take_transfer(opened.transfer_id, seconds)
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
                self.close(int(info.id), timeout=seconds)
            except VmmdError:
                pass
            raise
        return OpenedStore(info, memory, self)

    def close(self, store_id: int, timeout: Optional[float] = None) -> Message:
        """Drops one open of this session."""
        return self._service.unary("Close", store_id=int(store_id), timeout=timeout)

    def detach(self, store: StoreName, timeout: Optional[float] = None) -> Message:
        """No new opens; returns once every daemon operation on the store has ended."""
        return self._service.unary("Detach", store=_store_ref(store), timeout=timeout)

    def list(self, timeout: Optional[float] = None) -> List[Message]:
        return list(self._service.unary("List", timeout=timeout).stores)

    def watch(self, since: int = 0, timeout: Optional[float] = None) -> Iterator[Message]:
        """Store events after `since`, as they happen (an iterator; close it to
        stop); `timeout`: how long the whole watch lasts (None: no limit)."""
        return self._service.server_stream("Watch", since=since, timeout=timeout)

    def read(self, span: Mapping[str, Any], length: int, timeout: Optional[float] = None) -> bytes:
        """Bytes of a store (span: store_id/offset or address)."""
        return b"".join(chunk.data for chunk in self._service.server_stream("Read", span=dict(span), length=length, timeout=self._service.seconds(timeout)))

    def write(self, span: Mapping[str, Any], data: Any, timeout: Optional[float] = None) -> int:
        """Writes bytes through to a store; returns once they are in its memory."""
        view = memoryview(data).cast("B")
        Write = _proto.message("DataWriteRequest")

        def messages() -> Iterator[Message]:
            for offset in range(0, max(view.nbytes, 1), STREAM_CHUNK_BYTES):
                yield Write(span=dict(span) if offset == 0 else None, data=bytes(view[offset : offset + STREAM_CHUNK_BYTES]))

        return int(self._service.client_stream("Write", messages(), timeout).bytes_written)

    def fill(self, span: Mapping[str, Any], length: int, value: int, timeout: Optional[float] = None) -> Message:
        return self._service.unary("Fill", span=dict(span), length=length, value=value, timeout=timeout)

    def copy(self, source: Mapping[str, Any], target: Mapping[str, Any], length: int, timeout: Optional[float] = None) -> Message:
        return self._service.unary("Copy", source=dict(source), target=dict(target), length=length, timeout=timeout)
