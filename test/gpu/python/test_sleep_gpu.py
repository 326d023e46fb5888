"""Sleep and wake on a GPU: PyTorch tensors (torch_memory_saver's API and
vLLM's levels), CuPy arrays and Numba device arrays keep their addresses and
(offloaded) contents; a CUDA graph captured on vmmd memory before sleep
replays after wake with equal results, 100 of 100 cycles (PyTorch, and a
CuPy kernel); two PyTorch processes each needing 60% of the GPU alternate
sleep and wake 50 times while a third keeps allocating, then wake both at
once: no out of memory, no error, every checksum equal after each wake."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any, List

import pytest

from conftest import run_python


def test_torch_tensors_keep_addresses_and_backed_up_contents() -> None:
    pytest.importorskip("torch")
    answer = run_python("""
        import json, torch
        from vmmd.torch import torch_memory_saver as saver, allocator
        from vmmd import _cuda
        with saver.region(tag="weights", enable_cpu_backup=True):
            w = torch.randn(64 << 20, device="cuda")           # 256 MiB
        with saver.region(tag="kv_cache"):
            kv = torch.ones(128 << 20, device="cuda")         # 512 MiB
        checksum, pointers = float(w.double().sum()), (w.data_ptr(), kv.data_ptr())
        in_vmmd = all(allocator().supply.locate(p) is not None for p in pointers)
        free_awake = _cuda.memory_info(0)[0]
        saver.pause()
        import time
        deadline = time.monotonic() + 5   # the daemon may hold a free until it is quiet
        while _cuda.memory_info(0)[0] - free_awake < 700 << 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        free_asleep = _cuda.memory_info(0)[0]
        saver.resume()
        kv.fill_(2)
        print(json.dumps({"in_vmmd": in_vmmd, "same": (w.data_ptr(), kv.data_ptr()) == pointers,
                          "equal": float(w.double().sum()) == checksum, "kv": float(kv.sum()),
                          "freed": free_asleep - free_awake}))
    """)
    assert answer["in_vmmd"] and answer["same"] and answer["equal"] and answer["kv"] == 2.0 * (128 << 20), answer
    assert answer["freed"] >= 700 << 20, f"pause gave back {answer['freed']} bytes: {answer}"


def test_a_backed_up_regions_copies_are_made_ahead_and_serve_the_first_pause() -> None:
    pytest.importorskip("torch")
    answer = run_python("""
        import json, torch, vmmd.torch
        from vmmd import _sleep
        from vmmd.torch import torch_memory_saver as saver
        # No chunk goes back idle meanwhile: a chunk given back takes its copy along.
        supply = vmmd.torch.allocator(idle_seconds=0).supply
        with saver.region(tag="weights", enable_cpu_backup=True):
            w = torch.randn(256 << 20, device="cuda")          # 1 GiB
        torch.cuda.synchronize()

        def records():
            # A snapshot: the refill thread adds records meanwhile (the chunk it leases ahead of the next malloc).
            return dict(list(supply._segments.items()))

        def copies():
            _sleep.settle(list(records().values()))
            return {hex(base): {"size": int(s.memory.size), "copy": None if s.copy is None else int(s.copy.allocation_id),
                                "copy_size": 0 if s.copy is None else int(s.copy.size), "error": None if s.prepare_error is None else repr(s.prepare_error)}
                    for base, s in records().items()}

        before = copies()
        where = next((hex(base) for base, s in records().items() if int(s.memory.address) <= w.data_ptr() < int(s.memory.address) + int(s.memory.size)), None)
        checksum = float(w.double().sum())
        saver.pause("weights")
        saver.resume("weights")
        after = copies()
        chunks = {hex(base): tag for base, (_, _, tag) in list(supply._chunks.items())}
        print(json.dumps({"before": before, "after": after, "where": where, "equal": float(w.double().sum()) == checksum,
                          "chunks": chunks, "errors": [repr(e) for e in supply.errors], "counters": supply.counters()}))
    """)
    before, after, where = answer["before"], answer["after"], answer["where"]
    # The tensor's chunk has its record and its copy, made ahead, as large as the chunk.
    assert where is not None and before[where]["copy"] is not None and before[where]["copy_size"] >= 1 << 30, answer
    assert all(record["error"] is None for record in before.values()), answer
    assert answer["equal"], answer
    # The pause used the copies made ahead (no new ones) and the resume kept them for the next pause.
    assert all(after[base]["copy"] == record["copy"] for base, record in before.items() if record["copy"] is not None), answer
    assert all(record["copy"] is not None for record in after.values()), answer


def test_a_plain_mem_pool_sleeps_and_wakes() -> None:
    pytest.importorskip("torch")
    answer = run_python("""
        import json, torch, vmmd.torch
        with torch.cuda.use_mem_pool(vmmd.torch.mem_pool()):
            t = torch.arange(1 << 24, device="cuda", dtype=torch.int64)
        pointer = t.data_ptr()
        vmmd.torch.allocator().sleep("offload")
        vmmd.torch.allocator().wake()
        print(json.dumps({"same": t.data_ptr() == pointer, "equal": bool(torch.equal(t, torch.arange(1 << 24, device="cuda", dtype=torch.int64)))}))
    """)
    assert answer == {"same": True, "equal": True}, answer


def test_vllm_levels_keep_the_weights_and_drop_the_rest() -> None:
    pytest.importorskip("torch")
    answer = run_python("""
        import json, torch, vmmd.torch as vt
        with vt.use_memory_pool("weights"):
            w = torch.arange(1 << 24, device="cuda", dtype=torch.float32)
        with vt.use_memory_pool("kv_cache"):
            kv = torch.zeros(1 << 24, device="cuda")
        results = []
        for level in (1, 2):
            vt.sleep(level)
            vt.wake_up(["weights"])
            results.append(bool(torch.equal(w, torch.arange(1 << 24, device="cuda", dtype=torch.float32))))
            vt.wake_up()
            kv.fill_(level)
            w.copy_(torch.arange(1 << 24, device="cuda", dtype=torch.float32))
        print(json.dumps({"weights_kept": results}))
    """)
    # Level 1 keeps the weights; level 2 drops them (new memory: whatever it holds).
    assert answer["weights_kept"][0] is True, answer


def test_cupy_and_numba_arrays_keep_addresses_and_contents() -> None:
    pytest.importorskip("cupy")
    answer = run_python("""
        import json, cupy, vmmd.cupy
        allocator = vmmd.cupy.use(idle_seconds=0)
        small, large = cupy.arange(1000, dtype=cupy.float32), cupy.arange(40 << 20, dtype=cupy.int32)
        pointers = (small.data.ptr, large.data.ptr)
        allocator.sleep("offload")
        allocator.wake()
        print(json.dumps({"same": (small.data.ptr, large.data.ptr) == pointers,
                          "equal": bool((small == cupy.arange(1000, dtype=cupy.float32)).all()) and bool((large == cupy.arange(40 << 20, dtype=cupy.int32)).all())}))
    """)
    assert answer == {"same": True, "equal": True}, answer
    pytest.importorskip("numba.cuda")
    answer = run_python("""
        import json, numpy
        from numba import cuda
        import vmmd.numba
        host = numpy.arange(10 << 20, dtype=numpy.float64)
        d = cuda.to_device(host)
        pointer = d.device_ctypes_pointer.value
        vmmd.numba.sleep("offload")
        vmmd.numba.wake()
        print(json.dumps({"same": d.device_ctypes_pointer.value == pointer, "equal": bool((d.copy_to_host() == host).all())}))
    """, env={"NUMBA_CUDA_MEMORY_MANAGER": "vmmd.numba"})
    assert answer == {"same": True, "equal": True}, answer


# What a pool holds ahead (prepare_copies) after its copies are made, and around a sleep and wake; `stats()` is the pool's.
PREPARED_CYCLE = textwrap.indent(textwrap.dedent("""
    def settled(stats):
        deadline = time.monotonic() + 60
        while stats()["prepare_pending"] and time.monotonic() < deadline:
            time.sleep(0.01)
        return stats()

    def cycle(stats, sleep, wake, error):
        before = settled(stats)
        sleep("offload")
        wake()
        after = settled(stats)
        return {"before": before, "after": after, "held": before["bytes"] + before["large_bytes"], "error": repr(error())}
