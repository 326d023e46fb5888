"""The shared-weights case on the GPU: one process loads a file into a vmmd
store once; N processes open it as PyTorch tensors and check a checksum
computed on the GPU; the device memory used is measured with all of them
open. Then the same with a PyTorch model placed through the vmmd MemPool,
and the baseline: each process copying the weights from host memory itself.

    python3 shared_weights.py OUT_DIR [--gib 8] [--openers 8] [--model-mib 1024]

Needs a daemon on the cuda backend (VMMD_SOCKET_DIR), torch and nvidia-smi.
Writes OUT_DIR/shared-weights.json; every phase logs and the run goes on
after a failure, recording it."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from typing import Any, Dict, List

CHUNK_WORDS = 64 << 20  # 256 MiB of int32 per chunk


def log(message: str) -> None:
    print(f"[shared-weights {time.strftime('%H:%M:%S')}] {message}", flush=True)


def gpu_used_mib() -> int:
    """Device memory in use on GPU 0 as nvidia-smi reports it (MiB); -1 where it cannot tell."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"], capture_output=True, text=True, timeout=30)
        return int(out.stdout.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as error:
        log(f"nvidia-smi: {error}")
        return -1


def write_file(path: str, size: int) -> int:
    """Writes `size` bytes of int32 words and returns their sum (an exact int)."""
    import numpy

    base = numpy.arange(CHUNK_WORDS, dtype=numpy.uint32) * numpy.uint32(2654435761)
    total = 0
    with open(path, "wb") as f:
        written, index = 0, 0
        while written < size:
            words = min(CHUNK_WORDS, (size - written) // 4)
            if words == 0:
                break
            chunk = (base[:words] + numpy.uint32(index * 7919 % (1 << 32))).view(numpy.int32)
            total += int(chunk.sum(dtype=numpy.int64))
            f.write(chunk.tobytes())
            written += words * 4
            index += 1
    return total


OPENER = r'''
import json, os, sys, time
t0 = time.perf_counter()
import torch, vmmd, vmmd.weights
t_import = time.perf_counter()
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t_context = time.perf_counter()
client = vmmd.connect()
t_connect = time.perf_counter()
MODE = sys.argv[1]
if MODE == "store":
    store = vmmd.weights.open_store(sys.argv[2], client=client)
    tensor = vmmd.weights.as_torch(store, "int32")
    t_open = time.perf_counter()
    total = 0
    for i in range(0, tensor.numel(), 64 << 20):
        total += int(tensor[i:i + (64 << 20)].sum(dtype=torch.int64))
    sums = {"all": total}
elif MODE == "model":
    spec = json.load(open(sys.argv[2]))["spec"]
    import vmmd.torch
    tensors = vmmd.torch.import_tensors(spec, client=client, read_only=True)
    t_open = time.perf_counter()
    sums = {name: float(t.double().sum()) for name, t in tensors.items()}
else:  # copy: this process reads the file from host memory into its own device memory
    import numpy
    path = sys.argv[2]
    size = os.path.getsize(path)
    tensor = torch.empty(size // 4, dtype=torch.int32, device="cuda")
    with open(path, "rb", buffering=0) as f:
        offset = 0
        while offset < size // 4:
            chunk = numpy.fromfile(f, dtype=numpy.int32, count=64 << 20)
            tensor[offset:offset + chunk.size].copy_(torch.from_numpy(chunk))
            offset += chunk.size
    torch.cuda.synchronize()
    t_open = time.perf_counter()
    total = 0
    for i in range(0, tensor.numel(), 64 << 20):
        total += int(tensor[i:i + (64 << 20)].sum(dtype=torch.int64))
    sums = {"all": total}
torch.cuda.synchronize()
t_sum = time.perf_counter()
print(json.dumps({"pid": os.getpid(), "import_s": t_import - t0, "context_s": t_context - t_import, "connect_ms": (t_connect - t_context) * 1e3,
                  "open_ms": (t_open - t_connect) * 1e3, "checksum_ms": (t_sum - t_open) * 1e3, "sums": sums}), flush=True)
open(sys.argv[3], "w").close()
while not os.path.exists(sys.argv[4]):
    time.sleep(0.02)
'''


def run_openers(count: int, mode: str, argument: str, work: str) -> Dict[str, Any]:
    """Starts `count` openers at once; with all of them holding the memory,
    measures the device memory used; then lets them go."""
    release = os.path.join(work, f"release-{mode}")
    readies = [os.path.join(work, f"ready-{mode}-{i}") for i in range(count)]
    for path in readies + [release]:
        if os.path.exists(path):
            os.unlink(path)
    before = gpu_used_mib()
    started = time.perf_counter()
    processes = [subprocess.Popen([sys.executable, "-c", OPENER, mode, argument, readies[i], release], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(count)]
    deadline = time.monotonic() + 600
    try:
        while not all(os.path.exists(r) for r in readies):
            failed = [p for p in processes if p.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(f"an opener failed: {failed[0].stderr.read()[-3000:]}")  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                raise RuntimeError("openers did not finish within 600 s")
            time.sleep(0.05)
        all_ready = time.perf_counter() - started
        during = gpu_used_mib()
    finally:
        open(release, "w").close()
    results = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        if process.returncode != 0:
            raise RuntimeError(f"an opener exited with {process.returncode}: {err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {"processes": results, "gpu_used_mib_before": before, "gpu_used_mib_all_open": during, "all_ready_s": all_ready}


def spread(values: List[float]) -> Dict[str, float]:
    values = sorted(values)
    return {"min": round(values[0], 2), "p50": round(values[len(values) // 2], 2), "max": round(values[-1], 2)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--gib", type=float, default=8)
    parser.add_argument("--openers", type=int, default=8)
    parser.add_argument("--model-mib", type=int, default=1024)
    parser.add_argument("--work", default=None, help="where the weights file goes (default OUT)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    work = args.work or args.out
    report: Dict[str, Any] = {"gib": args.gib, "openers": args.openers, "phases": {}, "errors": []}
    path = os.path.join(work, "weights.bin")
    size = int(args.gib * (1 << 30)) // 4 * 4  # whole int32 words

    def phase(name: str, body: Any) -> Any:
        log(f"{name}: start")
        started = time.perf_counter()
        try:
            value = body()
            report["phases"][name] = {"ok": True, "seconds": round(time.perf_counter() - started, 2), **(value or {})}
            log(f"{name}: done in {time.perf_counter() - started:.1f} s: {json.dumps(value)[:1500]}")
            return value
        except Exception as error:  # record and go on
            report["phases"][name] = {"ok": False, "error": f"{type(error).__name__}: {error}"[-3000:]}
            report["errors"].append(name)
            log(f"{name}: FAILED: {error}")
            return None
        finally:
            json.dump(report, open(os.path.join(args.out, "shared-weights.json"), "w"), indent=1)

    expected: Dict[str, int] = {}
    phase("write-file", lambda: expected.update(all=write_file(path, size)) or {"bytes": size, "checksum": expected["all"]})
    baseline_used = gpu_used_mib()
    name = f"shared-weights-{os.getpid()}"
    loader = textwrap.dedent(f"""
        import json, time, vmmd, vmmd.weights
        t = time.perf_counter()
        store = vmmd.weights.load_file({path!r}, {name!r})
        print(json.dumps({{"load_s": time.perf_counter() - t, "store": int(store.id), "size": int(store.size)}}))
    """)

    def load() -> Dict[str, Any]:
        out = subprocess.run([sys.executable, "-c", loader], capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-3000:])
        answer = json.loads(out.stdout.strip().splitlines()[-1])
        answer["gpu_used_mib_after_load"] = gpu_used_mib()
        answer["gpu_used_mib_before_load"] = baseline_used
        answer["load_gb_per_s"] = round(size / answer["load_s"] / 1e9, 2)
        return answer

    phase("load-into-store", load)

    def open_store() -> Dict[str, Any]:
        result = run_openers(args.openers, "store", name, work)
        processes = result["processes"]
        bad = [p["pid"] for p in processes if p["sums"]["all"] != expected.get("all")]
        return {
            "checksums_ok": not bad, "bad_pids": bad,
            "open_ms": spread([p["open_ms"] for p in processes]),
            "connect_ms": spread([p["connect_ms"] for p in processes]),
            "context_s": spread([p["context_s"] for p in processes]),
            "checksum_ms": spread([p["checksum_ms"] for p in processes]),
            "gpu_used_mib_before": result["gpu_used_mib_before"], "gpu_used_mib_all_open": result["gpu_used_mib_all_open"],
            "gpu_growth_mib_with_all_open": result["gpu_used_mib_all_open"] - baseline_used,
            "store_mib": size >> 20, "all_ready_s": round(result["all_ready_s"], 2), "processes": processes,
        }

    phase("open-store", open_store)

    def detach() -> Dict[str, Any]:
        import vmmd

        with vmmd.connect() as client:
            client.stores.detach(name)
        time.sleep(1)
        return {"gpu_used_mib_after_detach": gpu_used_mib()}

    phase("detach-store", detach)

    def model() -> Dict[str, Any]:
        spec_path = os.path.join(work, "model-spec.json")
        done = os.path.join(work, "model-done")
        for p in (spec_path, done):
            if os.path.exists(p):
                os.unlink(p)
        layers = max(1, (args.model_mib << 20) // (4096 * 4096 * 2))
        owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import json, os, time, torch, vmmd.torch
            t = time.perf_counter()
            pool = vmmd.torch.mem_pool()
            torch.manual_seed(0)
            with torch.cuda.use_mem_pool(pool):
                model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, dtype=torch.float16) for _ in range({layers})]).cuda()
            torch.cuda.synchronize()
            placed = time.perf_counter() - t
            state = model.state_dict()
            spec = vmmd.torch.export_tensors(state)
            sums = {{n: float(v.double().sum()) for n, v in state.items()}}
            json.dump({{"spec": spec, "sums": sums, "place_s": placed, "bytes": sum(v.numel() * v.element_size() for v in state.values())}}, open({spec_path!r} + ".tmp", "w"))
            os.replace({spec_path!r} + ".tmp", {spec_path!r})
            while not os.path.exists({done!r}):
                time.sleep(0.05)
        """)], stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 300
            while not os.path.exists(spec_path):
                if owner.poll() is not None:
                    raise RuntimeError(f"the model owner failed: {owner.stderr.read()[-3000:]}")  # type: ignore[union-attr]
                if time.monotonic() > deadline:
                    raise RuntimeError("the model owner did not export within 300 s")
                time.sleep(0.1)
            shared = json.load(open(spec_path))
            result = run_openers(args.openers, "model", spec_path, work)
        finally:
            open(done, "w").close()
            owner.wait(60)
        processes = result["processes"]
        bad = [p["pid"] for p in processes if p["sums"] != shared["sums"]]
        return {
            "model_bytes": shared["bytes"], "place_s": round(shared["place_s"], 2), "checksums_ok": not bad, "bad_pids": bad,
            "open_ms": spread([p["open_ms"] for p in processes]), "context_s": spread([p["context_s"] for p in processes]),
            "gpu_used_mib_all_open": result["gpu_used_mib_all_open"], "gpu_used_mib_before": result["gpu_used_mib_before"],
        }

    phase("torch-mempool-model", model)

    def copy() -> Dict[str, Any]:
        free = int(subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"], capture_output=True, text=True).stdout.split()[0])
        needed = args.openers * ((size >> 20) + 1024)
        if free < needed:
            raise RuntimeError(f"the copy baseline needs about {needed} MiB free, {free} MiB are: run with fewer --openers or a smaller --gib")
        result = run_openers(args.openers, "copy", path, work)
        processes = result["processes"]
        return {
            "checksums_ok": all(p["sums"]["all"] == expected.get("all") for p in processes),
            "copy_ms": spread([p["open_ms"] for p in processes]), "context_s": spread([p["context_s"] for p in processes]),
            "gpu_used_mib_all_open": result["gpu_used_mib_all_open"], "gpu_growth_mib_with_all_open": result["gpu_used_mib_all_open"] - result["gpu_used_mib_before"],
        }

    phase("copy-baseline", copy)
    try:
        os.unlink(path)
    except OSError:
        pass
    json.dump(report, open(os.path.join(args.out, "shared-weights.json"), "w"), indent=1)
    log(f"errors: {report['errors'] or 'none'}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
