"""Tags and sleep in the C library behind the PyTorch MemPool and its chunk
supply, without PyTorch: a malloc carves only from chunks of its thread's
tag and never from a chunk asleep; a tag sleeps and wakes at the same
addresses with its contents (offload) while other tags go on."""
from __future__ import annotations

import ctypes
import threading
from typing import Any, List

import pytest

import vmmd
from vmmd._torch_chunks import ChunkSupply
from vmmd.pool import DevicePool

from conftest import MiB
from test_torch_allocator import BASE, STREAM_A, built, counters, library  # noqa: F401 - fixtures

WEIGHTS, CACHE = 1, 2


def test_a_malloc_carves_only_from_its_threads_tag(library: Any) -> None:  # noqa: F811
    assert library.vmmd_add_tagged_chunk(0, WEIGHTS, BASE, 4 * MiB) == 0
    assert library.vmmd_add_tagged_chunk(0, CACHE, BASE + 4 * MiB, 4 * MiB) == 0
    library.vmmd_configure(0.2, 0, 0.0)
    library.vmmd_set_tag(WEIGHTS)
    first = library.vmmd_torch_malloc(MiB, 0, STREAM_A)
    library.vmmd_set_tag(CACHE)
    second = library.vmmd_torch_malloc(MiB, 0, STREAM_A)
    assert first == BASE and second == BASE + 4 * MiB
    # Another thread has its own tag (0 here: no chunk of its own, so no memory).
    other: List[Any] = []
    thread = threading.Thread(target=lambda: other.append(library.vmmd_torch_malloc(MiB, 0, STREAM_A)))
    thread.start()
    thread.join(10)
    assert other == [None] and library.vmmd_get_tag() == CACHE
    # Asleep: no malloc carves from it, and it is never given back as empty.
    assert library.vmmd_set_asleep(CACHE, 1) == 4 * MiB
    assert library.vmmd_torch_malloc(MiB, 0, STREAM_A) is None
    library.vmmd_torch_free(second, MiB, 0, STREAM_A)
    device, base, size = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_uint64()
    assert library.vmmd_take_empty_chunk(0, ctypes.c_double(0), ctypes.byref(device), ctypes.byref(base), ctypes.byref(size)) == 0
    assert library.vmmd_set_asleep(CACHE, 0) == 4 * MiB
    assert library.vmmd_torch_malloc(MiB, 0, STREAM_A) == second  # awake again: its freed block is reused
    library.vmmd_set_tag(0)


def test_a_tag_sleeps_and_wakes_at_its_addresses(library: Any, client: vmmd.VmmdClient) -> None:  # noqa: F811
    pool = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0)
    supply = ChunkSupply(library, lambda device: pool, 4 * MiB, idle_seconds=0, refill_seconds=5)
    supply.add(0, 1, WEIGHTS)
    supply.add(0, 1, CACHE)
    library.vmmd_set_tag(WEIGHTS)
    weights = library.vmmd_torch_malloc(3 * MiB, 0, STREAM_A)
    library.vmmd_set_tag(CACHE)
    cache = library.vmmd_torch_malloc(MiB, 0, STREAM_A)
    ctypes.memset(weights, 0x5E, 3 * MiB)
    ctypes.memset(cache, 0xCA, MiB)
    held = sum(chunk.size for _, chunk, tag in list(supply._chunks.values()) if tag == WEIGHTS)  # with the room leased ahead
    assert supply.sleep(WEIGHTS, "offload") == held >= 4 * MiB
    assert supply.asleep(WEIGHTS) and supply.counters()["asleep_bytes"] == held
    with pytest.raises(vmmd.VmmdError) as raised:
        supply.sleep(WEIGHTS, "offload")
    assert raised.value.code == "ASLEEP"
    # The other tag goes on: its memory stays, its mallocs carve.
    assert ctypes.string_at(cache, 4) == b"\xca" * 4 and library.vmmd_torch_malloc(MiB, 0, STREAM_A)
    # A malloc of the asleep tag gets no memory (PyTorch's out of memory), at once.
    library.vmmd_set_tag(WEIGHTS)
    assert library.vmmd_torch_malloc(MiB, 0, STREAM_A) is None
    assert any(getattr(e, "code", "") == "ASLEEP" for e in supply.errors)
    assert supply.wake([WEIGHTS]) == held and not supply.asleep(WEIGHTS)
    assert ctypes.string_at(weights, 3 * MiB) == b"\x5e" * (3 * MiB)
    assert library.vmmd_torch_malloc(MiB // 2, 0, STREAM_A) == weights + 3 * MiB
    with pytest.raises(vmmd.VmmdError) as raised:
        supply.wake([WEIGHTS])
    assert raised.value.code == "NOT_ASLEEP"
    supply.sleep(CACHE, "discard")
    supply.wake([CACHE])
    library.vmmd_set_tag(0)
    supply.stop()
    pool.close()


def test_a_prepared_tags_copies_are_made_as_its_chunks_are_leased(library: Any, client: vmmd.VmmdClient, daemon: Any) -> None:  # noqa: F811
    from conftest import eventually

    pool = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0)
    supply = ChunkSupply(library, lambda device: pool, 4 * MiB, idle_seconds=0, refill_seconds=5)
    before = daemon.stats().allocated_bytes
    supply.prepare(WEIGHTS)
    supply.add(0, 1, WEIGHTS)
    supply.add(0, 1, CACHE)
    copies = lambda: sum(int(s.copy.size) for s in supply._segments.values() if s.copy is not None)  # noqa: E731
    # The weights' chunk has its copy ahead, the cache's none.
    eventually(lambda: copies() == 4 * MiB, what="the weights' copy made ahead")
    assert daemon.stats().allocated_bytes == before + 12 * MiB
    library.vmmd_set_tag(WEIGHTS)
    weights = library.vmmd_torch_malloc(3 * MiB, 0, STREAM_A)
    ctypes.memset(weights, 0x3C, 3 * MiB)
    cache_bytes = sum(chunk.size for _, chunk, tag in list(supply._chunks.values()) if tag == CACHE)
    slept = supply.sleep(WEIGHTS, "offload")  # with the room the supply leased ahead meanwhile
    assert daemon.stats().allocated_bytes == before + cache_bytes + slept  # the copies, no device memory, no other copy
    supply.wake([WEIGHTS])
    assert ctypes.string_at(weights, 3 * MiB) == b"\x3c" * (3 * MiB)
    assert copies() == slept  # kept for the next pause
    library.vmmd_set_tag(0)
    held = daemon.stats().allocated_bytes
    # Chunks given back take their copies with them.
    assert supply.give_back(0) + supply.give_back(1) >= 0
    from vmmd import _sleep

    _sleep.forget(client, list(supply._segments.values()))
    assert daemon.stats().allocated_bytes <= held - slept
    supply.stop()
    pool.close()
