"""The Python client on the cuda backend: device memory mapped here, shared
between processes, and used by Numba, CuPy and PyTorch with zero copies."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest

import vmmd
import vmmd.weights

from conftest import MiB, run_python


def test_device_memory_is_mapped_here_and_exposes_the_cuda_array_interface(client: vmmd.VmmdClient) -> None:
    memory = client.vmm.allocate(4 * MiB)
    assert isinstance(memory, vmmd.CudaImportedMemory) and memory.is_device_memory
    memory.write(4 * MiB - 5, b"hello")
    assert memory.read(4 * MiB - 5, 5) == b"hello"
    interface = memory.__cuda_array_interface__
    assert interface["data"] == (memory.address, False) and interface["shape"] == (4 * MiB,) and interface["typestr"] == "|u1"
    cupy = pytest.importorskip("cupy")
    array = cupy.asarray(memory.view("<f4", (1024,)))
    array[:] = cupy.arange(1024, dtype=cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()
    assert memory.read(40, 4) == struct.pack("<f", 10.0)
    # The daemon reads the same memory through its own mapping.
    reservation = client.vmm.reserve(size=4 * MiB)
    client.vmm.map(address=reservation.address, size=4 * MiB, allocation_id=memory.allocation_id)
    client.vmm.set_access(address=reservation.address, size=4 * MiB, descriptors=[{"location": {"type": "LOCATION_TYPE_DEVICE", "id": 0}, "flags": "ACCESS_FLAGS_READWRITE"}])
    assert client.vmm.read(reservation.address + 4 * MiB - 5, 5) == b"hello"
    del array
    memory.close()


def test_an_allocation_is_shared_with_another_process(client: vmmd.VmmdClient) -> None:
    memory = client.vmm.allocate(2 * MiB)
    memory.write(0, bytes(range(256)) * 16)
    key = client.vmm.share(allocation_id=memory.allocation_id).share_key
    answer = run_python(f"""
        import json, vmmd, cupy
        with vmmd.connect() as client:
            memory = client.vmm.import_({memory.allocation_id}, share_key={key!r})
            array = cupy.asarray(memory.view("|u1", (4096,)))
            total = int(array.sum())
            array[:4] = 7
            cupy.cuda.runtime.deviceSynchronize()
            del array
            memory.close()
        print(json.dumps({{"sum": total}}))
    """)
    assert answer["sum"] == sum(range(256)) * 16
    assert memory.read(0, 4) == b"\x07" * 4


def test_a_read_only_store_is_opened_as_tensors_by_two_processes(client: vmmd.VmmdClient, tmp_path: object) -> None:
    import numpy

    path = os.path.join(str(tmp_path), "w.bin")
    numpy.arange(1 << 20, dtype="<f4").tofile(path)
    store = vmmd.weights.load_file(path, "gpu-test-weights", client=client)
    assert store.owner_session == 0 and store.read_only
    code = """
        import json, torch, vmmd, vmmd.weights
        s = vmmd.weights.open_store("gpu-test-weights")
        t = vmmd.weights.as_torch(s, "float32")
        print(json.dumps({"sum": float(t.double().sum()), "device": str(t.device), "ptr": t.data_ptr() == s.memory.address}))
    """
    first, second = run_python(code), run_python(code)
    expected = float(sum(range(1 << 20)))
    assert first["sum"] == second["sum"] == expected and first["ptr"] and first["device"].startswith("cuda")
    client.stores.detach("gpu-test-weights")


NUMBA = {"NUMBA_CUDA_MEMORY_MANAGER": "vmmd.numba"}


def test_numba_allocates_through_vmmd_and_its_ipc_opens_in_another_process() -> None:
    pytest.importorskip("numba.cuda")
    answer = run_python("""
        import concurrent.futures, json, multiprocessing as mp
        import numpy as np
        from numba import cuda

        def child(handle):
            with handle as array:
                return array.copy_to_host().tolist()

        def child_raw(raw, size):
            with cuda.open_ipc_array(raw, shape=size // 8, dtype=np.int64) as array:
                return array.copy_to_host().tolist()

        @cuda.jit
        def double(x):
            i = cuda.grid(1)
            if i < x.size:
                x[i] *= 2

        if __name__ == "__main__":
            import vmmd
            ctx = cuda.current_context()
            manager = ctx.memory_manager
            a = cuda.to_device(np.arange(1000, dtype=np.int64))
            double[4, 256](a)
            host = a.copy_to_host()
            info = ctx.get_memory_info()
            with vmmd.connect() as c:
                daemon = c.devices.get_memory_info(device=0)
            handle = a.get_ipc_handle()
            raw = ctx.get_ipc_handle(a.gpu_data)
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
                opened = pool.submit(child, handle).result(120)
                opened_raw = pool.submit(child_raw, raw.handle.reserved, raw.size).result(120)
            expected = (np.arange(1000) * 2).tolist()
            print(json.dumps({
                "manager": type(manager).__module__ + "." + type(manager).__name__,
                "doubled": bool((host == np.arange(1000) * 2).all()),
                "stats": manager.stats(),
                "info_total": info.total, "daemon_total": daemon.total_bytes,
                "ipc": opened == expected, "ipc_raw": opened_raw == expected,
            }))
    """, env=NUMBA)
    assert answer["manager"] == "vmmd.numba.VmmdNumbaMemoryManager"
    assert answer["doubled"] and answer["stats"]["chunks"] >= 1 and answer["stats"]["blocks"] >= 1
    assert answer["info_total"] == answer["daemon_total"]
    assert answer["ipc"] and answer["ipc_raw"]


def test_cupy_arrays_live_in_the_vmmd_pool() -> None:
    pytest.importorskip("cupy")
    answer = run_python("""
        import json, cupy, vmmd.cupy
        allocator = vmmd.cupy.use()
        x = cupy.arange(1 << 20, dtype=cupy.int64)
        y = (x * 2).sum()
        during = allocator.stats()
        del x
        import gc; gc.collect()
        after = allocator.stats()
        print(json.dumps({"sum": int(y), "during": during, "after": after}))
    """)
    assert answer["sum"] == sum(range(1 << 20)) * 2
    during = list(answer["during"].values())[0]
    after = list(answer["after"].values())[0]
    assert during["chunks"] >= 1 and during["blocks"] >= 1 and after["blocks"] < during["blocks"]


def test_a_torch_model_in_the_vmmd_mempool_is_opened_by_another_process(tmp_path: object) -> None:
    pytest.importorskip("torch")
    spec_path = os.path.join(str(tmp_path), "spec.json")
    ready = os.path.join(str(tmp_path), "done")
    owner = subprocess.Popen([sys.executable, "-c", f"""
import json, os, time, torch, vmmd.torch
pool = vmmd.torch.mem_pool()
torch.manual_seed(0)
with torch.cuda.use_mem_pool(pool):
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 256)).cuda()
state = model.state_dict()
spec = vmmd.torch.export_tensors(state)
sums = {{name: float(t.double().sum()) for name, t in state.items()}}
json.dump({{"spec": spec, "sums": sums, "stats": vmmd.torch.allocator().stats()}}, open({spec_path!r}, "w"))
while not os.path.exists({ready!r}):
    time.sleep(0.05)
