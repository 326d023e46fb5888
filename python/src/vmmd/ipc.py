"""vmmd memory named in the 64 bytes of a CUipcMemHandle: the allocation, the
offset in it and the Share key, so that Numba's IPC handles (pickled, or
their bytes passed to cuda.open_ipc_array) travel as they always do."""
from __future__ import annotations

import struct
from typing import Any, Optional, Tuple

from .errors import STATUS, VmmdError

IPC_MAGIC = b"VMMD"
IPC_VERSION = 1
_IPC_HEADER = struct.Struct("<4sBQQB")


def encode_ipc_handle(allocation_id: int, offset: int, share_key: str) -> bytes:
    """The 64 bytes of a CUipcMemHandle that name vmmd memory."""
    key = share_key.encode("ascii")
    raw = _IPC_HEADER.pack(IPC_MAGIC, IPC_VERSION, allocation_id, offset, len(key)) + key
    if len(raw) > 64:
        raise VmmdError("SHARE_KEY_TOO_LONG", STATUS["INVALID_ARGUMENT"], f"a share key of {len(key)} bytes does not fit a CUipcMemHandle (at most {64 - _IPC_HEADER.size})")
    return raw.ljust(64, b"\0")


def decode_ipc_handle(handle: Any) -> Optional[Tuple[int, int, str]]:
    """(allocation id, offset, share key) when the handle names vmmd memory, else None."""
    raw = getattr(handle, "reserved", handle)
    if not isinstance(raw, (bytes, bytearray)):
        try:
            raw = bytes(b & 0xFF for b in raw)
        except TypeError:
            return None
    raw = bytes(raw)
    if len(raw) < _IPC_HEADER.size or raw[:4] != IPC_MAGIC:
        return None
    _, version, allocation_id, offset, length = _IPC_HEADER.unpack_from(raw)
    if version != IPC_VERSION:
        return None
    return allocation_id, offset, raw[_IPC_HEADER.size : _IPC_HEADER.size + length].decode("ascii")
