"""The pools against the allocators they replace, on one GPU (scripts/gpu-python.sh
with VMMD_STEPS=pools-bench, or by hand with a cuda daemon at VMMD_SOCKET_DIR):
  cupy-mixed   matmul, FFT, sort, reductions, small and 64 MiB temporaries on
               4 streams: vmmd.cupy against CuPy's MemoryPool (time, checksum)
               (each side a process of its own, alternating; best and median of
               REPEATS processes of 3 timed runs each; vmmd-python: the pool in Python)
  torch-train  an MLP trained inside vmmd.torch.mem_pool() against PyTorch's
               own allocator, both in each of REPEATS processes, in alternating
               rounds (steps per second: the median of the rounds' ratios; final
               losses; PyTorch's calls into vmmd while timed)
Writes OUT.json.

    python3 pools_bench.py OUT.json [--repeats 3] [--cupy-modes cupy,vmmd,vmmd-python] [--rounds 8] [--steps 500]"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any, Dict, List, Optional

CUPY = r'''
import json, sys, time, cupy
if MODE == "vmmd":
    import vmmd.cupy
    vmmd.cupy.use()
elif MODE == "vmmd-python":
    import vmmd.cupy
    vmmd.cupy.use(native=False)
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
times = []
for _ in range(TIMED):
    start = time.perf_counter()
    checksum = run(ITERATIONS)
    times.append(time.perf_counter() - start)
print(json.dumps({"seconds": min(times), "times": times, "checksum": checksum}))
'''

TORCH = r'''
import contextlib, json, time, torch
import vmmd.torch
# Both sides in this process, alternating rounds (ABBA): the process's own speed (its CPU, clocks, placement) is the
# same for both, and a round's ratio compares steps run moments apart. The same seed gives both the same model and data.
pool = vmmd.torch.mem_pool()
def build(in_pool):
    torch.manual_seed(0)
    context = torch.cuda.use_mem_pool(pool) if in_pool else contextlib.nullcontext()
    with context:
        model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.randn(256, 2048, device="cuda")
        target = torch.randint(0, 10, (256,), device="cuda")
    return model, optimizer, data, target
sides = {"torch": build(False), "vmmd": build(True)}
def steps(mode, count):
    model, optimizer, data, target = sides[mode]
    loss = None
    for _ in range(count):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
    return loss
def timed(mode, count):
    torch.cuda.synchronize()
    start = time.perf_counter()
    if mode == "vmmd":
        with torch.cuda.use_mem_pool(pool):
            loss = steps(mode, count)
    else:
        loss = steps(mode, count)
    torch.cuda.synchronize()
    return count / (time.perf_counter() - start), loss
for mode in ("torch", "vmmd"):
    timed(mode, 20)
before = vmmd.torch.allocator().stats()
rates = {"torch": [], "vmmd": []}
losses = {}
for round in range(ROUNDS):
    for mode in (("torch", "vmmd") if round % 2 == 0 else ("vmmd", "torch")):
        rate, loss = timed(mode, STEPS)
        rates[mode].append(rate)
        losses[mode] = float(loss)
after = vmmd.torch.allocator().stats()
print(json.dumps({"rates": rates, "losses": losses, "mallocs_while_timed": after["mallocs"] - before["mallocs"], "refill_waits_while_timed": after["refill_waits"] - before["refill_waits"]}))
'''


def child(code: str, mode: str, **constants: Any) -> Dict[str, Any]:
    prelude = f"MODE = {mode!r}\n" + "".join(f"{name} = {value!r}\n" for name, value in constants.items())
    result = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        return {"error": result.stderr[-2000:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cupy-modes", default="cupy,vmmd", help="which allocators cupy-mixed runs (cupy, vmmd, vmmd-python)")
    parser.add_argument("--rounds", type=int, default=8, help="torch-train: alternating rounds per process")
    parser.add_argument("--steps", type=int, default=500, help="torch-train: steps per round")
    args = parser.parse_args()
    modes = args.cupy_modes.split(",")
    results: Dict[str, Any] = {"cupy_mixed": {mode: [] for mode in modes}, "torch_train": []}
    for _ in range(args.repeats):
        for mode in modes:
            results["cupy_mixed"][mode].append(child(CUPY, mode, ITERATIONS=40, TIMED=3))
        results["torch_train"].append(child(TORCH, "both", ROUNDS=args.rounds, STEPS=args.steps))
    cupy_best = {mode: min((run["seconds"] for run in runs if "seconds" in run), default=None) for mode, runs in results["cupy_mixed"].items()}
    cupy_median = {mode: median([t for run in runs for t in run.get("times", [])]) for mode, runs in results["cupy_mixed"].items()}
    torch_runs = [run for run in results["torch_train"] if "rates" in run]
    # A round's ratio: vmmd's steps per second over PyTorch's, run moments apart in one process.
    ratios = [v / t for run in torch_runs for t, v in zip(run["rates"]["torch"], run["rates"]["vmmd"])]
    summary: Dict[str, Any] = {
        "cupy_mixed_best_seconds": cupy_best,
        "cupy_mixed_median_seconds": cupy_median,
        "cupy_checksums_equal": len({round(r.get("checksum", -1), 3) for runs in results["cupy_mixed"].values() for r in runs}) == 1,
        "torch_steps_ratio_median": median(ratios),
        "torch_steps_ratio_range": [min(ratios), max(ratios)] if ratios else None,
        "torch_steps_per_second_median": {mode: median([r for run in torch_runs for r in run["rates"][mode]]) for mode in ("torch", "vmmd")},
        "torch_losses_equal": bool(torch_runs) and all(run["losses"]["torch"] == run["losses"]["vmmd"] for run in torch_runs),
        "torch_mallocs_while_timed": [run["mallocs_while_timed"] for run in torch_runs],
    }
    for mode in modes:
        if mode != "cupy" and cupy_best.get(mode) and cupy_best.get("cupy"):
            summary[f"cupy_mixed_time_ratio_{mode}"] = cupy_best[mode] / cupy_best["cupy"]  # type: ignore[operator]
    results["summary"] = summary
    json.dump(results, open(args.out, "w"), indent=1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