"""], env=os.environ.copy())
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(spec_path) or os.path.getsize(spec_path) == 0:
            assert owner.poll() is None, f"the owner exited with {owner.returncode}"
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.2)
        shared = json.load(open(spec_path))
        assert shared["stats"]["chunks"] >= 1
        answer = run_python(f"""
            import json, vmmd.torch
            spec = json.load(open({spec_path!r}))["spec"]
            tensors = vmmd.torch.import_tensors(spec)
            print(json.dumps({{name: float(t.double().sum()) for name, t in tensors.items()}}))
        """)
        assert answer == shared["sums"]
    finally:
        open(ready, "w").close()
        owner.wait(60)


def test_a_sigkilled_client_gives_its_device_memory_back(client: vmmd.VmmdClient) -> None:
    before = client.admin.get_stats().allocated_bytes
    child = subprocess.Popen([sys.executable, "-c", """
import sys, time, vmmd
c = vmmd.connect()
m = [c.vmm.allocate(64 << 20) for _ in range(4)]
print("ready", flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
    assert client.admin.get_stats().allocated_bytes >= before + (256 << 20)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 20
    while client.admin.get_stats().allocated_bytes != before:
        assert time.monotonic() < deadline, "the daemon did not reclaim the killed client's memory"
        time.sleep(0.05)


def test_dlpack_gives_torch_and_cupy_the_device_memory(client: vmmd.VmmdClient) -> None:
    torch = pytest.importorskip("torch")
    memory = client.vmm.allocate(2 * MiB)
    memory.write(0, struct.pack("<4f", 1.0, 2.0, 3.0, 4.0))
    tensor = torch.from_dlpack(memory.view("<f4", (4,)))
    assert tensor.device.type == "cuda" and tensor.data_ptr() == memory.address
    assert tensor.tolist() == [1.0, 2.0, 3.0, 4.0]
    tensor.mul_(2)
    torch.cuda.synchronize()
    assert memory.read(0, 16) == struct.pack("<4f", 2.0, 4.0, 6.0, 8.0)
    del tensor
    memory.close()
