"""Sleep and wake on the cuda backend (scripts/gpu-python.sh's sleep-bench step):
  offload     DevicePool.sleep("offload") and wake() of GIB GiB of weights (1 GiB
              blocks): a first cycle with the host copies made at sleep, a next one
              with them retained, and a first cycle of a pool with prepare_copies
              (copies made ahead while awake; how long that took in the background),
              each direction against a pinned cuMemcpy of the same bytes
              (one 1 GiB pinned buffer per block, copied back to back) and against
              vLLM-style sleep (per allocation: a synchronous pinned copy, then
              unmap and release, one at a time), all in this run
  discard     sleep("discard") of DISCARD_GIB GiB and its wake
  store       wake of a GIB GiB read-only store attached to a pool (no copy)
  host costs  where a first offload's time goes before its copy: the daemon making
              GIB GiB of host memory, and that plus mapping it here
Writes OUT.json; ratios are vmmd's bandwidth over the pinned copy's.

    python3 sleep_bench.py OUT.json [--gib 16] [--discard-gib 64]"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any, Dict, List

import vmmd
from vmmd import _cuda
from vmmd.pool import DevicePool

GiB = 1 << 30


def _pinned_copies(cu: Any, blocks: List[Any]) -> Dict[str, float]:
    """Seconds of a pinned cuMemcpy of every block, device to host then back, one after another."""
    hosts = []
    for block in blocks:
        result, host = cu.cuMemHostAlloc(block.size, 0)
        _cuda.check(result, "cuMemHostAlloc")
        hosts.append(host)
    try:
        timings = {}
        for direction in ("dtoh", "htod"):
            _cuda.synchronize(0)
            start = time.perf_counter()
            for block, host in zip(blocks, hosts):
                if direction == "dtoh":
                    (result,) = cu.cuMemcpyDtoH(host, block.address, block.size)
                else:
                    (result,) = cu.cuMemcpyHtoD(block.address, host, block.size)
                _cuda.check(result, "cuMemcpy")
            _cuda.synchronize(0)
            timings[direction] = time.perf_counter() - start
        return timings
    finally:
        for host in hosts:
            cu.cuMemFreeHost(host)


def _vllm_style(cu: Any, client: Any, gib: int) -> Dict[str, float]:
    """vLLM's CuMemAllocator sleep and wake: per allocation a pinned copy, unmap and
    release; at wake create, map, set access and copy back, one at a time."""
    memories = [client.vmm.allocate(GiB) for _ in range(gib)]
    hosts = []
    for memory in memories:
        result, host = cu.cuMemHostAlloc(GiB, 0)
        _cuda.check(result, "cuMemHostAlloc")
        hosts.append(host)
    start = time.perf_counter()
    for memory, host in zip(memories, hosts):
        allocation = memory.allocation_id
        (result,) = cu.cuMemcpyDtoH(host, memory.address, GiB)
        _cuda.check(result, "cuMemcpyDtoH")
        memory.suspend()
        client.vmm.release(allocation_id=allocation)
    sleep_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for memory, host in zip(memories, hosts):
        ((allocation, fd),) = client.vmm.allocate_for_wake([(GiB, None)])
        memory.resume(allocation, fd)
        (result,) = cu.cuMemcpyHtoD(memory.address, host, GiB)
        _cuda.check(result, "cuMemcpyHtoD")
    wake_seconds = time.perf_counter() - start
    for memory, host in zip(memories, hosts):
        allocation = memory.allocation_id
        memory.close()
        client.vmm.release(allocation_id=allocation)
        cu.cuMemFreeHost(host)
    return {"sleep_s": sleep_seconds, "wake_s": wake_seconds}


def _host_memory_costs(client: Any, gib: int) -> Dict[str, float]:
    """Where a first offload's time goes before its copy: the daemon making GIB 1 GiB pieces of
    host memory (cuMemCreate at the host node: the kernel allocating, zeroing and pinning pages;
    exported, the descriptors received here), then this process mapping the same kind of memory
    for the device and the CPU (allocate with host access: the daemon's part and the mapping)."""
    import os

    location = {"type": "LOCATION_TYPE_HOST_NUMA", "id": 0}
    start = time.perf_counter()
    made = client.vmm.allocate_for_wake([(GiB, location)] * gib, timeout=120)
    create = time.perf_counter() - start
    for allocation, fd in made:
        os.close(fd)
    client.vmm.release_many([allocation for allocation, _ in made])
    start = time.perf_counter()
    mapped = [client.vmm.allocate(GiB, location=location, host_access=True) for _ in range(gib)]
    create_and_map = time.perf_counter() - start
    for memory in mapped:
        allocation = memory.allocation_id
        memory.close()
        client.vmm.release(allocation_id=allocation)
    return {"daemon_create_s": create, "create_and_map_s": create_and_map, "map_s": max(0.0, create_and_map - create)}


def _fill(cu: Any, blocks: List[Any]) -> None:
    """Block i holds the byte i + 1 throughout: what a wake must give back."""
    for index, block in enumerate(blocks):
        (code,) = cu.cuMemsetD8(block.address, index + 1, block.size)
        _cuda.check(code, "cuMemsetD8")


def _offload_cycle(pool: Any, blocks: List[Any], nbytes: int, pinned: Dict[str, float]) -> Dict[str, Any]:
    """One offload sleep and wake of `pool`, timed, checked and set against the pinned copies."""
    start = time.perf_counter()
    pool.sleep("offload")
    sleep_seconds = time.perf_counter() - start
    start = time.perf_counter()
    pool.wake()
    wake_seconds = time.perf_counter() - start
    intact = all(_cuda.copy_from_device(0, block.address + block.size - 4096, 4096) == bytes([index + 1]) * 4096 for index, block in enumerate(blocks))
    return {
        "sleep_s": sleep_seconds, "wake_s": wake_seconds, "intact": intact,
        "sleep_gbps": nbytes / sleep_seconds / 1e9, "wake_gbps": nbytes / wake_seconds / 1e9,
        "sleep_ratio": pinned["dtoh"] / sleep_seconds, "wake_ratio": pinned["htod"] / wake_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--gib", type=int, default=16)
    parser.add_argument("--discard-gib", type=int, default=64)
    args = parser.parse_args()
    cu = _cuda.driver()
    client = vmmd.connect()
    result: Dict[str, Any] = {"gib": args.gib, "discard_gib": args.discard_gib}

    pool = DevicePool(client, chunk_size=GiB, large_threshold=GiB // 2, idle_seconds=0, tag="weights", retain_copies=True)
    blocks = [pool.allocate(GiB) for _ in range(args.gib)]
    _fill(cu, blocks)
    pinned = _pinned_copies(cu, blocks)
    nbytes = args.gib * GiB
    # The first cycle makes (and pins) the host copies; the second reuses them (retain_copies).
    for cycle in ("first", "retained"):
        result[f"offload_{cycle}"] = _offload_cycle(pool, blocks, nbytes, pinned)
    result["pinned"] = {"dtoh_s": pinned["dtoh"], "htod_s": pinned["htod"], "dtoh_gbps": nbytes / pinned["dtoh"] / 1e9, "htod_gbps": nbytes / pinned["htod"] / 1e9}
    pool.close()

    # The same weights in a pool that makes its host copies ahead, while the engine would run.
    pool = DevicePool(client, chunk_size=GiB, large_threshold=GiB // 2, idle_seconds=0, tag="weights", prepare_copies=True)
    start = time.perf_counter()
    blocks = [pool.allocate(GiB) for _ in range(args.gib)]
    _fill(cu, blocks)
    while pool.stats()["prepare_pending"]:
        time.sleep(0.005)
    prepare_seconds = time.perf_counter() - start
    if pool.prepare_error is not None:
        raise pool.prepare_error
    result["offload_prepared_first"] = {"prepare_s": prepare_seconds, **_offload_cycle(pool, blocks, nbytes, pinned)}
    pool.close()
    result["vllm_style"] = _vllm_style(cu, client, args.gib)
    result["host_memory_costs"] = _host_memory_costs(client, args.gib)

    pool = DevicePool(client, chunk_size=4 * GiB, large_threshold=2 * GiB, idle_seconds=0, tag="kv_cache")
    blocks = [pool.allocate(4 * GiB) for _ in range(args.discard_gib // 4)]
    start = time.perf_counter()
    pool.sleep("discard")
    discard_seconds = time.perf_counter() - start
    start = time.perf_counter()
    pool.wake()
    result["discard"] = {"sleep_s": discard_seconds, "wake_s": time.perf_counter() - start}
    pool.close()

    memory = client.vmm.allocate(args.gib * GiB)
    store = client.stores.create_store(allocation_id=memory.allocation_id, name="sleep-bench-model", read_only=True, hand_over=True)
    memory.close()
    client.vmm.release(allocation_id=memory.allocation_id)
    opened = client.stores.open("sleep-bench-model")
    pool = DevicePool(client, idle_seconds=0, tag="model")
    pool.attach_store(opened)
    address = opened.memory.address
    start = time.perf_counter()
    pool.sleep("offload")
    sleep_seconds = time.perf_counter() - start
    start = time.perf_counter()
    pool.wake()
    result["store"] = {"sleep_s": sleep_seconds, "wake_s": time.perf_counter() - start, "same_address": opened.memory.address == address}
    opened.close()
    pool.close()
    client.stores.detach(int(store.id))
    client.close()
    with open(args.out, "w") as out:
        json.dump(result, out, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
