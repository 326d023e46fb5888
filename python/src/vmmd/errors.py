"""The client library's errors: VmmdError with the daemon's code and gRPC
status, made as the subclass Python code expects for its kind: out of memory
is a MemoryError (and CuPy's OutOfMemoryError where CuPy is loaded), an
unreachable or lost daemon a ConnectionError, a deadline a TimeoutError."""
from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Type

import grpc

from ._declared import CODES, ERROR_CODE_KEY

__all__ = ["CODES", "ERROR_CODE_KEY", "STATUS", "VmmdError", "invalid"]

# gRPC status numbers by name, and names by number.
STATUS: dict = {code.name: code.value[0] for code in grpc.StatusCode}
_STATUS_NAMES = {number: name for name, number in STATUS.items()}


class VmmdError(Exception):
    """An error from the daemon or the client library.

    `code` names the rule or condition ("NOT_ALIGNED", "ALREADY_MAPPED",
    "SESSION_LOST"); `status` is the gRPC status number (3 for
    INVALID_ARGUMENT) and `status_name` its name; `message` says what happened
    with the values involved.
    """

    def __new__(cls, code: str, status: int, message: str) -> "VmmdError":
        # VmmdError(...) picks the subclass of its kind, wherever the error is made (here or from the daemon).
        kind = _kind_of(str(code), int(status)) if cls is VmmdError else cls
        # A builtin base's __new__ (OSError's for TimeoutError): the one object.__new__'s safety check asks for.
        base: Any = kind
        while base.__module__ != "builtins":
            base = base.__base__
        return base.__new__(kind, f"{code}: {message}")  # type: ignore[no-any-return]

    def __init__(self, code: str, status: int, message: str) -> None:
        # Exception's own: a foreign base's __init__ (CuPy's takes sizes) never sees our arguments.
        Exception.__init__(self, f"{code}: {message}")
        self.code = code
        self.status = int(status)
        self.message = message

    @property
    def status_name(self) -> str:
        return _STATUS_NAMES.get(self.status, str(self.status))

    @property
    def out_of_memory(self) -> bool:
        """Memory or quota exhaustion (RESOURCE_EXHAUSTED, or an OUT_OF_MEMORY code)."""
        return self.status == STATUS["RESOURCE_EXHAUSTED"] or "OUT_OF_MEMORY" in self.code

    @property
    def error_code(self) -> int:
        """Futhark's error code, as the TypeScript client's errorCode: OUT_OF_MEMORY (3) or PROGRAM_ERROR (2)."""
        return 3 if self.out_of_memory else 2

    def __reduce__(self) -> Any:
        return (VmmdError, (self.code, self.status, self.message))

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> "VmmdError":
        """Wraps a grpc error, taking the string code from the trailers."""
        status_code: Optional[grpc.StatusCode] = error.code() if hasattr(error, "code") else None
        status = status_code.value[0] if status_code is not None else STATUS["UNKNOWN"]
        code: Optional[str] = None
        try:
            for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
                if key == ERROR_CODE_KEY:
                    code = value if isinstance(value, str) else value.decode()
        except Exception:  # a locally made error has no trailers
            pass
        if code is None:
            code = status_code.name if status_code is not None else "UNKNOWN"
            # The channel could not reach the daemon at all.
            if status_code == grpc.StatusCode.UNAVAILABLE:
                code = "DAEMON_UNREACHABLE"
        details = error.details() if hasattr(error, "details") else None  # type: ignore[attr-defined]
        return cls(code, status, details or str(error))


class OutOfMemoryError(VmmdError, MemoryError):
    """The daemon's memory or a quota is exhausted (RESOURCE_EXHAUSTED, or an
    OUT_OF_MEMORY code): caught by `except MemoryError`, and by `except
    cupy.cuda.memory.OutOfMemoryError` when CuPy is loaded."""


class VmmdConnectionError(VmmdError, ConnectionError):
    """The daemon is unreachable or the session with it is gone (UNAVAILABLE:
    DAEMON_UNREACHABLE, SESSION_LOST, SESSION_SOCKET_FULL…)."""


class VmmdTimeoutError(VmmdError, TimeoutError):
    """A call's deadline passed (DEADLINE_EXCEEDED: NO_ANSWER, NO_GREETING,
    TRANSFER_NOT_RECEIVED, a gRPC call's deadline)."""


# The OutOfMemoryError that CuPy's caller also catches, made once per CuPy error class.
_CUPY_OUT_OF_MEMORY: Dict[type, Type[VmmdError]] = {}


def _out_of_memory_class() -> Type[VmmdError]:
    """OutOfMemoryError, or where CuPy is loaded (a caller can only catch its
    class then) a subclass that is CuPy's OutOfMemoryError too."""
    memory = sys.modules.get("cupy.cuda.memory")
    cupy_class = getattr(memory, "OutOfMemoryError", None)
    if not isinstance(cupy_class, type) or not issubclass(cupy_class, MemoryError):
        return OutOfMemoryError
    made = _CUPY_OUT_OF_MEMORY.get(cupy_class)
    if made is None:
        made = type("OutOfMemoryError", (OutOfMemoryError, cupy_class), {"__module__": __name__, "__doc__": OutOfMemoryError.__doc__})
        _CUPY_OUT_OF_MEMORY[cupy_class] = made
    return made


def _kind_of(code: str, status: int) -> Type[VmmdError]:
    if status == STATUS["RESOURCE_EXHAUSTED"] or "OUT_OF_MEMORY" in code:
        return _out_of_memory_class()
    if status == STATUS["UNAVAILABLE"]:
        return VmmdConnectionError
    if status == STATUS["DEADLINE_EXCEEDED"]:
        return VmmdTimeoutError
    return VmmdError


def invalid(code: str, message: str) -> VmmdError:
    """A refusal of bad input by the client library (INVALID_ARGUMENT)."""
    return VmmdError(code, STATUS["INVALID_ARGUMENT"], message)
