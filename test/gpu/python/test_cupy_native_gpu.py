"""vmmd.cupy's C path on a GPU (CuPy's CFunctionAllocator over
_cupy_allocator.c): it is the path use() takes, its blocks follow the stream
CuPy considers current, a Stream that CuPy destroys while its freed blocks are
held breaks nothing, out of memory is CuPy's OutOfMemoryError after the cache
went back, and the pool in Python (native=False) gives the same results."""
from __future__ import annotations

import pytest

from conftest import run_python


def test_use_takes_the_c_path_and_reuses_blocks_by_stream() -> None:
    pytest.importorskip("cupy")
    answer = run_python("""
        import json, cupy, vmmd.cupy
        allocator = vmmd.cupy.use()
        a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        with a:
            x = cupy.ones(1 << 18, dtype=cupy.float32)
            first = x.data.ptr
            del x
            again = cupy.ones(1 << 18, dtype=cupy.float32).data.ptr
        with b:
            y = cupy.ones(1 << 18, dtype=cupy.float32)
        a.synchronize(); b.synchronize()
        print(json.dumps({"native": allocator._carver is not None, "same_stream": again == first, "other_stream": y.data.ptr == first,
                          "sum": float(y.sum()), "counters": allocator._carver.library_counters()}))
    """)
    assert answer["native"] and answer["same_stream"] and not answer["other_stream"]
    assert answer["sum"] == 1 << 18 and answer["counters"]["same_stream_reused"] >= 1


def test_a_destroyed_stream_with_held_blocks_breaks_nothing() -> None:
    pytest.importorskip("cupy")
    answer = run_python("""
        import faulthandler, gc, json, cupy, vmmd.cupy
        faulthandler.enable()
        allocator = vmmd.cupy.use(chunk_size=4 << 20, large_threshold=4 << 20, idle_seconds=0)
        keep = []
        for round in range(20):
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                keep.append(cupy.arange(1000, dtype=cupy.float32))  # outlives its stream
                temporary = cupy.ones(1 << 19, dtype=cupy.float32)
                total = float(temporary.sum())
                del temporary
            del stream
            gc.collect()
        fresh = cupy.ones(1 << 20, dtype=cupy.float32)  # room from what the dead streams held, or a new chunk
        returned = allocator.free_all_blocks()
        keep.clear()
        returned += allocator.free_all_blocks()
        del fresh
        returned += allocator.free_all_blocks()
        print(json.dumps({"total": total, "returned": returned, "stats": allocator.stats()}))
    """)
    assert answer["total"] == 1 << 19 and answer["returned"] > 0
    assert all(s["chunks"] == 0 for s in answer["stats"].values()), answer


def test_out_of_memory_is_cupys_after_the_cache_went_back() -> None:
    pytest.importorskip("cupy")
    answer = run_python("""
        import faulthandler, json, cupy, vmmd, vmmd.cupy
        faulthandler.enable()
        allocator = vmmd.cupy.use(idle_seconds=0)
        cached = cupy.ones(8 << 20, dtype=cupy.uint8)
        del cached
        try:
            cupy.empty(1 << 46, dtype=cupy.uint8)
            caught = None
        except cupy.cuda.memory.OutOfMemoryError as error:
            caught = [isinstance(error, vmmd.OutOfMemoryError), error.out_of_memory]
        after = cupy.arange(10).sum()
        print(json.dumps({"caught": caught, "after": int(after), "retries": allocator._carver.counters["out_of_memory_retries"]}))
    """)
    assert answer["caught"] == [True, True] and answer["after"] == 45 and answer["retries"] == 1


def test_the_c_path_and_the_pool_in_python_give_the_same_results() -> None:
    pytest.importorskip("cupy")
    code = """
        import json, cupy, vmmd.cupy
        vmmd.cupy.use(native={native})
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]
        total = 0.0
        for it in range(10):
            for index, stream in enumerate(streams):
                with stream:
                    a = cupy.random.RandomState(it * 3 + index).rand(256, 256, dtype=cupy.float32)
                    t = cupy.empty(20 << 20, dtype=cupy.uint8)
                    t.fill(1)
                    total += float((a @ a).sum() + cupy.sort(a.ravel())[-1] + t[:1024].sum())
        print(json.dumps({{"total": total}}))
    """
    assert run_python(code.format(native=True)) == run_python(code.format(native=False))