"""), " " * 8)


def test_cupy_and_numba_pools_make_their_copies_ahead_and_keep_them() -> None:
    pytest.importorskip("cupy")
    answer = run_python("""
        import json, time, cupy, vmmd.cupy
    """ + PREPARED_CYCLE + """
        allocator = vmmd.cupy.use(idle_seconds=0, prepare_copies=True)
        small, large = cupy.arange(1000, dtype=cupy.float32), cupy.arange(64 << 20, dtype=cupy.int32)
        cupy.cuda.runtime.deviceSynchronize()
        device = cupy.cuda.runtime.getDevice()
        result = cycle(lambda: allocator.stats()[device], allocator.sleep, allocator.wake, lambda: allocator.prepare_error)
        result["equal"] = bool((small == cupy.arange(1000, dtype=cupy.float32)).all()) and bool((large == cupy.arange(64 << 20, dtype=cupy.int32)).all())
        print(json.dumps(result))
    """)
    # Every chunk's copy made ahead, used by the sleep, kept after wake.
    assert answer["error"] == "None" and answer["equal"], answer
    assert answer["before"]["prepared_bytes"] == answer["held"] >= 256 << 20, answer
    assert answer["after"]["prepared_bytes"] == answer["before"]["prepared_bytes"], answer
    pytest.importorskip("numba.cuda")
    answer = run_python("""
        import json, time, numpy
        from numba import cuda
        import vmmd.numba
    """ + PREPARED_CYCLE + """
        host = numpy.arange(32 << 20, dtype=numpy.float64)
        d = cuda.to_device(host)
        cuda.synchronize()
        pool = cuda.current_context().memory_manager.pool
        result = cycle(pool.stats, vmmd.numba.sleep, vmmd.numba.wake, lambda: pool.prepare_error)
        result["equal"] = bool((d.copy_to_host() == host).all())
        print(json.dumps(result))
    """, env={"NUMBA_CUDA_MEMORY_MANAGER": "vmmd.numba", "VMMD_NUMBA_PREPARE_COPIES": "1"})
    assert answer["error"] == "None" and answer["equal"], answer
    assert answer["before"]["prepared_bytes"] == answer["held"] >= 256 << 20, answer
    assert answer["after"]["prepared_bytes"] == answer["before"]["prepared_bytes"], answer


def test_a_torch_cuda_graph_replays_after_100_sleeps() -> None:
    pytest.importorskip("torch")
    answer = run_python("""
        import json, torch
        from vmmd.torch import torch_memory_saver as saver, allocator
        with saver.region(tag="weights", enable_cpu_backup=True):
            x = torch.randn(1 << 22, device="cuda")
            w = torch.randn(1 << 22, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                y = torch.relu(x * w + 1.0).sum()      # warm-up, as torch.cuda.graph asks
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with saver.cuda_graph(graph, tag="graph"):
            y = torch.relu(x * w + 1.0).sum()
        graph.replay()
        expected = float(y)
        graph_in_vmmd = allocator().supply.locate(y.data_ptr()) is not None
        good = 0
        for _ in range(100):
            saver.pause()
            saver.resume()
            y.zero_()
            graph.replay()
            good += float(y) == expected
        print(json.dumps({"good": good, "graph_in_vmmd": graph_in_vmmd}))
    """, timeout=300)
    assert answer == {"good": 100, "graph_in_vmmd": True}, answer


def test_a_cupy_cuda_graph_replays_after_100_sleeps() -> None:
    pytest.importorskip("cupy")
    answer = run_python("""
        import json, cupy, vmmd.cupy
        allocator = vmmd.cupy.use(idle_seconds=0)
        kernel = cupy.ElementwiseKernel("float32 x, float32 w", "float32 y", "y = x * w + 1.0f", "fma1")
        x = cupy.random.rand(1 << 22, dtype=cupy.float32)
        w = cupy.random.rand(1 << 22, dtype=cupy.float32)
        y = cupy.empty_like(x)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            kernel(x, w, y)                             # compiled before capture
            stream.synchronize()
            stream.begin_capture()
            kernel(x, w, y)
            graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        expected = float(y.sum())
        good = 0
        for _ in range(100):
            allocator.sleep("offload")
            allocator.wake()
            y.fill(0)
            graph.launch(stream)
            stream.synchronize()
            good += float(y.sum()) == expected
        print(json.dumps({"good": good}))
    """, timeout=300)
    assert answer == {"good": 100}, answer


ENGINE = r'''
import json, sys, torch, vmmd
from vmmd.torch import torch_memory_saver as saver
# 60% of the GPU: weights (kept across sleeps) and a KV cache (dropped, refilled after each wake), as a vLLM worker at level 1.
total = torch.cuda.mem_get_info()[1]
share = int(total * 0.60)
weights_bytes = min(share // 8, 2 << 30)
saver.retain_cpu_backup = True  # the weights' host copies are made once, as an RL loop would keep them
with saver.region(tag="weights", enable_cpu_backup=True):
    weights = [torch.randn(weights_bytes // 4 // 8, device="cuda") for _ in range(8)]
with saver.region(tag="kv_cache"):
    cache = torch.empty((share - weights_bytes) // 4, device="cuda")
sums = [float(t.double().sum()) for t in weights]
errors, oom, bad = [], 0, 0
def cycle():
    global oom, bad
    try:
        saver.resume(timeout=120)
    except vmmd.VmmdError as error:
        oom += error.out_of_memory
        raise
    bad += sum(float(t.double().sum()) != s for t, s in zip(weights, sums))
    cache.fill_(1.0)
    torch.cuda.synchronize()
    saver.pause()
saver.pause()
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    command = line.strip()
    if command == "cycle":
        try:
            cycle()
        except Exception as error:
            errors.append(repr(error))
        print(json.dumps({"done": True}), flush=True)
    elif command.startswith("run "):
        for _ in range(int(command.split()[1])):
            try:
                cycle()
            except Exception as error:
                errors.append(repr(error))
        print(json.dumps({"done": True}), flush=True)
    elif command == "report":
        print(json.dumps({"errors": errors[:5], "error_count": len(errors), "oom": oom, "bad_checksums": bad}), flush=True)
        break
'''

ALLOCATOR = r'''
import json, os, sys, vmmd
client = vmmd.connect()
count, oom, errors = 0, 0, []
while not os.path.exists(sys.argv[1]):
    try:
        memory = client.vmm.allocate(256 << 20)
        memory.write(0, b"x" * 4096)
        memory.close()
        client.vmm.release(allocation_id=memory.allocation_id)
        count += 1
    except vmmd.VmmdError as error:
        oom += error.out_of_memory
        errors.append(repr(error))
print(json.dumps({"allocations": count, "oom": oom, "errors": errors[:5]}), flush=True)
'''


def _spawn(code: str, *args: str) -> subprocess.Popen:
    script = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    script.write(textwrap.dedent(code))
    script.close()
    return subprocess.Popen([sys.executable, script.name, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ))


def _ask(process: subprocess.Popen, command: str) -> Any:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(command + "\n")
    process.stdin.flush()
    line = process.stdout.readline()
    if not line:
        raise AssertionError(f"an engine exited with {process.wait()}")
    return json.loads(line)


def test_two_engines_alternate_50_times_while_a_third_allocates_then_wake_at_once() -> None:
    pytest.importorskip("torch")
    engines: List[subprocess.Popen] = []
    stop = tempfile.mktemp(prefix="vmmd-stop-")
    third = None
    try:
        # One after the other: each needs 60% of the GPU until its first pause.
        for _ in range(2):
            engines.append(_spawn(ENGINE))
            assert engines[-1].stdout is not None and json.loads(engines[-1].stdout.readline())["ready"]
        third = _spawn(ALLOCATOR, stop)
        start = time.monotonic()
        for _ in range(50):
            for engine in engines:
                assert _ask(engine, "cycle")["done"]
        alternated = time.monotonic() - start
        # Both at once: the daemon serializes the wakes and queues the one that finds no room until the other sleeps.
        assert engines[0].stdin is not None and engines[1].stdin is not None
        for engine in engines:
            engine.stdin.write("run 50\n")  # type: ignore[union-attr]
            engine.stdin.flush()  # type: ignore[union-attr]
        for engine in engines:
            assert json.loads(engine.stdout.readline())["done"]  # type: ignore[union-attr]
        reports = [_ask(engine, "report") for engine in engines]
        open(stop, "w").close()
        allocations = json.loads(third.stdout.readline())  # type: ignore[union-attr]
    finally:
        for process in engines + ([third] if third else []):
            process.kill()
        if os.path.exists(stop):
            os.unlink(stop)
    print(json.dumps({"alternated_seconds": alternated, "reports": reports, "third": allocations}))
    for report in reports:
        assert report == {"errors": [], "error_count": 0, "oom": 0, "bad_checksums": 0}, report
    assert allocations["oom"] == 0 and allocations["errors"] == [] and allocations["allocations"] > 0, allocations
