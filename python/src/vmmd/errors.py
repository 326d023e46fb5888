"""The one exception class of the client library."""
from __future__ import annotations

from typing import Any, Optional

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

    def __init__(self, code: str, status: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
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


def invalid(code: str, message: str) -> VmmdError:
    """A refusal of bad input by the client library (INVALID_ARGUMENT)."""
    return VmmdError(code, STATUS["INVALID_ARGUMENT"], message)
