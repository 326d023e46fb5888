"""DLPack (the unversioned DLManagedTensor protocol) for vmmd memory, made
with ctypes: `__dlpack__` gives a "dltensor" capsule of one contiguous array,
`__dlpack_device__` says where it lives (kDLCPU for host memory, kDLCUDA for
device memory). The capsule keeps the view's memory object alive until the
consumer's deleter runs. Read-only memory is refused: this version of the
protocol has no read-only flag, and a consumer could write through it."""
from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Any, Dict, Tuple

from .errors import STATUS, VmmdError

KDL_CPU = 1
KDL_CUDA = 2
_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}  # kDLInt, kDLUInt, kDLFloat, kDLBool


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_NAME = b"dltensor"
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

# Invariant: every capsule made and not yet deleted, by its manager_ctx key:
# the tensor struct, its shape array and the view whose memory it points at.
_alive: Dict[int, Tuple[Any, Any, Any]] = {}
_lock = threading.Lock()
_keys = itertools.count(1)


def _delete(managed: Any) -> None:
    key = managed.contents.manager_ctx
    with _lock:
        _alive.pop(int(key or 0), None)


_deleter = _DELETER(_delete)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule: int) -> None:
    # A capsule nobody consumed still has its name: the producer deletes it.
    if _capsule_is_valid(capsule, _NAME):
        pointer = _capsule_pointer(capsule, _NAME)
        _delete(ctypes.cast(pointer, ctypes.POINTER(DLManagedTensor)))


def capsule(interface: Dict[str, Any], owner: Any, device_type: int, device_id: int) -> Any:
    """A "dltensor" capsule for an array interface dict (contiguous, not read-only)."""
    address, read_only = interface["data"]
    if read_only:
        raise VmmdError("READ_ONLY", STATUS["FAILED_PRECONDITION"], "DLPack (unversioned) cannot say read-only: use __cuda_array_interface__ or __array_interface__ for read-only vmmd memory")
    typestr = interface["typestr"]
    kind, itemsize = typestr[1], int(typestr[2:])
    if kind not in _CODES:
        raise VmmdError("BAD_DTYPE", STATUS["INVALID_ARGUMENT"], f"DLPack has no type for {typestr!r}")
    shape = interface["shape"]
    shape_array = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    managed = DLManagedTensor()
    managed.dl_tensor.data = address
    managed.dl_tensor.device = DLDevice(device_type, device_id)
    managed.dl_tensor.ndim = len(shape)
    managed.dl_tensor.dtype = DLDataType(_CODES[kind], itemsize * 8, 1)
    managed.dl_tensor.shape = shape_array
    managed.dl_tensor.strides = None  # C-contiguous
    managed.dl_tensor.byte_offset = 0
    key = next(_keys)
    managed.manager_ctx = key
    managed.deleter = _deleter
    with _lock:
        _alive[key] = (managed, shape_array, owner)
    return _capsule_new(ctypes.addressof(managed), _NAME, ctypes.cast(_capsule_destructor, ctypes.c_void_p))


def alive() -> int:
    """Capsules made and not yet deleted (tests)."""
    with _lock:
        return len(_alive)
