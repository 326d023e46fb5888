"""The client-side pool's stream order and giving memory back, on device
chunks mapped through the stand-in driver (fake_cuda_driver.py): a block
freed on a stream goes to another stream only once the work queued before the
free is done; trim() and an idle pool return what is free to the daemon; a
mapping opens to every device that can reach its device as a peer."""
from __future__ import annotations

import os
import types
from typing import Iterator

import pytest

import vmmd
from vmmd import _cuda
from vmmd.pool import DevicePool

from conftest import MiB, Daemon, eventually
from test_cuda_path import cuda_client, driver  # noqa: F401 - fixtures

STREAM_A, STREAM_B = 0x5A, 0x5B


@pytest.fixture
def pool(cuda_client: vmmd.VmmdClient) -> Iterator[DevicePool]:
    pool = DevicePool(cuda_client, chunk_size=4 * MiB, large_threshold=4 * MiB, idle_seconds=0)
    yield pool
    pool.close()


def session_bytes(daemon: Daemon, client: vmmd.VmmdClient) -> int:
    return sum(int(s.allocated_bytes) for s in client.admin.list_sessions().sessions if int(s.id) == int(client.session.id))


def test_a_block_freed_on_a_busy_stream_goes_to_another_stream_only_after_its_work(pool: DevicePool, driver: types.ModuleType) -> None:
    first = pool.allocate(2 * MiB, stream=STREAM_A)
    driver.busy.add(STREAM_A)  # a kernel on A still writes the block
    pool.free(first)
    other = pool.allocate(2 * MiB, stream=STREAM_B)
    assert other.address != first.address, "B got memory that A's work still writes"
    # The chunk is full but for A's block, whose event (recorded on A after the free) is not done: B gets a new chunk.
    third = pool.allocate(2 * MiB, stream=STREAM_B)
    assert third.address != first.address and pool.stats()["chunks"] == 2
    recorded = [event for event in driver.events.values() if event["stream"] == STREAM_A]
    assert len(recorded) == 1 and not recorded[0]["done"] and "cuEventSynchronize" not in driver.calls
    driver.finish(STREAM_A)
    pool.allocate(2 * MiB, stream=STREAM_B)  # the new chunk's rest
    assert pool.allocate(2 * MiB, stream=STREAM_B).address == first.address  # A's work is done: B reuses the block
    assert recorded[0]["destroyed"]


def test_out_of_memory_waits_for_the_streams_and_gives_their_blocks_back(daemon: Daemon, cuda_client: vmmd.VmmdClient, driver: types.ModuleType) -> None:
    pool = DevicePool(cuda_client, chunk_size=128 * MiB, large_threshold=128 * MiB, idle_seconds=0)
    first = pool.allocate(128 * MiB, stream=STREAM_A)
    second = pool.allocate(128 * MiB, stream=STREAM_A)
    driver.busy.add(STREAM_A)
    pool.free(first)
    # 256 MiB of the daemon's 256 MiB are leased: B waits for A's work (and A's block goes back) rather than fail.
    again = pool.allocate(128 * MiB, stream=STREAM_B)
    assert pool.counters["out_of_memory_retries"] == 1 and not driver.busy and pool.stats()["stream_held_bytes"] == 0
    pool.free(again)
    pool.free(second)
    pool.close()


def test_the_same_stream_reuses_a_freed_block_at_once(pool: DevicePool, driver: types.ModuleType) -> None:
    first = pool.allocate(4096, stream=STREAM_A)
    driver.busy.add(STREAM_A)
    pool.free(first)
    again = pool.allocate(4096, stream=STREAM_A)
    assert again.address == first.address and pool.counters["same_stream_reused"] == 1
    assert "cuEventRecord" not in driver.calls  # work on A runs after A's earlier work: nothing to wait for
    pool.free(again)
    stats = pool.stats()  # a held block is not in use
    assert (stats["blocks"], stats["used"], stats["stream_held_bytes"]) == (0, 0, 4096)


