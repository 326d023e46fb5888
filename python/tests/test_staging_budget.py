"""A client whose staging buffer the daemon refuses (its uid's staging bytes
budget is spent) still reads and writes correctly: it streams over gRPC, and
asks for staging no more."""
from __future__ import annotations

from typing import Iterator

import pytest

import vmmd

from conftest import MiB, Daemon

RW = [{"location": {"type": "LOCATION_TYPE_DEVICE", "id": 0}, "flags": "ACCESS_FLAGS_READWRITE"}]
BUDGET = 4 * MiB


@pytest.fixture(scope="module")
def small_budget() -> Iterator[Daemon]:
    daemon = Daemon(["--max-staging-bytes-per-uid", str(BUDGET)])
    try:
        yield daemon
    finally:
        daemon.stop()


def test_a_client_refused_staging_streams_its_reads_and_writes(small_budget: Daemon) -> None:
    # The client's buffer (8 MiB) is past the budget: OpenStaging is refused BUDGET_EXCEEDED.
    client = small_budget.connect(staging_bytes=2 * BUDGET)
    try:
        size = 4 * MiB
        reservation = client.vmm.reserve(size=size)
        allocation = client.vmm.create(size=size)
        client.vmm.map(address=reservation.address, size=size, allocation_id=allocation.id)
        client.vmm.set_access(address=reservation.address, size=size, descriptors=RW)
        big = bytes(range(256)) * (3 * MiB // 256)
        assert client.vmm.write(reservation.address, big) == len(big)
        assert client.vmm.read(reservation.address, len(big)) == big
        into = bytearray(len(big))
        client.vmm.read_into(reservation.address, into)
        assert into == big
        # Refused once, the client asks no more.
        assert client.vmm._staging is not None and client.vmm._staging.refused
        with pytest.raises(vmmd.VmmdError) as refused:
            client.vmm.read_staged(address=reservation.address, length=4096, staging_offset=0)
        assert refused.value.code == "NO_STAGING"
        client.vmm.unmap(address=reservation.address, size=size)
        client.vmm.free_address(address=reservation.address, size=size)
        client.vmm.release(allocation_id=allocation.id)
    finally:
        client.close()


def test_a_buffer_within_the_budget_is_still_staged(small_budget: Daemon) -> None:
    client = small_budget.connect(staging_bytes=BUDGET)
    try:
        size = 4 * MiB
        reservation = client.vmm.reserve(size=size)
        allocation = client.vmm.create(size=size)
        client.vmm.map(address=reservation.address, size=size, allocation_id=allocation.id)
        client.vmm.set_access(address=reservation.address, size=size, descriptors=RW)
        big = bytes(range(256)) * (3 * MiB // 256)
        assert client.vmm.write(reservation.address, big) == len(big)
        assert client.vmm.read(reservation.address, len(big)) == big
        assert client.vmm._staging is not None and not client.vmm._staging.refused
        assert client.vmm.read_staged(address=reservation.address, length=4096, staging_offset=0).bytes == 4096
        client.vmm.unmap(address=reservation.address, size=size)
        client.vmm.free_address(address=reservation.address, size=size)
        client.vmm.release(allocation_id=allocation.id)
    finally:
        client.close()
