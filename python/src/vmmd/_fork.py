"""What a child forked from a client process must not keep from its parent:
the parent's sessions (their socket copies would keep them alive in the
daemon while the child lives, and their answers are the parent's) and locks
that a parent thread may have held at the fork (no thread of the child would
ever release them). os.register_at_fork runs the hooks here in the child,
before any of its code."""
from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Callable, List

# Open sessions of this process: each is told of a fork (its forget_after_fork()).
_SESSIONS: "weakref.WeakSet[Any]" = weakref.WeakSet()
# Module state to make anew in a child (shared_client's lock and client).
_HOOKS: List[Callable[[], None]] = []


def track(session: Any) -> None:
    """Tells `session` of a fork, in the child, until it is collected."""
    _SESSIONS.add(session)


def in_child(hook: Callable[[], None]) -> None:
    """Runs `hook` in every child forked from now on."""
    _HOOKS.append(hook)


def _after_fork_in_child() -> None:
    # Each step on its own: one that fails leaves the others to run (the child reports it and goes on).
    for step in [session.forget_after_fork for session in list(_SESSIONS)] + list(_HOOKS):
        try:
            step()
        except Exception as error:  # noqa: BLE001 - a hook's failure must not stop the child's start
            warnings.warn(f"vmmd: cleaning up after fork failed: {error!r}", RuntimeWarning, stacklevel=1)
    _SESSIONS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
