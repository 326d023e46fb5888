"""A unary call of a resumable session that the daemon's going away cut off:
a call that changes nothing goes again once the session serves, whether the
cut reached the client as UNAVAILABLE or as CANCELLED (the stream reset by a
daemon that stopped with the call in flight); a call that is not safe to
repeat fails to its caller, sent once. A Detach goes again too (the end is
the same however often it runs); when the repeat finds the store detached or
gone, the cut-off one did it, and the caller is answered so."""
from __future__ import annotations

import os
import tempfile
from concurrent import futures
from typing import Any, Dict, List, Optional

import grpc
import pytest

from vmmd import _proto
from vmmd._rpc import _Service
from vmmd.errors import ERROR_CODE_KEY, VmmdError


class _Session:
    resume_token = "token"
    closed = False

    def _wait_serving(self, deadline: Optional[float]) -> None:
        return None


# Each call's answer in turn: a status cuts it off; a string is the daemon's refusal with that code.
Cut = Any


def _server(cuts: List[Cut], seen: Dict[str, int], path: str) -> grpc.Server:
    def handler(service: str, name: str) -> Any:
        answer = _proto.message(_proto.methods(service)[name].output_type.name)

        def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
            seen[name] = seen.get(name, 0) + 1
            if cuts:
                cut = cuts.pop(0)
                if isinstance(cut, str):
                    context.set_trailing_metadata(((ERROR_CODE_KEY, cut),))
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION if cut == "STORE_DETACHED" else grpc.StatusCode.NOT_FOUND, cut)
                context.abort(cut, "cut off")
            return answer().SerializeToString()

        return grpc.unary_unary_rpc_method_handler(unary)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler(f"{_proto.PACKAGE}.Admin", {"GetReport": handler("Admin", "GetReport")}),
        grpc.method_handlers_generic_handler(f"{_proto.PACKAGE}.VirtualMemory", {"Create": handler("VirtualMemory", "Create")}),
        grpc.method_handlers_generic_handler(f"{_proto.PACKAGE}.Stores", {"Detach": handler("Stores", "Detach")}),
    ))
    server.add_insecure_port(f"unix:{path}")
    server.start()
    return server


@pytest.fixture()
def rig() -> Any:
    cuts: List[Cut] = []
    seen: Dict[str, int] = {}
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "s.sock")
        server = _server(cuts, seen, path)
        channel = grpc.insecure_channel(f"unix:{path}")
        try:
            yield cuts, seen, channel
        finally:
            channel.close()
            server.stop(None)


@pytest.mark.parametrize("status", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_call_that_changes_nothing_goes_again(rig: Any, status: grpc.StatusCode) -> None:
    cuts, seen, channel = rig
    cuts.append(status)
    admin = _Service(channel, "Admin", lambda: [], 5.0, session=_Session())
    admin.unary("GetReport")
    assert seen["GetReport"] == 2


def test_a_call_not_safe_to_repeat_fails_to_its_caller_sent_once(rig: Any) -> None:
    cuts, seen, channel = rig
    cuts.append(grpc.StatusCode.CANCELLED)
    vmm = _Service(channel, "VirtualMemory", lambda: [], 5.0, session=_Session())
    with pytest.raises(VmmdError) as raised:
        vmm.unary("Create")
    assert raised.value.status == grpc.StatusCode.CANCELLED.value[0]
    assert seen["Create"] == 1


@pytest.mark.parametrize("status", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_detach_cut_off_goes_again(rig: Any, status: grpc.StatusCode) -> None:
    cuts, seen, channel = rig
    cuts.append(status)
    stores = _Service(channel, "Stores", lambda: [], 5.0, session=_Session())
    stores.unary("Detach", store={"name": "weights"})
    assert seen["Detach"] == 2


@pytest.mark.parametrize("code", ["UNKNOWN_STORE", "STORE_DETACHED"])
def test_a_detach_whose_repeat_is_refused_was_done_by_the_one_cut_off(rig: Any, code: str) -> None:
    cuts, seen, channel = rig
    cuts.extend([grpc.StatusCode.UNAVAILABLE, code])
    stores = _Service(channel, "Stores", lambda: [], 5.0, session=_Session())
    answer = stores.unary("Detach", store={"id": 7, "name": "weights"})
    assert (answer.id, answer.name, _proto.enum_name("StoreState", answer.state)) == (7, "weights", "STORE_STATE_DETACHED")
    assert seen["Detach"] == 2


def test_a_detach_refused_at_its_first_sending_fails_to_its_caller(rig: Any) -> None:
    cuts, seen, channel = rig
    cuts.append("UNKNOWN_STORE")
    stores = _Service(channel, "Stores", lambda: [], 5.0, session=_Session())
    with pytest.raises(VmmdError) as raised:
        stores.unary("Detach", store={"name": "weights"})
    assert raised.value.code == "UNKNOWN_STORE"
    assert seen["Detach"] == 1
