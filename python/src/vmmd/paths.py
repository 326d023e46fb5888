"""Where the daemon's sockets live: the same default as the daemon (common/paths.ts)."""
from __future__ import annotations

import os
import tempfile
from typing import Mapping, Optional, Tuple

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
