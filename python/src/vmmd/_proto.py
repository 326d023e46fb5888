"""The contract of proto/vmmd/v1, loaded from the descriptor set that
gen_proto.py generates: message classes by name and one callable per RPC."""
from __future__ import annotations

import importlib.resources
from typing import Any, Dict

from google.protobuf import descriptor_pb2, descriptor_pool

try:  # protobuf >= 4.22
    from google.protobuf.message_factory import GetMessageClass as _message_class
except ImportError:  # pragma: no cover - older protobuf
    from google.protobuf import message_factory as _mf

    _factory = _mf.MessageFactory()

    def _message_class(descriptor: Any) -> Any:
        return _factory.GetPrototype(descriptor)


PACKAGE = "vmmd.v1"
# A pool of our own: the package's names cannot clash with anything else loaded.
_pool = descriptor_pool.DescriptorPool()
_set = descriptor_pb2.FileDescriptorSet.FromString(
    importlib.resources.files(__package__).joinpath("vmmd.binpb").read_bytes()
)
for _file in _set.file:  # protoc writes dependencies first
    _pool.AddSerializedFile(_file.SerializeToString())

_classes: Dict[str, Any] = {}


def message(name: str) -> Any:
    """The message class vmmd.v1.`name` (e.g. "CreateRequest")."""
    cls = _classes.get(name)
    if cls is None:
        cls = _classes[name] = _message_class(_pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
    return cls


def enum_value(enum: str, name: str) -> int:
    return _pool.FindEnumTypeByName(f"{PACKAGE}.{enum}").values_by_name[name].number


def enum_name(enum: str, number: int) -> str:
    """The name of vmmd.v1.`enum`'s value `number`; the number as text for one this package does not know."""
    value = _pool.FindEnumTypeByName(f"{PACKAGE}.{enum}").values_by_number.get(number)
    return str(number) if value is None else value.name


def methods(service: str) -> Dict[str, Any]:
    """The methods of vmmd.v1.`service` by name (their descriptors)."""
    return {m.name: m for m in _pool.FindServiceByName(f"{PACKAGE}.{service}").methods}


def stub(channel: Any, service: str) -> Dict[str, Any]:
    """One grpc multi-callable per RPC of `service` on `channel`."""
    calls: Dict[str, Any] = {}
    for name, method in methods(service).items():
        path = f"/{PACKAGE}.{service}/{name}"
        request = message(method.input_type.name)
        response = message(method.output_type.name)
        kind = (method.client_streaming, method.server_streaming)
        factory = {
            (False, False): channel.unary_unary,
            (False, True): channel.unary_stream,
            (True, False): channel.stream_unary,
            (True, True): channel.stream_stream,
        }[kind]
        calls[name] = factory(path, request_serializer=request.SerializeToString, response_deserializer=response.FromString)
    return calls
