"""Checked values of the session's calls: deadlines from timeouts, the
busy-poll budget, and ids as the session socket spells them."""
from __future__ import annotations

import math
import operator
import os
import time
from typing import Any, Optional

from .errors import STATUS, VmmdError

# How long a caller spins for its answer before it sleeps in poll (DEFAULT_BUSY_POLL_US, as the TypeScript
# client: common/busy-poll.ts): a sleeping thread's wake-up costs more than a short spin.
from ._declared import DEFAULT_BUSY_POLL_US  # noqa: F401  (shared with the daemon, generated)


def seconds_setting(value: Optional[float], variable: str, default: float, *, keyword: str, code: str, what: str, zero_allowed: bool) -> float:
    """A duration in seconds: `value` (the caller's `keyword=`), else the
    environment `variable`, else `default`; finite, and above 0 unless `zero_allowed`.
    Raises VmmdError INVALID_ARGUMENT `code`, naming `what`, the value and where it may be set."""
    raw: Any = value if value is not None else os.environ.get(variable, default)
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (seconds >= 0 if zero_allowed else seconds > 0) or seconds == math.inf:
        rule = ">= 0" if zero_allowed else "> 0"
        raise VmmdError(code, STATUS["INVALID_ARGUMENT"], f"{what} {raw!r}: must be a finite number of seconds {rule} ({variable} or {keyword}=)")
    return seconds


def switch_setting(variable: str, default: bool, what: str) -> bool:
    """An on/off switch from the environment `variable`: 1 (on) or 0 (off), else `default`.
    Raises VmmdError INVALID_ARGUMENT BAD_CONFIG naming the variable, its value and `what` it turns on."""
    raw = os.environ.get(variable)
    if raw is None or raw.strip() == "":
        return default
    if raw.strip() not in ("0", "1"):
        raise VmmdError("BAD_CONFIG", STATUS["INVALID_ARGUMENT"], f"{variable}={raw!r}: it is 1 ({what}) or 0 (not)")
    return raw.strip() == "1"


def deadline_of(timeout: Optional[float]) -> Optional[float]:
    """The monotonic deadline of a wait of `timeout` seconds; None (no limit) for None or +inf.
    Raises VmmdError INVALID_ARGUMENT BAD_TIMEOUT for NaN."""
    if timeout is None or timeout == math.inf:
        return None
    if timeout != timeout:
        raise VmmdError("BAD_TIMEOUT", STATUS["INVALID_ARGUMENT"], "timeout nan is not a number of seconds")
    return time.monotonic() + timeout


def left_until(deadline: Optional[float]) -> Optional[float]:
    """Seconds until `deadline` (0 once passed); None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def busy_poll_budget(option: Optional[int] = None, env: Optional[str] = None) -> int:
    """The busy-poll budget in microseconds: the option, else
    VMMD_CLIENT_BUSY_POLL_US, else DEFAULT_BUSY_POLL_US (0: never spin).
    Raises VmmdError INVALID_ARGUMENT BAD_OPTION naming the value and the rule."""
    if env is None:
        env = os.environ.get("VMMD_CLIENT_BUSY_POLL_US")
    if option is not None:
        value: Any = option
        source = "busy_poll_us"
    elif env is not None and env != "":
        source = "VMMD_CLIENT_BUSY_POLL_US"
        try:
            value = int(env, 10)
        except ValueError:
            value = env
    else:
        return DEFAULT_BUSY_POLL_US
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value > 10_000:
        raise VmmdError("BAD_OPTION", STATUS["INVALID_ARGUMENT"], f"{source} must be a whole number of microseconds from 0 to 10000, got {option if option is not None else env!r}")
    return value


def u64(value: Any, what: str) -> str:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value >= 1 << 64:
        raise VmmdError("BAD_ID", STATUS["INVALID_ARGUMENT"], f"{what} {value!r} is not an integer in [0, 2^64)")
    return str(value)


def allocation_id(value: Any) -> str:
    """An allocation id as the socket spells it: any integer type (a numpy
    integer too) in [0, 2^64). Raises VmmdError INVALID_ARGUMENT BAD_ID."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else value
    except TypeError:
        number = value
    return u64(number, "allocation")


def timeout_seconds(timeout: Optional[float], default: float) -> float:
    """A call's `timeout` in seconds, `default` for None. Raises VmmdError
    INVALID_ARGUMENT BAD_TIMEOUT for what is not a number of seconds above 0."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise VmmdError("BAD_TIMEOUT", STATUS["INVALID_ARGUMENT"], f"timeout {timeout!r} is not a number of seconds above 0")
    return float(timeout)
