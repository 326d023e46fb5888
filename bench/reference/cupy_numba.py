#!/usr/bin/env python3
"""The pooled-allocation references, measured in the same run as vmmd's
(bench/sections/allocations.ts spawns this on a GPU host):

- CuPy's MemoryPool: pool.malloc(size) then dropping the pointer (free to the pool);
- Numba's default allocator: current_context().memalloc(size) then .free()
  (cuMemAlloc with Numba's deferred frees, as a kernel's temporaries get).

Each pair is timed alone with perf_counter_ns after a warm-up (as many pairs as are timed for CuPy, as for vmmd).
  python3 bench/reference/cupy_numba.py SIZE[,SIZE...] ITERATIONS [all|cupy]   -> JSON on stdout
(cupy: CuPy's pool only, for the rounds that alternate with vmmd's; all, the default: Numba's too)
"""
import json
import sys
import time


def summarize(samples):
    samples.sort()
    n = len(samples)
    mean = sum(samples) / n
    return {
        "n": n,
        "p50_us": round(samples[n // 2] / 1000, 2),
        "p99_us": round(samples[min(n - 1, int(n * 0.99))] / 1000, 2),
        "mean_us": round(mean / 1000, 2),
        "ops_s": round(1e9 / mean),
    }


def timed(iterations, body, warmup=2000):
    for _ in range(warmup):
        body()
    clock = time.perf_counter_ns
    samples = [0] * iterations
    for i in range(iterations):
        start = clock()
        body()
        samples[i] = clock() - start
    return summarize(samples)


def main():
    sizes = [int(size) for size in sys.argv[1].split(",")]
    iterations = int(sys.argv[2])
    which = sys.argv[3] if len(sys.argv) > 3 else "all"
    if which not in ("all", "cupy"):
        sys.exit(f"cupy_numba.py: the third argument must be all or cupy, not {which!r}")
    rows = []
    errors = []
    try:
        import cupy

        pool = cupy.cuda.MemoryPool()

        for size in sizes:
            def cupy_pair(size=size):
                pointer = pool.malloc(size)
                del pointer

            rows.append({"allocator": f"CuPy MemoryPool {cupy.__version__}", "size": size, **timed(iterations, cupy_pair, warmup=iterations)})
        pool.free_all_blocks()
    except Exception as error:  # reported, not fatal: the other reference may still run
        errors.append(f"cupy: {error!r}")
    if which == "cupy":
        json.dump({"rows": rows, "errors": errors}, sys.stdout)
        return
    try:
        import numba
        from numba import cuda

        context = cuda.current_context()

        for size in sizes:
            def numba_pair(size=size):
                context.memalloc(size).free()

            rows.append({"allocator": f"Numba {numba.__version__} default (cuMemAlloc, deferred frees)", "size": size, **timed(iterations // 10, numba_pair, 200)})
        context.deallocations.clear()
    except Exception as error:
        errors.append(f"numba: {error!r}")
    json.dump({"rows": rows, "errors": errors}, sys.stdout)


if __name__ == "__main__":
    main()
