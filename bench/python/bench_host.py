"""The Python client's own costs on whatever backend the daemon runs (the
host backend here, in CI's kind of machine): session ping, pool
allocate+free, cold 2 MiB allocations (session socket + map + release),
staged and streamed reads and writes. Writes OUT.json.

    VMMD_SOCKET_DIR=... python3 bench_host.py OUT.json"""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Dict, List

import vmmd
from vmmd.pool import DevicePool


def percentiles(samples: List[float]) -> Dict[str, float]:
    samples = sorted(samples)
    return {"p50_us": round(samples[len(samples) // 2], 2), "p99_us": round(samples[len(samples) * 99 // 100], 2)}


def timed(body: Callable[[], Any], count: int) -> Dict[str, float]:
    samples = []
    for _ in range(count):
        start = time.perf_counter_ns()
        body()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return percentiles(samples)


def main() -> int:
    result: Dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": sys.version.split()[0]}
    with vmmd.connect() as client:
        result["backend"] = client.backend
        result["session_ping"] = timed(client.session.ping, 2000)
        result["get_stats_rpc"] = timed(client.admin.get_stats, 1000)
        pool = DevicePool(client)
        for size in (256, 64 << 10, 1 << 20):
            pool.free(pool.allocate(size))
            result[f"pool_allocate_free_{size}"] = timed(lambda: pool.free(pool.allocate(size)), 20000)  # noqa: B023

        def cold() -> None:
            memory = client.vmm.allocate(2 << 20)
            memory.close()
            client.vmm.release(allocation_id=memory.allocation_id)

        cold()
        result["cold_2mib_allocate_map_release"] = timed(cold, 300)
        memory = client.vmm.allocate(64 << 20)
        reservation = client.vmm.reserve(size=64 << 20)
        client.vmm.map(address=reservation.address, size=64 << 20, allocation_id=memory.allocation_id)
        client.vmm.set_access(address=reservation.address, size=64 << 20, descriptors=[{"location": {"type": "LOCATION_TYPE_DEVICE"}, "flags": "ACCESS_FLAGS_READWRITE"}])
        data = bytearray(64 << 20)
        for name, call in (
            ("write_staged_64mib", lambda: client.vmm.write(reservation.address, data)),
            ("read_staged_64mib", lambda: client.vmm.read(reservation.address, 64 << 20)),
            ("read_into_staged_64mib", lambda: client.vmm.read_into(reservation.address, data)),
        ):
            call()
            start = time.perf_counter()
            for _ in range(5):
                call()
            result[name] = {"gb_per_s": round(5 * (64 << 20) / (time.perf_counter() - start) / 1e9, 2)}
    with vmmd.connect(staging_bytes=0) as streamed:
        memory = streamed.vmm.allocate(64 << 20)
        reservation = streamed.vmm.reserve(size=64 << 20)
        streamed.vmm.map(address=reservation.address, size=64 << 20, allocation_id=memory.allocation_id)
        streamed.vmm.set_access(address=reservation.address, size=64 << 20, descriptors=[{"location": {"type": "LOCATION_TYPE_DEVICE"}, "flags": "ACCESS_FLAGS_READWRITE"}])
        start = time.perf_counter()
        streamed.vmm.read(reservation.address, 64 << 20)
        result["read_streamed_grpc_64mib"] = {"gb_per_s": round((64 << 20) / (time.perf_counter() - start) / 1e9, 2)}
    json.dump(result, open(sys.argv[1], "w"), indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