def test_a_stream_whose_work_is_done_gives_its_block_to_another_without_waiting(pool: DevicePool, driver: types.ModuleType) -> None:
    first = pool.allocate(4 * MiB, stream=STREAM_A)
    pool.free(first)  # A is idle: the event recorded on it is done at once
    again = pool.allocate(4 * MiB, stream=STREAM_B)
    assert again.address == first.address
    assert "cuEventQuery" in driver.calls and "cuEventSynchronize" not in driver.calls


def test_a_free_on_an_unknown_stream_waits_for_the_legacy_stream(pool: DevicePool, driver: types.ModuleType) -> None:
    first = pool.allocate(4096)
    driver.busy.add(_cuda.LEGACY_STREAM)
    pool.free(first)
    assert pool.allocate(4096).address != first.address  # no stream to reuse it on at once
    driver.finish(_cuda.LEGACY_STREAM)
    pool.allocate(4 * MiB - 8192)  # fills the chunk: the held block comes back now that the legacy stream is done
    assert pool.allocate(4096).address == first.address


def test_a_double_free_held_for_its_stream_is_refused(pool: DevicePool, driver: types.ModuleType) -> None:
    block = pool.allocate(4096, stream=STREAM_A)
    pool.free(block)
    with pytest.raises(vmmd.VmmdError) as raised:
        pool.free(block)
        pool.allocate(4096, stream=STREAM_B)
    assert raised.value.code == "DOUBLE_FREE"


def test_trim_waits_for_the_streams_and_gives_every_free_byte_back(daemon: Daemon, pool: DevicePool, cuda_client: vmmd.VmmdClient, driver: types.ModuleType) -> None:
    blocks = [pool.allocate(1 * MiB, stream=stream) for stream in (STREAM_A, STREAM_B, STREAM_A)] + [pool.allocate(6 * MiB, stream=STREAM_B)]
    driver.busy.update({STREAM_A, STREAM_B})
    for block in blocks:
        pool.free(block)
    assert session_bytes(daemon, cuda_client) == 10 * MiB
    assert pool.trim() == 10 * MiB
    assert session_bytes(daemon, cuda_client) == 0 and not driver.busy
    assert pool.stats()["stream_held_bytes"] == 0


def test_an_idle_pool_gives_its_free_chunks_back(daemon: Daemon, cuda_client: vmmd.VmmdClient, driver: types.ModuleType) -> None:
    pool = DevicePool(cuda_client, chunk_size=4 * MiB, large_threshold=2 * MiB, idle_seconds=0.2)
    kept = [pool.allocate(2 * MiB, stream=STREAM_A), pool.allocate(2 * MiB, stream=STREAM_A)]  # one full chunk
    second = pool.allocate(4096, stream=STREAM_A)  # a second chunk
    large = pool.allocate(3 * MiB, stream=STREAM_B)  # an allocation of its own (4 MiB)
    pool.free(second)
    pool.free(large)
    assert session_bytes(daemon, cuda_client) == 12 * MiB
    eventually(lambda: session_bytes(daemon, cuda_client) == 4 * MiB, timeout=5, what="the empty chunk and the large allocation to go back")
    assert pool.counters["idle_trims"] >= 1 and pool.stats()["chunks"] == 1
    for block in kept:
        pool.free(block)
    eventually(lambda: session_bytes(daemon, cuda_client) == 0, timeout=5, what="the emptied chunk to go back")
    pool.close()


