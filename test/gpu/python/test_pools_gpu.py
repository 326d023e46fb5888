"""The pools on a GPU as users meet them: CuPy's allocations reused in
stream order (a kernel still writing a freed block on one stream does not
touch an allocation on another), PyTorch's MemPool under its allocator mutex
with a thread reading memory_stats(), memory handed back to the daemon by
free_all_blocks() and empty_cache(), and a copy between two devices' Numba
arrays under vmmd.numba."""
from __future__ import annotations

import pytest

from conftest import run_python

# A kernel that spins about `cycles` clocks, then writes 1 to every element: still writing long after its launch returned.
SPIN_WRITE = r'''
extern "C" __global__ void spin_write(float* x, long long n, long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {}
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) x[i] = 1.0f;
}
'''


def test_a_stream_dropped_while_its_freed_block_waits_stays_alive_until_the_block_is_safe() -> None:
    pytest.importorskip("cupy")
    answer = run_python(f"""
        import json, cupy, vmmd.cupy
        allocator = vmmd.cupy.use(native=False, chunk_size=4 << 20, large_threshold=4 << 20, idle_seconds=0)
        kernel = cupy.RawKernel({SPIN_WRITE!r}, "spin_write")
        n = (4 << 20) // 4
        a = cupy.cuda.Stream(non_blocking=True)
        with a:
            x = cupy.zeros(n, dtype=cupy.float32)
            a.synchronize()
            address = x.data.ptr
            kernel((64,), (256,), (x, cupy.int64(n), cupy.int64(1 << 30)))
        # The program drops its stream first, then the array: the pool's block must keep the stream until it is safe.
        del a
        del x
        b = cupy.cuda.Stream(non_blocking=True)
        with b:
            y = cupy.zeros(n, dtype=cupy.float32)
            same = y.data.ptr == address
            b.synchronize()
        cupy.cuda.runtime.deviceSynchronize()
        held = allocator.stats()[cupy.cuda.runtime.getDevice()]["stream_held_bytes"]
        print(json.dumps({{"same": same, "sum": float(y.sum()), "held": held}}))
    """, timeout=120)
    # The block was the chunk's only room: b waited for an event on a, which was still a (not freed, not reused).
    assert answer["sum"] == 0.0, answer


@pytest.mark.parametrize("layout", ["room", "full"])
def test_a_block_freed_while_a_kernel_writes_it_does_not_reach_another_stream(layout: str) -> None:
    pytest.importorskip("cupy")
    # "room": the chunk has room elsewhere; "full": the block is the chunk's only room, so stream B must wait for A's work.
    settings = "" if layout == "room" else "chunk_size=4 << 20, large_threshold=4 << 20"
    answer = run_python(f"""
        import json, cupy, vmmd.cupy
        vmmd.cupy.use({settings})
        kernel = cupy.RawKernel({SPIN_WRITE!r}, "spin_write")
        n = (4 << 20) // 4
        a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        with a:
            x = cupy.zeros(n, dtype=cupy.float32)
            a.synchronize()
            address = x.data.ptr
            kernel((64,), (256,), (x, cupy.int64(n), cupy.int64(1 << 30)))
            del x
        with b:
            y = cupy.zeros(n, dtype=cupy.float32)
            same = y.data.ptr == address
            b.synchronize()
        a.synchronize()
        print(json.dumps({{"same": same, "sum": float(y.sum())}}))
    """, timeout=120)
    assert answer["sum"] == 0.0, f"stream B's array was overwritten by stream A's kernel: {answer}"
    if layout == "room":
        assert answer["same"] is False


def test_cupy_free_all_blocks_gives_the_memory_back() -> None:
    pytest.importorskip("cupy")
    answer = run_python("""
        import json, cupy, vmmd, vmmd.cupy
        allocator = vmmd.cupy.use(idle_seconds=0)
        client = allocator.client
        def held():
            return sum(int(s.allocated_bytes) for s in client.admin.list_sessions().sessions if int(s.id) == int(client.session.id))
        arrays = [cupy.ones(1 << 20, dtype=cupy.float32) for _ in range(40)] + [cupy.ones(40 << 20, dtype=cupy.uint8)]
        during = held()
        del arrays
        returned = allocator.free_all_blocks()
        print(json.dumps({"during": during, "after": held(), "returned": returned}))
    """, timeout=120)
    assert answer["during"] > 0 and answer["after"] == 0 and answer["returned"] == answer["during"]


