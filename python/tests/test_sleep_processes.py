"""Two processes that each need 60% of the daemon's memory, sleeping and
waking at once on the host backend: the daemon queues the wake that finds no
room until the other process sleeps, so neither sees out of memory, and the
offloaded contents are equal after every wake."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import Daemon

ENGINE = r'''
import ctypes, json, sys, vmmd
from vmmd.pool import DevicePool
client = vmmd.connect()
MiB = 1 << 20
# 60% of the daemon's 256 MiB: weights kept across sleeps, a cache dropped and refilled after each wake.
weights = DevicePool(client, chunk_size=8 * MiB, idle_seconds=0, tag="weights")
cache = DevicePool(client, chunk_size=32 * MiB, idle_seconds=0, tag="kv_cache")
w = weights.allocate(6 * MiB)
ctypes.memset(w.address, int(sys.argv[1]), w.size)
expected = ctypes.string_at(w.address, w.size)
blocks = [cache.allocate(30 * MiB) for _ in range(5)]
weights.sleep("offload")
cache.sleep("discard")
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
errors, bad, waits = [], 0, 0
for _ in range(int(sys.argv[2])):
    try:
        weights.wake(timeout=60)
        cache.wake(timeout=60)
        bad += ctypes.string_at(w.address, w.size) != expected
        for block in blocks:
            ctypes.memset(block.address, 7, MiB)  # mapped and writable
        weights.sleep("offload")
        cache.sleep("discard")
    except vmmd.VmmdError as error:
        errors.append(f"{error.code}: {error.message}")
        break
print(json.dumps({"errors": errors, "bad": bad}), flush=True)
'''


def test_two_processes_wake_at_once_without_out_of_memory(daemon: Daemon) -> None:
    engines = []
    try:
        # One after the other: each holds 60% until its first sleep.
        for fill in (0x31, 0x32):
            engines.append(subprocess.Popen([sys.executable, "-c", ENGINE, str(fill), "8"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=daemon.env(), text=True))
            assert engines[-1].stdout is not None and json.loads(engines[-1].stdout.readline())["ready"]
        for engine in engines:
            assert engine.stdin is not None
            engine.stdin.write("go\n")
            engine.stdin.flush()
        reports = [json.loads(engine.stdout.readline()) for engine in engines]  # type: ignore[union-attr]
    finally:
        for engine in engines:
            engine.kill()
            engine.wait(10)
    assert reports == [{"errors": [], "bad": 0}] * 2, reports
