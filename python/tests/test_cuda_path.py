"""vmmd's CUDA path (vmmd._cuda, CudaImportedMemory, the pool's device
chunks, the weights loader) against a stand-in driver on host memory
(fake_cuda_driver.py): the sequence, its rollback, and that nothing leaks."""
from __future__ import annotations

import os
import sys
import types
from typing import Iterator

import pytest

import vmmd
import vmmd.weights
from vmmd import _cuda
from vmmd.pool import DevicePool

import fake_cuda_driver
from conftest import MiB, Daemon


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    fake = fake_cuda_driver.build()
    package = types.ModuleType("cuda.bindings")
    package.driver = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", package)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake)
    monkeypatch.setattr(_cuda, "_driver", None)
    monkeypatch.setattr(_cuda, "_uuids", None)
    monkeypatch.setattr(_cuda, "_peer_cache", {})
    monkeypatch.setattr(_cuda, "_used", set())
    monkeypatch.setattr(_cuda, "_mapped", {})
    yield fake
    assert not fake.live["handles"], "an imported handle was not released"


@pytest.fixture
def cuda_client(daemon: Daemon, driver: types.ModuleType) -> Iterator[vmmd.VmmdClient]:
    """A client that maps as on the cuda backend (the daemon is the host one)."""
    with daemon.connect() as client:
        client.vmm.backend = "cuda"
        client.stores.backend = "cuda"
        yield client


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_allocate_imports_maps_sets_access_and_releases_the_handle(cuda_client: vmmd.VmmdClient, driver: types.ModuleType) -> None:
    before = fds()
    memory = cuda_client.vmm.allocate(2 * MiB)
    assert isinstance(memory, vmmd.CudaImportedMemory) and memory.is_device_memory
    assert driver.calls[-5:] == ["cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess", "cuMemRelease"]
    assert fds() == before  # the descriptor was closed once imported
    memory.write(2 * MiB - 4, b"last")
    assert memory.read(2 * MiB - 4, 4) == b"last" and driver.calls[-1] == "cuMemcpyDtoH"
    interface = memory.view("<i4", (16,), offset=256).__cuda_array_interface__
    assert interface["data"] == (memory.address + 256, False) and interface["shape"] == (16,) and interface["stream"] is None
    memory.close()
    assert driver.calls[-2:] == ["cuMemUnmap", "cuMemAddressFree"] and not driver.live["mappings"] and not driver.live["reservations"]


def test_a_failed_map_rolls_back_and_releases_the_allocation(daemon: Daemon, cuda_client: vmmd.VmmdClient, driver: types.ModuleType) -> None:
    before = (fds(), daemon.stats().allocations)
    driver.fail["cuMemSetAccess"] = fake_cuda_driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(vmmd.VmmdError) as raised:
        cuda_client.vmm.allocate(2 * MiB)
    assert (raised.value.code, raised.value.status_name) == ("CUDA_ERROR_OUT_OF_MEMORY", "RESOURCE_EXHAUSTED")
    assert "cuMemSetAccess" in raised.value.message
    assert not driver.live["mappings"] and not driver.live["reservations"]
    assert (fds(), daemon.stats().allocations) == before


def test_read_only_imports_map_without_write_access(daemon: Daemon, cuda_client: vmmd.VmmdClient, driver: types.ModuleType) -> None:
    source = cuda_client.vmm.allocate(2 * MiB)
    source.write(0, b"constant")
    key = cuda_client.vmm.share(allocation_id=source.allocation_id).share_key
    with daemon.connect() as other:
        other.vmm.backend = "cuda"
        with other.vmm.import_(source.allocation_id, share_key=key, read_only=True) as mapped:
            assert isinstance(mapped, vmmd.CudaImportedMemory) and mapped.read_only
            assert mapped.view().__cuda_array_interface__["data"][1] is True
            assert mapped.read(0, 8) == b"constant"
            with pytest.raises(vmmd.VmmdError) as raised:
                mapped.write(0, b"x")
            assert raised.value.code == "READ_ONLY"
    source.close()


def test_the_pool_synchronizes_before_it_unmaps_device_chunks(cuda_client: vmmd.VmmdClient, driver: types.ModuleType) -> None:
    pool = DevicePool(cuda_client, chunk_size=4 * MiB)
    block = pool.allocate(1000)
    pool.free(block)
    driver.calls.clear()
    assert pool.trim() == 4 * MiB
    assert driver.calls[:3] == ["cuCtxGetCurrent", "cuCtxGetDevice", "cuCtxSynchronize"] and driver.calls[-2:] == ["cuMemUnmap", "cuMemAddressFree"]


def test_weights_load_into_device_memory_and_open_elsewhere(daemon: Daemon, cuda_client: vmmd.VmmdClient, tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "w.bin")
    data = os.urandom(3 * MiB + 5)
    with open(path, "wb") as f:
        f.write(data)
    store = vmmd.weights.load_file(path, "cuda-path-weights", client=cuda_client)
    assert store.size == len(data) and store.owner_session == 0
    with cuda_client.stores.open("cuda-path-weights") as opened:
        assert opened.memory.read(0, len(data)) == data
    cuda_client.stores.detach("cuda-path-weights")


def test_a_write_has_landed_before_close_unmaps(cuda_client: vmmd.VmmdClient, driver: types.ModuleType) -> None:
    """cuMemcpyHtoD from pageable memory returns once the bytes are staged; the
    stand-in driver lands them only at a synchronization and poisons the context when a range
    is unmapped under them, as the real one does. Write then close, with no read between."""
    for round_ in range(3):
        memory = cuda_client.vmm.allocate(2 * MiB)
        memory.write(0, bytes([round_ + 1]) * 4096)
        assert not driver.in_flight, "write() returned with its bytes still in flight"
        memory.close()
        cuda_client.vmm.release(allocation_id=memory.allocation_id)
    assert not driver.poisoned, "an unmap ran under a copy: the context is poisoned"
    again = cuda_client.vmm.allocate(2 * MiB)
    again.write(0, b"still fine")
    assert again.read(0, 10) == b"still fine"
    again.close()


def test_close_synchronizes_before_it_unmaps(cuda_client: vmmd.VmmdClient, driver: types.ModuleType) -> None:
    """Kernels of this process may still use the range (CuPy, Numba, PyTorch launch on
    their own streams): close() synchronizes the context first, as cuMemFree does."""
    memory = cuda_client.vmm.allocate(2 * MiB)
    memory.close()
    assert driver.calls[-3:] == ["cuCtxSynchronize", "cuMemUnmap", "cuMemAddressFree"]


def test_close_waits_for_a_copy_running_in_another_thread(cuda_client: vmmd.VmmdClient, driver: types.ModuleType) -> None:
    import threading

    memory = cuda_client.vmm.allocate(2 * MiB)
    entered, release = threading.Event(), threading.Event()
    original = driver.cuStreamSynchronize

    def slow_synchronize(stream: object) -> object:
        entered.set()
        release.wait(5)
        return original(stream)

    driver.cuStreamSynchronize = slow_synchronize
    writer = threading.Thread(target=memory.write, args=(0, b"x" * 4096))
    writer.start()
    assert entered.wait(5)
    closer = threading.Thread(target=memory.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "close() unmapped while a write was in flight"
    release.set()
    writer.join(5)
    closer.join(5)
    driver.cuStreamSynchronize = original
    assert memory.closed and not driver.poisoned
