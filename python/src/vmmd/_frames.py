"""The session socket's frames (proto/vmmd/v1/session.proto, docs/PROTOCOL.md):
one SEQPACKET datagram is one ClientFrame or DaemonFrame in protobuf's binary
encoding, built from the descriptor set the package ships (vmmd._proto). A
request's body is its RPC's request message and its answer's body the RPC's
response, so what the session returns are the RPCs' own messages."""
from __future__ import annotations

import json
from typing import Any, Optional

from . import _proto
from ._declared import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "ClientFrame", "DaemonFrame"]

ClientFrame = _proto.message("ClientFrame")
DaemonFrame = _proto.message("DaemonFrame")

# The bodies that answer a request (by its id), and those whose datagram carries a descriptor.
ANSWERS = ("allocated", "released", "shared", "exported", "opened", "pong")
WITH_DESCRIPTOR = ("allocated", "exported", "opened")


def encode(**fields: Any) -> bytes:
    """The bytes of a ClientFrame with `fields` (request=, and one body: hello=, allocate=…)."""
    return ClientFrame(**fields).SerializeToString()


def is_protocol1(data: bytes) -> bool:
    """A JSON object, a frame of session protocol 1 ("{" would open a protobuf group, which no frame has)."""
    return data[:1] == b"{"


def late_hello_refusal(data: bytes) -> Optional[str]:
    """Where `data` is a daemon's protocol-1 refusal naming this protocol as its own (it took a client's hello,
    come late on a loaded machine, for the silence of a client of protocol 1): the refusal's message; else None."""
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    if isinstance(parsed, dict) and parsed.get("type") == "error" and parsed.get("code") == "PROTOCOL_VERSION" and parsed.get("protocol") == PROTOCOL_VERSION:
        return str(parsed.get("message"))
    return None


def decode(data: bytes) -> Any:
    """The DaemonFrame in `data`, or None for bytes that are not one."""
    if is_protocol1(data):
        return None
    try:
        return DaemonFrame.FromString(data)
    except Exception:  # protobuf's DecodeError, or anything a malformed frame raises: dropped by the caller
        return None


def body_of(frame: Any) -> Optional[str]:
    """The case of a frame's body ("allocated", "error"…), or None."""
    return None if frame is None else frame.WhichOneof("body")


def answer_key(frame: Any) -> Optional[str]:
    """The key of the request a frame answers ("request:N"), or None."""
    kind = body_of(frame)
    if frame is not None and frame.request and (kind in ANSWERS or kind == "error"):
        return f"request:{frame.request}"
    return None