def test_the_idle_time_comes_from_the_environment_and_bad_values_are_refused(cuda_client: vmmd.VmmdClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMMD_POOL_IDLE_SECONDS", "2.5")
    assert DevicePool(cuda_client).idle_seconds == 2.5
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv("VMMD_POOL_IDLE_SECONDS", bad)
        with pytest.raises(vmmd.VmmdError) as raised:
            DevicePool(cuda_client)
        assert (raised.value.code, raised.value.status_name) == ("BAD_IDLE_SECONDS", "INVALID_ARGUMENT") and bad in raised.value.message


def test_a_mapping_opens_to_no_peer_while_this_process_maps_on_one_device(cuda_client: vmmd.VmmdClient, driver: types.ModuleType) -> None:
    driver.topology.update(devices=2, peers={(1, 0), (0, 1)})
    with cuda_client.vmm.allocate(2 * MiB):
        pass
    rw = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert driver.access == [[(driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, 0, rw)]]


def memfd(size: int) -> int:
    fd = os.memfd_create("peer-test")
    os.ftruncate(fd, size)
    return fd


def test_a_first_mapping_on_a_peer_device_opens_the_mappings_before_it_to_that_device(driver: types.ModuleType) -> None:
    driver.topology.update(devices=3, peers={(1, 0), (0, 1)})  # device 2 reaches no one, and no one reaches it
    device, host = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    rw, ro = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE, driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
    first = _cuda.import_and_map(memfd(2 * MiB), 2 * MiB, 2 * MiB, 0, read_only=False)
    gone = _cuda.import_and_map(memfd(2 * MiB), 2 * MiB, 2 * MiB, 0, read_only=True, host_numa=0)
    _cuda.unmap(gone, 2 * MiB, 0)
    seen = len(driver.access)
    lone = _cuda.import_and_map(memfd(2 * MiB), 2 * MiB, 2 * MiB, 2, read_only=False)  # device 2: nothing to open
    second = _cuda.import_and_map(memfd(4 * MiB), 4 * MiB, 2 * MiB, 1, read_only=True)
    # The mapping on device 0 opens to device 1 (once, with its own access); the one unmapped and device 2's do not.
    assert driver.access[seen:] == [[(device, 2, rw)], [(device, 1, rw)], [(device, 1, ro), (device, 0, ro)]]
    third = _cuda.import_and_map(memfd(2 * MiB), 2 * MiB, 2 * MiB, 0, read_only=False, host_numa=0)
    assert driver.access[-1] == [(device, 0, rw), (device, 1, rw), (host, 0, rw)]
    for address, size, owner in ((first, 2 * MiB, 0), (second, 4 * MiB, 1), (third, 2 * MiB, 0)):
        _cuda.unmap(address, size, owner)
    assert _cuda._mapped == {lone: (2 * MiB, 2, False)}
    _cuda.unmap(lone, 2 * MiB, 2)


class UserStream:
    """A stream as CuPy's Stream object holds one: made by cuStreamCreate, destroyed when its last reference goes."""

    def __init__(self, driver: types.ModuleType) -> None:
        self._driver = driver
        _, self.ptr = driver.cuStreamCreate(0)

    def __del__(self) -> None:
        self._driver.cuStreamDestroy(self.ptr)


def test_a_stream_dropped_while_its_freed_block_waits_lives_until_the_block_is_safe(pool: DevicePool, driver: types.ModuleType) -> None:
    stream = UserStream(driver)
    handle = stream.ptr
    block = pool.allocate(4 * MiB, stream=stream)
    driver.busy.add(handle)  # a kernel on the stream still writes the block
    # The program drops its stream, then the array (CuPy frees it from a finalizer).
    del stream
    pool.free(block)
    del block
    # Another stream needs memory: an event goes on the freeing stream, which must still be that stream.
    other = pool.allocate(4 * MiB, stream=STREAM_B)
    answer = {"misuse": list(driver.misuse), "alive": handle in driver.live["streams"], "other": other.address}
    assert answer["misuse"] == [] and answer["alive"], answer
    driver.finish(handle)
    pool.allocate(4 * MiB, stream=STREAM_B)  # the block is safe now: given to B, and the stream let go
    assert handle not in driver.live["streams"] and driver.misuse == []


def test_a_stream_that_names_no_handle_is_refused_and_changes_nothing(pool: DevicePool) -> None:
    with pytest.raises(vmmd.VmmdError) as raised:
        pool.allocate(4096, stream="stream A")
    assert (raised.value.code, raised.value.status_name) == ("BAD_STREAM", "INVALID_ARGUMENT") and "'stream A'" in raised.value.message
    assert pool.stats()["blocks"] == 0 and pool.stats()["chunks"] == 0
