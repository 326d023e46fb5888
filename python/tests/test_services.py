"""Every RPC of every service through the Python client, with the token."""
from __future__ import annotations

import re

import pytest

import vmmd
from vmmd import _proto

from conftest import MiB, Daemon

RW = [{"location": {"type": "LOCATION_TYPE_DEVICE", "id": 0}, "flags": "ACCESS_FLAGS_READWRITE"}]


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


# RPC → the client method that makes it, where the name differs from snake_case.
RENAMED = {
    ("VirtualMemory", "Import"): "import_transfer",
    ("VirtualMemory", "Allocate"): "allocate_raw",
    ("Stores", "Attach"): "attach_descriptor",
}


@pytest.mark.parametrize("service,api", [("Devices", "devices"), ("Admin", "admin"), ("VirtualMemory", "vmm"), ("Stores", "stores")])
def test_every_rpc_of_the_contract_has_a_client_method(client: vmmd.VmmdClient, service: str, api: str) -> None:
    for rpc in _proto.methods(service):
        name = RENAMED.get((service, rpc), snake(rpc))
        assert callable(getattr(getattr(client, api), name, None)), f"{service}.{rpc} has no client method {api}.{name}"


def test_devices(client: vmmd.VmmdClient) -> None:
    devices = client.devices.list_devices()
    assert devices.backend == "host" and len(devices.devices) >= 1
    info = client.devices.get_memory_info(device=0)
    assert info.total_bytes == 256 * MiB and info.free_bytes <= info.total_bytes
    granularity = client.devices.get_granularity(location={"type": "LOCATION_TYPE_DEVICE", "id": 0})
    assert granularity.minimum == 2 * MiB and granularity.recommended >= granularity.minimum


def test_admin(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    allocation = client.vmm.create(size=2 * MiB)
    stats = client.admin.get_stats()
    assert stats.backend == "host" and stats.sessions >= 1 and stats.allocated_bytes >= 2 * MiB
    report = client.admin.get_report()
    assert isinstance(report, dict)
    assert any(s.id == int(client.session.id) for s in client.admin.list_sessions().sessions)
    objects = client.admin.list_objects(owner_session=int(client.session.id)).objects
    assert [(o.kind, o.id) for o in objects] == [("allocation", allocation.id)]
    assert client.admin.clear_caches().transfers_closed >= 0
    assert client.admin.get_version().backend == "host"


def test_virtual_memory_sequence(client: vmmd.VmmdClient) -> None:
    size = 4 * MiB
    reservation = client.vmm.reserve(size=size)
    assert reservation.size == size and reservation.address % (2 * MiB) == 0
    allocation = client.vmm.create(size=size)
    client.vmm.map(address=reservation.address, size=size, allocation_id=allocation.id)
    client.vmm.set_access(address=reservation.address, size=size, descriptors=RW)
    assert client.vmm.get_access(address=reservation.address, location={"type": "LOCATION_TYPE_DEVICE"}).flags == _proto.enum_value("AccessFlags", "ACCESS_FLAGS_READWRITE")
    # Streamed (small) and staged (large) data paths, both ways.
    assert client.vmm.write(reservation.address, b"small") == 5
    assert client.vmm.read(reservation.address, 5) == b"small"
    big = bytes(range(256)) * (3 * MiB // 256)
    assert client.vmm.write(reservation.address + 4096, big) == len(big)
    assert client.vmm.read(reservation.address + 4096, len(big)) == big
    into = bytearray(len(big))
    client.vmm.read_into(reservation.address + 4096, into)
    assert into == big
    small = bytearray(5)
    client.vmm.read_into(reservation.address, small)
    assert small == b"small"
    # The raw staged calls (the buffer is open now).
    client.vmm.write_staged(address=reservation.address, length=4096, staging_offset=0)
    assert client.vmm.read_staged(address=reservation.address, length=4096, staging_offset=0).bytes == 4096
    retained = client.vmm.retain_handle(address=reservation.address)
    assert retained.id == allocation.id
    assert client.vmm.get_properties(allocation_id=allocation.id).mapping_count == 1
    assert client.vmm.unmap(address=reservation.address, size=size) is not None
    client.vmm.free_address(address=reservation.address, size=size)
    released = client.vmm.release(allocation_id=allocation.id)
    assert released.handle_references >= 1  # the retained reference keeps it
    assert client.vmm.release(allocation_id=allocation.id).freed


def test_export_share_import_and_allocate(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    allocation = client.vmm.create(size=2 * MiB)
    key = client.vmm.share(allocation_id=allocation.id).share_key
    with daemon.connect() as other:
        with other.vmm.import_(allocation.id, share_key=key) as memory:
            memory.write(0, b"shared")
        raw = other.vmm.allocate_raw(size=2 * MiB)
        fd = other.session.take_transfer(raw.transfer_id)
        try:
            imported = other.vmm.import_transfer(transfer_id=int(other.session.send_descriptor(fd)), size=2 * MiB)
        finally:
            import os

            os.close(fd)
        assert imported.imported
    with client.vmm.import_(allocation.id) as mine:
        assert mine.read(0, 6) == b"shared"
    opened = client.vmm.open_staging  # covered by the staged path above
    assert callable(opened)


def test_stores(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    memory = client.vmm.allocate(2 * MiB)
    memory.write(0, b"weights!")
    store = client.stores.create_store(allocation_id=memory.allocation_id, name="py-store", read_only=True, size=4096)
    assert store.name == "py-store" and store.read_only and store.size == 4096
    assert any(s.id == store.id for s in client.stores.list())
    events = client.stores.watch(since=0, timeout=5)
    assert any(event.store.id == store.id for event in _take(events, 1))
    span = {"store_id": store.id, "offset": 0}
    assert client.stores.read(span, 8) == b"weights!"
    with client.stores.open("py-store") as opened:
        assert opened.memory.read_only and opened.memory.read(0, 8) == b"weights!"
        assert opened.store.opens >= 1
    writable = client.stores.attach_bytes(b"\0" * 8192, name="py-attached")
    target = {"store_id": writable.id, "offset": 0}
    assert client.stores.write(target, b"abc") == 3
    client.stores.fill({"store_id": writable.id, "offset": 3}, 2, ord("z"))
    client.stores.copy(span, {"store_id": writable.id, "offset": 5}, 3)
    assert client.stores.read(target, 8) == b"abczzwei"
    with client.stores.open(writable.id, writable=True) as opened:
        opened.memory.write(0, b"X")
    assert client.stores.read(target, 1) == b"X"
    fd = vmmd.sealed_memfd("attach", 8192)
    try:
        attached = client.stores.attach_descriptor(fd, size=100, name="py-fd")
    finally:
        import os

        os.close(fd)
    assert attached.attached and attached.size == 100
    for name in ("py-store", "py-attached", "py-fd"):
        assert client.stores.detach(name).state != _proto.enum_value("StoreState", "STORE_STATE_LIVE")
    assert client.stores.close  # used by OpenedStore.close above


def _take(events, count):  # type: ignore[no-untyped-def]
    seen = []
    for event in events:
        seen.append(event)
        if len(seen) >= count:
            break
    events.close()
    return seen
