"""Where the daemon's sockets live: the same default as the daemon (common/paths.ts)."""
from __future__ import annotations

import os
import re
import tempfile
from typing import List, Mapping, Optional, Sequence, Tuple

GRPC_SOCKET_NAME = "vmmd.sock"
SESSION_SOCKET_NAME = "vmmd.session.sock"


def _writable(path: str) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def default_socket_dir(env: Optional[Mapping[str, str]] = None) -> str:
    """VMMD_SOCKET_DIR if set; else /run/vmmd when it exists (and is usable) or
    /run is writable; else $XDG_RUNTIME_DIR/vmmd; else /tmp/vmmd-$UID."""
    env = os.environ if env is None else env
    if env.get("VMMD_SOCKET_DIR"):
        return env["VMMD_SOCKET_DIR"]
    if os.path.exists("/run/vmmd"):
        if _writable("/run/vmmd") or os.path.exists(os.path.join("/run/vmmd", GRPC_SOCKET_NAME)):
            return "/run/vmmd"
    elif _writable("/run"):
        return "/run/vmmd"
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and _writable(runtime):
        return os.path.join(runtime, "vmmd")
    return os.path.join(tempfile.gettempdir(), f"vmmd-{os.getuid()}")


def socket_paths(directory: str) -> Tuple[str, str]:
    """(gRPC socket, session socket) in `directory`."""
    return os.path.join(directory, GRPC_SOCKET_NAME), os.path.join(directory, SESSION_SOCKET_NAME)


def where_else(tried: str, env: Optional[Mapping[str, str]] = None, candidates: Optional[Sequence[str]] = None) -> str:
    """Where else a daemon may be, for a client that could not reach one in
    `tried`: the other default places that hold a session socket, or that
    exist but this user may not look in (a daemon started by root or another
    user), and how to point the client there (common/paths.ts whereElse)."""
    env = os.environ if env is None else env
    if candidates is None:
        candidates = ["/run/vmmd"]
        if env.get("XDG_RUNTIME_DIR"):
            candidates.append(os.path.join(env["XDG_RUNTIME_DIR"], "vmmd"))
        temporary = tempfile.gettempdir()
        try:
            candidates += [os.path.join(temporary, name) for name in sorted(os.listdir(temporary)) if re.fullmatch(r"vmmd-\d+", name)]
        except OSError:
            pass  # no temporary directory to list
    found: List[str] = []
    for directory in candidates:
        if os.path.realpath(directory) == os.path.realpath(tried):
            continue
        try:
            os.stat(os.path.join(directory, SESSION_SOCKET_NAME))
            found.append(f"a daemon's sockets are in {directory}")
        except PermissionError:
            try:
                info = os.stat(directory)
            except OSError:
                continue  # not even the directory itself can be seen from here
            found.append(f"{directory} exists, but uid {os.getuid()} may not look in it (owner uid {info.st_uid}, group {info.st_gid}: join that group)")
        except OSError:
            continue
    hint = "set VMMD_SOCKET_DIR (or connect(socket_dir=...)) to the directory of the daemon's sockets"
    return "; ".join([*found, hint])
