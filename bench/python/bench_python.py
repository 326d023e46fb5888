"""Python benchmarks on the cuda backend (scripts/gpu-python.sh runs them):
  memalloc    pooled memalloc+free p50/p99 (µs) through vmmd.numba, against
              Numba's default manager, CuPy's MemoryPool and vmmd.cupy
  cold        cold 2 MiB allocations (session socket, import, map, access)
              from several Python processes at once, and their release
Each measurement runs in a process of its own. Writes OUT.json.

    python3 bench_python.py OUT.json [--iterations 2000] [--processes 8]"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict

SIZES = [256, 64 << 10, 1 << 20]

NUMBA = r'''
import json, sys, time, gc
from numba import cuda
ctx = cuda.current_context()
out = {}
for size in SIZES:
    for _ in range(200):  # warm: the pool's chunks, Numba's structures
        p = ctx.memalloc(size); del p
    samples = []
    for _ in range(ITERATIONS):
        t = time.perf_counter_ns()
        p = ctx.memalloc(size)
        del p
        samples.append(time.perf_counter_ns() - t)
    samples.sort()
    out[str(size)] = {"p50_us": samples[len(samples) // 2] / 1e3, "p99_us": samples[len(samples) * 99 // 100] / 1e3}
print(json.dumps({"manager": type(ctx.memory_manager).__name__, "sizes": out}))
'''

CUPY = r'''
import json, time, cupy
MODE = "MODE_"
if MODE == "vmmd":
    import vmmd.cupy
    malloc = vmmd.cupy.VmmdAllocator().malloc
else:
    malloc = cupy.cuda.MemoryPool().malloc
cupy.cuda.Device(0).use()
out = {}
for size in SIZES:
    for _ in range(200):
        p = malloc(size); del p
    samples = []
    for _ in range(ITERATIONS):
        t = time.perf_counter_ns()
        p = malloc(size)
        del p
        samples.append(time.perf_counter_ns() - t)
    samples.sort()
    out[str(size)] = {"p50_us": samples[len(samples) // 2] / 1e3, "p99_us": samples[len(samples) * 99 // 100] / 1e3}
print(json.dumps({"allocator": MODE, "sizes": out}))
'''

PING = r'''
import json, time, vmmd
client = vmmd.connect()
for _ in range(200):
    client.session.ping()
samples = []
for _ in range(ITERATIONS):
    t = time.perf_counter_ns()
    client.session.ping()
    samples.append(time.perf_counter_ns() - t)
samples.sort()
print(json.dumps({"p50_us": samples[len(samples) // 2] / 1e3, "p99_us": samples[len(samples) * 99 // 100] / 1e3}))
'''
COLD = r'''
import json, os, sys, time, vmmd
from vmmd import _cuda
client = vmmd.connect()
_cuda.ensure_context(0)
m = client.vmm.allocate(2 << 20); m.close(); client.vmm.release(allocation_id=m.allocation_id)  # warm: context, first import
start_at = float(sys.argv[1])
while time.time() < start_at:
    time.sleep(0.001)
allocate, free = [], []
for _ in range(COUNT):
    t = time.perf_counter_ns()
    m = client.vmm.allocate(2 << 20)
    t2 = time.perf_counter_ns()
    m.close()
    client.vmm.release(allocation_id=m.allocation_id)
    t3 = time.perf_counter_ns()
    allocate.append((t2 - t) / 1e3)
    free.append((t3 - t2) / 1e3)
allocate.sort(); free.sort()
print(json.dumps({"allocate_p50_us": allocate[len(allocate) // 2], "allocate_p99_us": allocate[len(allocate) * 99 // 100], "free_p50_us": free[len(free) // 2]}))
'''


def child(code: str, env: Dict[str, str], args: list = [], timeout: float = 300) -> Any:  # noqa: B006
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--cold", type=int, default=50)
    parser.add_argument("--only", default="", help="comma-separated measurement names (default: all)")
    args = parser.parse_args()
    only = [name for name in args.only.split(",") if name]
    result: Dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "errors": {}}

    def measure(name: str, body: Any) -> None:
        if only and name not in only:
            return
        try:
            result[name] = body()
            print(f"[bench] {name}: {json.dumps(result[name])}", flush=True)
        except Exception as error:  # record, go on
            result["errors"][name] = str(error)[-3000:]
            print(f"[bench] {name}: FAILED: {error}", flush=True)
        json.dump(result, open(args.out, "w"), indent=1)

    prelude = f"SIZES = {SIZES}\nITERATIONS = {args.iterations}\n"
    measure("session_ping", lambda: child(prelude + PING, {}))
    measure("memalloc_numba_vmmd", lambda: child(prelude + NUMBA, {"NUMBA_CUDA_MEMORY_MANAGER": "vmmd.numba"}))
    measure("memalloc_numba_default", lambda: child(prelude + NUMBA, {"NUMBA_CUDA_MEMORY_MANAGER": "default"}))
    measure("malloc_cupy_memorypool", lambda: child(prelude + CUPY.replace("MODE_", "cupy"), {}))
    measure("malloc_cupy_vmmd", lambda: child(prelude + CUPY.replace("MODE_", "vmmd"), {}))

    def cold() -> Dict[str, Any]:
        start_at = str(time.time() + 8)
        code = f"COUNT = {args.cold}\n" + COLD
        processes = [subprocess.Popen([sys.executable, "-c", code, start_at], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(args.processes)]
        answers = []
        for p in processes:
            out, err = p.communicate(timeout=300)
            if p.returncode != 0:
                raise RuntimeError(err[-3000:])
            answers.append(json.loads(out.strip().splitlines()[-1]))
        p50s = sorted(a["allocate_p50_us"] for a in answers)
        return {"processes": args.processes, "each": args.cold, "allocate_p50_us_per_process": p50s, "allocate_p50_us_median": p50s[len(p50s) // 2], "free_p50_us_median": sorted(a["free_p50_us"] for a in answers)[len(answers) // 2]}

    measure("cold_2mib_across_processes", cold)
    measure("cold_2mib_one_process", lambda: child(f"COUNT = {args.cold * 4}\n" + COLD, {}, [str(time.time())]))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
