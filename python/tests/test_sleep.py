"""Sleep and wake of a pool on the host backend: every address kept, offloaded
contents back, discarded memory given back, stores mapped again without a
copy, a wake without room leaves the pool asleep and intact, a process killed
while asleep leaves nothing in the daemon, tags are independent."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

import pytest

import vmmd
from vmmd.pool import DevicePool, pools

from conftest import MiB, Daemon, eventually


def _fill(pool: DevicePool, sizes: list) -> list:
    """Blocks of `sizes`, each filled with its own pattern."""
    blocks = []
    for index, size in enumerate(sizes):
        block = pool.allocate(size)
        ctypes.memset(block.address, 0x10 + index, size)
        blocks.append(block)
    return blocks


def _intact(blocks: list) -> bool:
    return all(ctypes.string_at(block.address, block.size) == bytes([0x10 + index]) * block.size for index, block in enumerate(blocks))


def test_offload_keeps_every_address_and_byte(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    pool = DevicePool(client, chunk_size=4 * MiB, large_threshold=2 * MiB, idle_seconds=0)
    blocks = _fill(pool, [1000, 300 * 1024, 3 * MiB, 5 * MiB + 17])
    addresses = [block.address for block in blocks]
    ids = {block.allocation_id for block in blocks}
    held = sum({b.chunk.base: b.chunk.size for b in blocks}.values())
    assert pool.sleep("offload") == held == 4 * MiB + 4 * MiB + 6 * MiB
    assert pool.asleep and all(chunk.memory.asleep for chunk in [b.chunk for b in blocks])
    # The pool's own allocations are gone from the daemon; the copies are the session's host memory.
    for allocation in ids:
        with pytest.raises(vmmd.VmmdError) as raised:
            client.vmm.get_properties(allocation_id=allocation)
        assert raised.value.status_name == "NOT_FOUND"
    assert pool.wake() == held and not pool.asleep
    assert [block.address for block in blocks] == addresses
    assert _intact(blocks)
    assert {block.allocation_id for block in blocks}.isdisjoint(ids)  # new memory, same addresses
    # Blocks work as before: freed, reused, trimmed.
    for block in blocks:
        pool.free(block)
    assert pool.trim() == held
    pool.close()


def test_discard_gives_the_memory_back_and_wakes_writable(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    before = daemon.stats().allocated_bytes
    pool = DevicePool(client, chunk_size=8 * MiB, idle_seconds=0)
    blocks = _fill(pool, [MiB, 2 * MiB])
    assert daemon.stats().allocated_bytes == before + 8 * MiB
    pool.sleep("discard")
    assert daemon.stats().allocated_bytes == before  # nothing kept: no copy either
    with pytest.raises(vmmd.VmmdError) as raised:
        pool.allocate(256)
    assert (raised.value.code, raised.value.status_name) == ("ASLEEP", "FAILED_PRECONDITION")
    with pytest.raises(vmmd.VmmdError) as raised:
        blocks[0].chunk.memory.read(0, 1)
    assert raised.value.code == "ASLEEP"
    pool.wake()
    assert daemon.stats().allocated_bytes == before + 8 * MiB
    assert _fill(pool, [4096])[0].address not in [b.address for b in blocks]
    ctypes.memset(blocks[1].address, 0x77, blocks[1].size)
    assert ctypes.string_at(blocks[1].address, 4) == b"\x77" * 4
    pool.close()
    assert daemon.stats().allocated_bytes == before


def test_bad_calls_change_nothing(client: vmmd.VmmdClient) -> None:
    pool = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0)
    blocks = _fill(pool, [4096])
    with pytest.raises(vmmd.VmmdError) as raised:
        pool.sleep("hibernate")
    assert (raised.value.code, raised.value.status_name) == ("BAD_SLEEP_MODE", "INVALID_ARGUMENT") and "hibernate" in raised.value.message
    assert not pool.asleep and _intact(blocks)
    with pytest.raises(vmmd.VmmdError) as raised:
        DevicePool(client, tag="")
    assert raised.value.code == "BAD_TAG"
    assert pool.wake() == 0  # awake: nothing to do
    pool.sleep("offload")
    with pytest.raises(vmmd.VmmdError) as raised:
        pool.sleep("offload")
    assert raised.value.code == "ASLEEP" and pool.asleep
    for bad in (-1, 601):
        with pytest.raises(vmmd.VmmdError) as raised:
            pool.wake(timeout=bad)
        assert (raised.value.code, raised.value.status_name) == ("BAD_TIMEOUT", "INVALID_ARGUMENT") and str(bad) in raised.value.message and pool.asleep
    # A free while asleep is bookkeeping; the next trim gives the emptied chunk back without waking it.
    pool.free(blocks[0])
    assert pool.trim() == 4 * MiB
    assert pool.wake() == 0 and pool.trim() == 0
    pool.close()


def test_a_store_is_mapped_again_without_a_copy(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    data = os.urandom(3 * 4096 + 5)
    store = client.stores.attach_bytes(data, name="sleep-weights", read_only=True)
    opened = client.stores.open("sleep-weights")
    pool = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0, tag="weights")
    pool.attach_store(opened)
    address = opened.memory.address
    before = daemon.stats().allocated_bytes
    pool.sleep("offload")
    assert opened.memory.asleep
    # No copy of the store was made, and the store stays with the daemon.
    assert daemon.stats().allocated_bytes == before
    assert any(int(s.id) == int(store.id) for s in client.stores.list())
    pool.wake()
    assert opened.memory.address == address and ctypes.string_at(address, len(data)) == data
    assert daemon.stats().allocated_bytes == before
    opened.close()
    pool.close()
    client.stores.detach("sleep-weights")


def test_a_wake_without_room_leaves_the_pool_asleep_and_intact(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    pool = DevicePool(client, chunk_size=32 * MiB, idle_seconds=0, tag="engine")
    blocks = _fill(pool, [20 * MiB, 10 * MiB])
    pool.sleep("offload")
    # Another process takes the room the pool gave back.
    other = daemon.connect()
    free = int(other.devices.get_memory_info(device=0).free_bytes)
    hog = other.vmm.allocate(free - free % (2 * MiB))
    with pytest.raises(vmmd.VmmdError) as raised:
        pool.wake(timeout=1)
    assert raised.value.out_of_memory and "OUT_OF_MEMORY" in raised.value.code
    assert pool.asleep and all(b.chunk.memory.asleep for b in blocks)
    hog.close()
    other.vmm.release(allocation_id=hog.allocation_id)
    other.close()
    pool.wake()
    assert _intact(blocks)
    pool.close()


def test_tags_sleep_and_wake_independently(client: vmmd.VmmdClient) -> None:
    weights = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0, tag="weights")
    cache = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0, tag="kv_cache")
    w, c = _fill(weights, [1 << 16]), _fill(cache, [1 << 16])
    assert pools("weights") == [weights] and set(pools()) >= {weights, cache}
    cache.sleep("discard")
    assert not weights.asleep and _intact(w)
    more = weights.allocate(4096)
    weights.free(more)
    weights.sleep("offload")
    cache.wake()
    assert weights.asleep and not cache.asleep
    weights.wake()
    assert _intact(w) and c[0].address == c[0].chunk.base
    weights.close()
    cache.close()
    assert pools("weights") == []


def test_closing_an_asleep_pool_gives_everything_back(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    before = daemon.stats().allocated_bytes
    pool = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0)
    _fill(pool, [MiB])
    pool.sleep("offload")
    assert daemon.stats().allocated_bytes == before + 4 * MiB  # the copy
    pool.close()
    assert daemon.stats().allocated_bytes == before


def test_a_process_killed_while_asleep_leaves_nothing(daemon: Daemon) -> None:
    # The previous test's client may still be closing: its session and memory would count in `before`.
    eventually(lambda: daemon.stats().sessions == 0, what="the previous tests' sessions to close")
    before = daemon.stats()
    script = (
        "import ctypes, sys, vmmd\n"
        "from vmmd.pool import DevicePool\n"
        "pool = DevicePool(vmmd.connect(), chunk_size=8 << 20, idle_seconds=0)\n"
        "block = pool.allocate(6 << 20)\n"
        "ctypes.memset(block.address, 1, block.size)\n"
        "pool.sleep('offload')\n"
        "print('asleep', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=daemon.env(), text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "asleep"
    assert daemon.stats().allocated_bytes > before.allocated_bytes
    os.kill(child.pid, signal.SIGKILL)
    child.wait(10)
    eventually(lambda: daemon.stats().allocated_bytes == before.allocated_bytes and daemon.stats().sessions == before.sessions, what="the killed session's memory released")


def test_retained_copies_serve_the_next_sleep(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    eventually(lambda: daemon.stats().sessions == 1, what="the previous tests' sessions to close")
    before = daemon.stats().allocated_bytes
    pool = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0, retain_copies=True)
    block = pool.allocate(MiB)
    ctypes.memset(block.address, 0xA1, MiB)
    pool.sleep("offload")
    pool.wake()
    assert daemon.stats().allocated_bytes == before + 8 * MiB  # the chunk and its copy, kept
    ctypes.memset(block.address, 0xB2, MiB)  # changed while awake: the next sleep copies it again
    pool.sleep("offload")
    assert daemon.stats().allocated_bytes == before + 4 * MiB  # no new copy
    pool.wake()
    assert ctypes.string_at(block.address, MiB) == b"\xb2" * MiB
    pool.sleep("discard")  # a discard has no use for the copy
    assert daemon.stats().allocated_bytes == before
    pool.wake()
    pool.sleep("offload")
    pool.wake()
    pool.close()
    assert daemon.stats().allocated_bytes == before


def _hog(daemon: Daemon, leave: int) -> tuple:
    """Another session holding all the room but `leave` bytes."""
    other = daemon.connect()
    free = int(other.devices.get_memory_info(device=0).free_bytes) - leave
    return other, other.vmm.allocate(free - free % (2 * MiB))


def _unhog(other: vmmd.VmmdClient, hog: object) -> None:
    hog.close()  # type: ignore[attr-defined]
    other.vmm.release(allocation_id=hog.allocation_id)  # type: ignore[attr-defined]
    other.close()


def test_prepared_copies_are_made_ahead_and_serve_the_first_sleep(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    eventually(lambda: daemon.stats().sessions == 1, what="the previous tests' sessions to close")
    before = daemon.stats().allocated_bytes
    pool = DevicePool(client, chunk_size=32 * MiB, idle_seconds=0, prepare_copies=True)
    blocks = _fill(pool, [12 * MiB])
    eventually(lambda: pool.stats()["prepared_bytes"] == 32 * MiB, what="the copy made ahead")
    assert daemon.stats().allocated_bytes == before + 64 * MiB  # the chunk and its copy, charged while awake
    # No room left anywhere: a sleep that had to make its copy now could not.
    other, hog = _hog(daemon, 0)
    for _ in range(2):
        pool.sleep("offload")
        assert pool.stats()["prepared_bytes"] == 0 and pool.asleep
        pool.wake()
        assert _intact(blocks)
        assert pool.stats()["prepared_bytes"] == 32 * MiB
    assert pool.prepare_error is None
    _unhog(other, hog)
    pool.close()
    assert daemon.stats().allocated_bytes == before


def test_a_sleep_that_meets_the_copy_being_made_waits_for_it(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    eventually(lambda: daemon.stats().sessions == 1, what="the previous tests' sessions to close")
    before = daemon.stats().allocated_bytes
    # Room for the chunks and one copy each: a second copy, by the sleep or by the preparation, is refused.
    other, hog = _hog(daemon, 64 * MiB)
    pool = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0, prepare_copies=True)
    # Copies are made one at a time: asleep at once, the last chunks' copies are still being made.
    blocks = [pool.allocate(3 * MiB) for _ in range(8)]
    pool.sleep("offload")
    assert pool.prepare_error is None
    assert daemon.stats().allocated_bytes == before + 32 * MiB + hog.size
    pool.wake()
    assert [b.chunk.memory.asleep for b in blocks] == [False] * 8
    pool.close()
    _unhog(other, hog)
    assert daemon.stats().allocated_bytes == before


def test_a_refused_preparation_leaves_the_copy_to_the_sleep(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    eventually(lambda: daemon.stats().sessions == 1, what="the previous tests' sessions to close")
    other, hog = _hog(daemon, 32 * MiB)
    pool = DevicePool(client, chunk_size=32 * MiB, idle_seconds=0, prepare_copies=True)
    blocks = _fill(pool, [32 * MiB])
    eventually(lambda: pool.stats()["prepare_pending"] == 0, what="the preparation to end")
    error = pool.prepare_error
    assert isinstance(error, vmmd.VmmdError) and error.out_of_memory
    assert pool.stats()["prepared_bytes"] == 0
    _unhog(other, hog)
    pool.sleep("offload")
    pool.wake()
    assert _intact(blocks)
    assert pool.stats()["prepared_bytes"] == 32 * MiB  # kept for the next sleep
    pool.close()


def test_a_chunk_given_back_takes_its_copy_with_it_even_while_being_made(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    eventually(lambda: daemon.stats().sessions == 1, what="the previous tests' sessions to close")
    before = daemon.stats().allocated_bytes
    pool = DevicePool(client, chunk_size=8 * MiB, idle_seconds=0, prepare_copies=True)
    for _ in range(3):
        block = pool.allocate(MiB)
        pool.free(block)
        assert pool.trim() == 8 * MiB
    assert daemon.stats().allocated_bytes == before
    blocks = _fill(pool, [MiB])
    pool.sleep("discard")  # nothing kept while asleep: the copy goes too
    assert daemon.stats().allocated_bytes == before
    pool.wake()
    eventually(lambda: pool.stats()["prepared_bytes"] == 8 * MiB, what="the copy made again after wake")
    pool.free(blocks[0])
    pool.close()
    assert daemon.stats().allocated_bytes == before


def test_the_numba_pools_prepare_switch_is_1_or_0(monkeypatch: pytest.MonkeyPatch) -> None:
    from vmmd._values import switch_setting

    monkeypatch.delenv("VMMD_NUMBA_PREPARE_COPIES", raising=False)
    assert switch_setting("VMMD_NUMBA_PREPARE_COPIES", False, "copies made ahead") is False
    monkeypatch.setenv("VMMD_NUMBA_PREPARE_COPIES", "1")
    assert switch_setting("VMMD_NUMBA_PREPARE_COPIES", False, "copies made ahead") is True
    monkeypatch.setenv("VMMD_NUMBA_PREPARE_COPIES", "yes")
    with pytest.raises(vmmd.VmmdError) as raised:
        switch_setting("VMMD_NUMBA_PREPARE_COPIES", False, "copies made ahead")
    assert (raised.value.code, raised.value.status_name) == ("BAD_CONFIG", "INVALID_ARGUMENT") and "VMMD_NUMBA_PREPARE_COPIES='yes'" in raised.value.message


def test_memory_freed_while_asleep_goes_at_the_next_trim_without_waking(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    from test_torch_allocator import session_bytes

    pool = DevicePool(client, chunk_size=4 * MiB, large_threshold=2 * MiB, idle_seconds=0)
    small, large, kept = _fill(pool, [MiB, 6 * MiB, 4 * MiB])
    assert pool.sleep("offload") == 4 * MiB + 6 * MiB + 4 * MiB
    pool.free(large)
    pool.free(small)
    # What was freed goes now: its offloaded copy released, its range freed, nothing woken; the rest stays asleep.
    assert pool.trim() == 4 * MiB + 6 * MiB
    answer = {"session": session_bytes(client), "asleep": pool.asleep, "stats": pool.stats()}
    assert answer["session"] == 4 * MiB and answer["asleep"], answer
    assert pool.wake() == 4 * MiB and ctypes.string_at(kept.address, kept.size) == b"\x12" * kept.size
    assert session_bytes(client) == 4 * MiB
    pool.close()
