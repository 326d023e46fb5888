"""Fork and dropped clients: a forked child starts clean (its own shared
client, made when first used; no lock a parent thread held; the parent's
session not kept alive by the child's copy of its socket), 200 forks with
threads running hang nowhere, and a client dropped without close() is
closed when it is collected."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import warnings
from typing import Any, Iterator

import pytest

import vmmd
from vmmd import client as client_module

from conftest import MiB, Daemon, eventually


@pytest.fixture
def shared_env(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("VMMD_SOCKET_DIR", daemon.dir)
    yield
    shared = client_module._shared
    if shared is not None and shared_pid_is_mine():
        shared.close()
    client_module._shared = None


def shared_pid_is_mine() -> bool:
    return client_module._shared_pid == os.getpid()


def in_child(body: Any) -> Any:
    """Runs body() in a forked child; its JSON result (or {"error": ...})."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads running is the case under test
        child = os.fork()
    if child == 0:
        try:
            os.close(read)
            try:
                out = {"value": body()}
            except BaseException as error:  # noqa: BLE001 - reported to the parent
                out = {"error": repr(error)}
            os.write(write, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    while True:
        chunk = os.read(read, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    os.waitpid(child, 0)
    return json.loads(b"".join(chunks) or b'{"error": "the child said nothing"}')


def test_a_forked_child_gets_a_shared_client_of_its_own(shared_env: None) -> None:
    parent = vmmd.shared_client()

    def child() -> Any:
        mine = vmmd.shared_client()
        memory = mine.vmm.allocate(2 * MiB)
        memory.write(0, b"child")
        return {"same": mine is parent, "session": mine.session.id, "read": memory.read(0, 5).decode()}

    out = in_child(child)
    assert "error" not in out, out["error"]
    assert out["value"]["same"] is False and out["value"]["session"] != parent.session.id
    assert out["value"]["read"] == "child"
    assert vmmd.shared_client() is parent  # the parent's stays its own
    parent.session.ping(timeout=5)


LINGERING_CHILD = r'''
import json, os, sys, time, vmmd
client = vmmd.connect()
memory = client.vmm.allocate(2 << 20)
child = os.fork()
if child == 0:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)  # (the test reads its parent's output to its end)
    time.sleep(60)
    os._exit(0)
print(json.dumps({"session": client.session.id, "child": child}), flush=True)
os._exit(0)  # the parent exits without close(): only its process ending closes its socket
'''


def test_a_forked_child_does_not_keep_its_parents_session_alive(daemon: Daemon) -> None:
    done = subprocess.run([sys.executable, "-c", LINGERING_CHILD], env=daemon.env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    try:
        def gone() -> bool:
            return all(str(s.id) != out["session"] for s in daemon.connect_admin().list_sessions().sessions)

        eventually(gone, timeout=10, what="the parent's session to end while its forked child lives")
    finally:
        try:
            os.kill(out["child"], 9)
        except ProcessLookupError:
            pass


FORKS = r'''
import json, os, sys, threading, time, warnings
import vmmd
warnings.simplefilter("ignore", DeprecationWarning)
MiB = 1 << 20
client = vmmd.connect()
stop = threading.Event()
def worker():
    while not stop.is_set():
        memory = client.vmm.allocate(2 * MiB)
        client.vmm.release(allocation_id=memory.allocation_id)
        memory.close()
        client.session.ping(timeout=5)
workers = [threading.Thread(target=worker, daemon=True) for _ in range(3)]
for thread in workers:
    thread.start()
hangs, failures = 0, []
for index in range(int(sys.argv[1])):
    child = os.fork()
    if child == 0:
        code = 1
        try:
            client.close()  # the parent's: this process's copy only
            mine = vmmd.connect()
            memory = mine.vmm.allocate(2 * MiB)
            mine.vmm.release(allocation_id=memory.allocation_id)
            memory.close()
            mine.close()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while True:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
                failures.append(index)
            break
        if time.monotonic() > deadline:
            hangs += 1
            os.kill(child, 9)
            os.waitpid(child, 0)
            break
        time.sleep(0.002)
stop.set()
for thread in workers:
    thread.join(10)
client.session.ping(timeout=5)
print(json.dumps({"hangs": hangs, "failures": failures, "workers_alive": sum(t.is_alive() for t in workers)}), flush=True)
'''


def test_forks_with_threads_running_hang_nowhere_and_each_child_connects(daemon: Daemon) -> None:
    count = int(os.environ.get("VMMD_FORKS", "200"))
    done = subprocess.run([sys.executable, "-c", FORKS, str(count)], env=daemon.env(), capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, f"{done.returncode}: {done.stdout[-2000:]} {done.stderr[-3000:]}"
    out = json.loads(lines[-1])
    print("forks:", count, out)
    assert out == {"hangs": 0, "failures": [], "workers_alive": 0}


def session_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name.startswith("vmmd-session-"))


def test_a_dropped_client_is_closed_when_collected(daemon: Daemon) -> None:
    gc.collect()
    sessions, threads = daemon.stats().sessions, session_threads()
    for _ in range(20):
        client = daemon.connect()
        client.vmm.allocate(2 * MiB)
    del client
    gc.collect()
    eventually(lambda: daemon.stats().sessions == sessions and daemon.stats().allocations == 0, what="the dropped clients' sessions to end")
    eventually(lambda: session_threads() == threads, what="the dropped clients' reader threads to end")
