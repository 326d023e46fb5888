"""Sleep and wake on the CUDA path against the stand-in driver
(fake_cuda_driver.py): unmapped with the range kept reserved, offloaded by
the copy engines into host memory mapped for the device, mapped again at the
same address with its access, every handle and stream released."""
from __future__ import annotations

import types

import pytest

import fake_cuda_driver
import vmmd
from vmmd.pool import DevicePool

from conftest import MiB, Daemon
from test_cuda_path import cuda_client, driver  # noqa: F401 - fixtures


def test_device_memory_sleeps_with_its_range_reserved_and_wakes_at_it(daemon: Daemon, cuda_client: vmmd.VmmdClient, driver: types.ModuleType) -> None:  # noqa: F811
    pool = DevicePool(cuda_client, chunk_size=4 * MiB, idle_seconds=0)
    block = pool.allocate(MiB)
    chunk = block.chunk
    chunk.memory.write(block.offset, b"weights" * 1000)
    driver.calls.clear()
    pool.sleep("offload")
    # Synchronized first, copied by the copy engines into host memory mapped for the device, then unmapped with the range kept.
    assert driver.calls.index("cuCtxSynchronize") < driver.calls.index("cuMemcpyAsync") < driver.calls.index("cuMemUnmap")
    assert (chunk.base, chunk.size) in driver.live["reservations"] and (chunk.base, chunk.size) not in driver.live["mappings"]
    assert [d for d in driver.access[-1] if d[0] == 3], "the host copy is not mapped for the host"
    assert not driver.live["streams"] and not driver.poisoned
    driver.calls.clear()
    pool.wake()
    assert "cuMemAddressReserve" not in driver.calls and driver.calls.count("cuMemMap") == 1
    assert (chunk.base, chunk.size) in driver.live["mappings"] and chunk.memory.address == chunk.base
    assert chunk.memory.read(block.offset, 7000) == b"weights" * 1000
    assert not driver.live["streams"] and not driver.poisoned
    driver.calls.clear()
    pool.sleep("discard")
    pool.wake()
    assert "cuMemcpyAsync" not in driver.calls and driver.calls.count("cuMemUnmap") == 1 and driver.calls.count("cuMemMap") == 1
    pool.close()
    assert not driver.live["mappings"] and not driver.live["reservations"]


def test_a_wake_whose_mapping_fails_leaves_everything_asleep(daemon: Daemon, cuda_client: vmmd.VmmdClient, driver: types.ModuleType) -> None:  # noqa: F811
    pool = DevicePool(cuda_client, chunk_size=4 * MiB, large_threshold=2 * MiB, idle_seconds=0)
    small, large = pool.allocate(MiB), pool.allocate(3 * MiB)
    large.chunk.memory.write(large.offset, b"kept")
    pool.sleep("offload")
    asleep = daemon.stats().allocations
    original, maps = driver.cuMemMap, []

    def second_map_fails(*args: object) -> object:
        maps.append(args)
        if len(maps) == 2:
            return (fake_cuda_driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
        return original(*args)

    driver.cuMemMap = second_map_fails
    with pytest.raises(vmmd.VmmdError) as raised:
        pool.wake()
    assert raised.value.code == "CUDA_ERROR_OUT_OF_MEMORY" and "cuMemMap" in raised.value.message
    # The first range mapped is unmapped again, the new allocations are given back, the copies stay.
    assert pool.asleep and small.chunk.memory.asleep and large.chunk.memory.asleep
    assert all((chunk.base, chunk.size) not in driver.live["mappings"] for chunk in (small.chunk, large.chunk))
    assert daemon.stats().allocations == asleep and not driver.live["handles"]
    driver.cuMemMap = original
    pool.wake()
    assert large.chunk.memory.read(large.offset, 4) == b"kept"
    pool.close()


def test_a_wake_whose_copy_back_fails_leaves_everything_asleep(daemon: Daemon, cuda_client: vmmd.VmmdClient, driver: types.ModuleType) -> None:  # noqa: F811
    pool = DevicePool(cuda_client, chunk_size=4 * MiB, idle_seconds=0)
    block = pool.allocate(MiB)
    block.chunk.memory.write(block.offset, b"kept")
    pool.sleep("offload")
    asleep = daemon.stats().allocations
    driver.fail["cuMemcpyAsync"] = fake_cuda_driver.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(vmmd.VmmdError) as raised:
        pool.wake()
    assert "cuMemcpyAsync" in raised.value.message
    assert pool.asleep and block.chunk.memory.asleep and (block.chunk.base, block.chunk.size) not in driver.live["mappings"]
    assert daemon.stats().allocations == asleep and not driver.live["streams"]
    pool.wake()
    assert block.chunk.memory.read(block.offset, 4) == b"kept"
    pool.close()
