"""Idle pools give their free memory back by themselves: one thread per
process watches them (weakly) and calls their trim_if_idle()."""
from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Optional

from ._values import seconds_setting

IDLE_SECONDS = 10.0


def idle_seconds_setting(value: Optional[float]) -> float:
    """Seconds an idle pool keeps its free chunks: `value`, else
    VMMD_POOL_IDLE_SECONDS, else IDLE_SECONDS; 0 keeps them until trim().
    Raises VmmdError INVALID_ARGUMENT BAD_IDLE_SECONDS."""
    return seconds_setting(value, "VMMD_POOL_IDLE_SECONDS", IDLE_SECONDS, keyword="idle_seconds", code="BAD_IDLE_SECONDS", what="pool idle time", zero_allowed=True)



class _Reaper:
    """One thread per process that gives idle pools' free memory back
    (trim_if_idle); it holds the pools weakly and never runs in a finalizer."""

    def __init__(self) -> None:
        self._pools: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._pid = 0

    def watch(self, pool: Any) -> None:
        with self._lock:
            self._pools.add(pool)
            # A forked child has the set but not the thread.
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="vmmd-pool-idle", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            pools = list(self._pools)
            settings = [pool.idle_seconds for pool in pools if pool.idle_seconds > 0]
            time.sleep(min(1.0, max(0.02, min(settings) / 4)) if settings else 1.0)
            for pool in pools:
                try:
                    pool.trim_if_idle()
                except Exception as error:  # noqa: BLE001 - the next tick tries again
                    pool.counters["idle_trim_failures"] += 1
                    pool.last_idle_error = error  # type: ignore[attr-defined]
            del pools


REAPER = _Reaper()
