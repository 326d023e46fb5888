"""The client-side pool on the host backend: size classes, carving, coalescing,
large allocations, giving chunks back, and frees from finalizers."""
from __future__ import annotations

import random

import pytest

import vmmd
from vmmd.pool import DevicePool, size_class

from conftest import MiB, Daemon


def test_size_classes_lose_at_most_a_quarter() -> None:
    assert [size_class(n) for n in (1, 256, 257, 1000, 1024, 1025, 3 << 20)] == [256, 256, 512, 1024, 1024, 1280, 3 << 20]
    for size in random.Random(1).sample(range(1, 1 << 26), 2000):
        rounded = size_class(size)
        assert rounded >= size and rounded % 256 == 0 and (rounded - size) <= max(256, size // 4)


def test_blocks_are_carved_from_one_chunk_and_coalesce(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    pool = DevicePool(client, chunk_size=4 * MiB, large_threshold=2 * MiB)
    before = daemon.stats().allocations
    blocks = [pool.allocate(1000 + i) for i in range(100)]
    assert daemon.stats().allocations == before + 1  # one chunk leased
    spans = sorted((b.address, b.address + b.rounded) for b in blocks)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "blocks overlap"
    assert all(b.address % 256 == 0 for b in blocks)
    # The memory is real and shared with the daemon: write through one block, read via the chunk.
    chunk = blocks[7].chunk
    chunk.memory.write(blocks[7].offset, b"block seven")
    assert client.vmm.import_(blocks[7].allocation_id).read(blocks[7].offset, 11) == b"block seven"
    for block in blocks[::2] + blocks[1::2]:
        pool.free(block)
    chunk.check()
    assert chunk.free == [[0, chunk.size]] and pool.stats()["blocks"] == 0
    with pytest.raises(vmmd.VmmdError) as raised:
        pool.free(blocks[0])
        pool.allocate(256)
    assert raised.value.code == "DOUBLE_FREE"


def test_large_requests_get_an_allocation_of_their_own(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    pool = DevicePool(client, chunk_size=4 * MiB, large_threshold=2 * MiB)
    before = daemon.stats().allocations
    big = pool.allocate(5 * MiB)
    assert big.large and big.chunk.size == 6 * MiB and daemon.stats().allocations == before + 1
    assert pool.lookup(big.address + 100) == (big.chunk, 100)
    pool.free(big)
    assert pool.stats()["idle_large_bytes"] == 6 * MiB  # kept for reuse (a free may run in a finalizer)
    again = pool.allocate(5 * MiB + 1)
    assert again.address == big.address and pool.counters["large_reused"] == 1
    pool.free(again)
    assert pool.trim() == 6 * MiB and daemon.stats().allocations == before


def test_empty_chunks_go_back_on_trim_and_out_of_memory_trims_first(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    pool = DevicePool(client, chunk_size=64 * MiB, large_threshold=64 * MiB)
    blocks = [pool.allocate(60 * MiB) for _ in range(3)]
    assert pool.stats()["chunks"] == 3
    for block in blocks:
        pool.free(block)
    # 3 x 64 MiB cached of 256 MiB: a 100 MiB large request fails until the cache is given back.
    big = pool.allocate(100 * MiB)
    assert pool.counters["out_of_memory_retries"] == 1 and pool.stats()["chunks"] == 0
    pool.free(big)
    pool.allocate(1024)
    assert pool.trim() == 100 * MiB  # the idle large allocation goes back; the chunk in use stays
    pool.close()
    assert daemon.stats().allocated_bytes == 0 or all(o.owner_session != int(client.session.id) for o in client.admin.list_objects().objects)


def test_frees_from_finalizers_never_block_and_are_applied_later(client: vmmd.VmmdClient) -> None:
    pool = DevicePool(client, chunk_size=4 * MiB)
    block = pool.allocate(4096)
    with pool._lock:  # as if a finalizer ran inside the pool on this thread
        pool.free(block)
        assert pool.stats.__self__._returned  # queued, not applied
    assert pool.stats()["pending_frees"] == 1
    again = pool.allocate(4096)  # applies the queued free first, then reuses the space
    assert again.address == block.address and pool.stats()["pending_frees"] == 0


def test_zero_and_bad_sizes_are_refused(client: vmmd.VmmdClient) -> None:
    pool = DevicePool(client)
    for size in (0, -5, 1.5):
        with pytest.raises(vmmd.VmmdError) as raised:
            pool.allocate(size)  # type: ignore[arg-type]
        assert (raised.value.code, raised.value.status_name) == ("ZERO_SIZE", "INVALID_ARGUMENT")


def test_trim_and_close_send_every_release_before_waiting_for_any_answer(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    # One round trip for the lot, not one per chunk (frees need not wait one after another).
    pool = DevicePool(client, chunk_size=4 * MiB, large_threshold=64 * MiB)
    blocks = [pool.allocate(3 * MiB) for _ in range(4)]
    for block in blocks:
        pool.free(block)
    session = client.session
    events: list = []
    send, wait = session._send, session._await
    session._send = lambda message, *rest, **options: (events.append(("send", message.WhichOneof("body"))), send(message, *rest, **options))[1]  # type: ignore[method-assign]
    session._await = lambda *args, **kwargs: (events.append(("wait", None)), wait(*args, **kwargs))[1]  # type: ignore[method-assign]
    try:
        before = daemon.stats().allocations
        assert pool.trim() == 16 * MiB
    finally:
        session._send, session._await = send, wait  # type: ignore[method-assign]
    assert events == [("send", "release")] * 4 + [("wait", None)] * 4
    assert daemon.stats().allocations == before - 4
    kept = pool.allocate(3 * MiB)
    pool.close()
    assert kept.address and all(o.owner_session != int(client.session.id) for o in client.admin.list_objects().objects if o.kind == "allocation")


def test_a_release_refused_among_many_is_raised_after_the_others_are_answered(daemon: Daemon, client: vmmd.VmmdClient) -> None:
    made = [client.vmm.allocate(size=2 * MiB) for _ in range(3)]
    ids = [int(memory.allocation_id) for memory in made]
    for memory in made:
        memory.close()
    client.vmm.release(allocation_id=ids[1])
    results = client.session.release_many(ids)
    assert [not isinstance(result, vmmd.VmmdError) for result in results] == [True, False, True]
    assert (results[1].code, results[1].status_name) == ("UNKNOWN_ALLOCATION", "NOT_FOUND")  # type: ignore[union-attr]
    assert all(result.freed for result in (results[0], results[2]))  # type: ignore[index]
    with pytest.raises(vmmd.VmmdError) as raised:
        client.session.release_many([ids[0], 1 << 64])
    assert raised.value.code == "BAD_ID" and "18446744073709551616" in str(raised.value)


def _owned(client: vmmd.VmmdClient) -> int:
    session = int(client.session.id)
    return sum(1 for o in client.admin.list_objects().objects if o.kind == "allocation" and o.owner_session == session)


def test_a_chunk_that_cannot_unmap_stays_and_the_others_still_go_back(client: vmmd.VmmdClient) -> None:
    pool = DevicePool(client, chunk_size=4 * MiB, large_threshold=64 * MiB)
    blocks = [pool.allocate(3 * MiB) for _ in range(3)]
    assert _owned(client) == 3
    view = pool._chunks[-1].memory.buffer  # a live view: that chunk's mapping refuses to close (VIEWS_ALIVE)
    with pytest.raises(vmmd.VmmdError) as raised:
        pool.close()
    assert raised.value.code == "VIEWS_ALIVE"
    assert _owned(client) == 1
    del view, blocks


def test_release_many_checks_every_id_before_it_sends_any(client: vmmd.VmmdClient) -> None:
    memory = client.vmm.allocate(size=2 * MiB)
    ident = int(memory.allocation_id)
    memory.close()
    for release_many in (client.session.release_many, client.vmm.release_many):
        with pytest.raises(vmmd.VmmdError) as raised:
            release_many([ident, -1])  # type: ignore[operator]
        assert (raised.value.code, raised.value.status_name) == ("BAD_ID", "INVALID_ARGUMENT")
        assert "allocation -1 is not an integer in [0, 2^64)" in str(raised.value)
        assert _owned(client) == 1  # nothing sent
    # A numpy-style integer (anything with __index__) is an id too.
    class Index:
        def __index__(self) -> int:
            return ident

    assert client.vmm.release_many([Index()])[0].freed  # type: ignore[union-attr]
    assert _owned(client) == 0


def test_release_many_without_a_session_refuses_a_bad_id_too(daemon: Daemon) -> None:
    client = daemon.connect()
    try:
        client.session.close()
        with pytest.raises(vmmd.VmmdError) as raised:
            client.vmm.release_many([1 << 64])
        assert raised.value.code == "BAD_ID"
    finally:
        client.close()
