"""The pools against the allocators they replace, on one GPU (scripts/gpu-python.sh
with VMMD_STEPS=pools-bench, or by hand with a cuda daemon at VMMD_SOCKET_DIR):
  cupy-mixed   matmul, FFT, sort, reductions, small and 64 MiB temporaries on
               4 streams: vmmd.cupy against CuPy's MemoryPool (time, checksum)
  torch-train  an MLP trained inside vmmd.torch.mem_pool() against PyTorch's
               own allocator (steps per second, final loss)
Each side runs in a process of its own, alternating, best of REPEATS. Writes OUT.json.

    python3 pools_bench.py OUT.json [--repeats 3]"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any, Dict

CUPY = r'''
import json, sys, time, cupy
if MODE == "vmmd":
    import vmmd.cupy
    vmmd.cupy.use()
streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(4)]
def run(iterations):
    total = 0.0
    for it in range(iterations):
        for index, stream in enumerate(streams):
            with stream:
                rs = cupy.random.RandomState(it * 4 + index)
                a = rs.rand(512, 512, dtype=cupy.float32)
                b = a @ a
                f = cupy.fft.fft(a[0])
                s = cupy.sort(a.ravel())
                t = cupy.empty(64 << 20, dtype=cupy.uint8)
                t.fill(1)
                small = [cupy.arange(n) for n in (16, 256, 4096)]
                total += float(b.sum() + cupy.abs(f).sum() + s[-1] + t[:1024].sum() + sum(x.sum() for x in small))
    for stream in streams:
        stream.synchronize()
    return total
run(3)
start = time.perf_counter()
checksum = run(ITERATIONS)
print(json.dumps({"seconds": time.perf_counter() - start, "checksum": checksum}))
'''

TORCH = r'''
import json, time, torch, contextlib
torch.manual_seed(0)
context = contextlib.nullcontext()
if MODE == "vmmd":
    import vmmd.torch
    context = torch.cuda.use_mem_pool(vmmd.torch.mem_pool())
with context:
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(256, 2048, device="cuda", generator=None)
    target = torch.randint(0, 10, (256,), device="cuda")
    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        return loss
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        loss = step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
print(json.dumps({"steps_per_second": STEPS / seconds, "loss": float(loss)}))
'''


def child(code: str, mode: str, **constants: Any) -> Dict[str, Any]:
    prelude = f"MODE = {mode!r}\n" + "".join(f"{name} = {value!r}\n" for name, value in constants.items())
    result = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        return {"error": result.stderr[-2000:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: Dict[str, Any] = {"cupy_mixed": {"cupy": [], "vmmd": []}, "torch_train": {"torch": [], "vmmd": []}}
    for _ in range(args.repeats):
        for mode in ("cupy", "vmmd"):
            results["cupy_mixed"][mode].append(child(CUPY, mode, ITERATIONS=40))
        for mode in ("torch", "vmmd"):
            results["torch_train"][mode].append(child(TORCH, mode, STEPS=300))
    def best(runs: Any, key: str, low: bool) -> Any:
        values = [run[key] for run in runs if key in run]
        return (min(values) if low else max(values)) if values else None
    cupy_base, cupy_vmmd = best(results["cupy_mixed"]["cupy"], "seconds", True), best(results["cupy_mixed"]["vmmd"], "seconds", True)
    torch_base, torch_vmmd = best(results["torch_train"]["torch"], "steps_per_second", False), best(results["torch_train"]["vmmd"], "steps_per_second", False)
    results["summary"] = {
        "cupy_mixed_time_ratio": cupy_vmmd / cupy_base if cupy_base and cupy_vmmd else None,
        "cupy_checksums_equal": len({round(r.get("checksum", -1), 3) for runs in results["cupy_mixed"].values() for r in runs}) == 1,
        "torch_steps_ratio": torch_vmmd / torch_base if torch_base and torch_vmmd else None,
        "torch_losses_equal": len({r.get("loss") for runs in results["torch_train"].values() for r in runs}) == 1,
    }
    json.dump(results, open(args.out, "w"), indent=1)
    print(json.dumps(results["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