def test_the_torch_mempool_survives_a_thread_reading_memory_stats_100_times() -> None:
    pytest.importorskip("torch")
    answer = run_python("""
        import json, random, threading, time, torch, vmmd.torch
        pool = vmmd.torch.mem_pool()
        done = 0
        calls = 0
        kept = []  # grows every round: PyTorch asks new segments (mallocs) while the reader runs
        for round in range(100):
            stop = threading.Event()
            def stats():
                global calls
                while not stop.is_set():
                    torch.cuda.memory_stats()
                    calls += 1
            reader = threading.Thread(target=stats, daemon=True)
            reader.start()
            rng = random.Random(round)
            with torch.cuda.use_mem_pool(pool):
                tensors = []
                for i in range(24):
                    tensors.append(torch.full((rng.choice([256, 4096, 1 << 16, 1 << 18, 1 << 20]),), 1.0, device="cuda"))
                    if i % 3 == 2:
                        del tensors[rng.randrange(len(tensors))]
                kept.append(torch.ones(((round % 25) + 1) << 18, device="cuda"))
                total = sum(float(t.sum()) for t in tensors)
                assert total == sum(t.numel() for t in tensors)
                del tensors
            if round % 10 == 9:
                torch.cuda.empty_cache()
            stop.set()
            reader.join(60)
            assert not reader.is_alive(), f"round {round}: the memory_stats thread hangs"
            done += 1
        print(json.dumps({"rounds": done, "stats_calls": calls, "allocator": vmmd.torch.allocator().stats()}))
    """, timeout=240)
    print(answer)
    assert answer["rounds"] == 100 and answer["stats_calls"] > 100
    assert answer["allocator"]["mallocs"] > 20 and answer["allocator"]["refill_timeouts"] == 0


def test_torch_empty_cache_gives_the_memory_back() -> None:
    pytest.importorskip("torch")
    answer = run_python("""
        import gc, json, time, torch, vmmd.torch
        pool = vmmd.torch.mem_pool(idle_seconds=2)
        client = vmmd.torch.allocator().client
        def held():
            return sum(int(s.allocated_bytes) for s in client.admin.list_sessions().sessions if int(s.id) == int(client.session.id))
        with torch.cuda.use_mem_pool(pool):
            model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(6)]).cuda()
        torch.cuda.synchronize()
        during = held()
        del model
        gc.collect()
        torch.cuda.empty_cache()
        time.sleep(0.5)
        after_empty = held()
        del pool
        gc.collect()
        torch.cuda.empty_cache()
        time.sleep(0.5)
        after_pool = held()
        deadline = time.monotonic() + 10
        while held() and time.monotonic() < deadline:
            time.sleep(0.1)
        print(json.dumps({"during": during, "after_empty_cache": after_empty, "after_pool_deleted": after_pool, "after_idle": held()}))
    """, timeout=120)
    print(answer)
    assert answer["during"] >= 6 * 4096 * 4096 * 4
    # PyTorch frees a live MemPool's segments only once the pool is gone; what it frees goes back at once,
    # and the room leased ahead (a quarter of what was held, and a chunk) once the pool has been idle.
    assert answer["after_pool_deleted"] <= answer["during"] // 4 + 2 * (64 << 20)
    assert answer["after_idle"] == 0


def test_a_copy_between_two_devices_arrays_works_under_vmmd_numba() -> None:
    pytest.importorskip("numba.cuda")
    answer = run_python("""
        import json, numpy
        from numba import cuda
        if len(cuda.gpus) < 2:
            print(json.dumps({"skip": "one GPU"}))
            raise SystemExit(0)
        with cuda.gpus[0]:
            a = cuda.to_device(numpy.arange(1 << 20, dtype=numpy.float32))
        with cuda.gpus[1]:
            b = cuda.device_array(1 << 20, dtype=numpy.float32)
            b.copy_to_device(a)
            out = b.copy_to_host()
        print(json.dumps({"ok": bool((out == numpy.arange(1 << 20, dtype=numpy.float32)).all())}))
    """, env={"NUMBA_CUDA_MEMORY_MANAGER": "vmmd.numba"}, timeout=120)
    if "skip" in answer:
        pytest.skip(answer["skip"])
    assert answer["ok"]
