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


def test_a_tag_without_memory_pauses_and_resumes_offloaded(library: Any, client: vmmd.VmmdClient) -> None:  # noqa: F811
    pool = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0)
    supply = ChunkSupply(library, lambda device: pool, 4 * MiB, idle_seconds=0, refill_seconds=5)
    supply.prepare(WEIGHTS)
    assert supply.sleep(WEIGHTS, "offload") == 0 and supply.asleep(WEIGHTS)
    assert supply.wake([WEIGHTS]) == 0 and not supply.asleep(WEIGHTS)
    supply.stop()
    pool.close()


class _GatedPool(DevicePool):
    """A real pool whose next lease waits at a gate once `hold` is set: a chunk leased while a sleep runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hold = False
        self.leasing = threading.Event()
        self.gate = threading.Event()

    def _lease(self, size: int) -> Any:
        if self.hold:
            self.leasing.set()
            assert self.gate.wait(10)
        return super()._lease(size)


def test_a_chunk_leased_while_its_tag_falls_asleep_never_serves_it(library: Any, client: vmmd.VmmdClient, daemon: Any) -> None:  # noqa: F811
    pool = _GatedPool(client, chunk_size=4 * MiB, idle_seconds=0)
    supply = ChunkSupply(library, lambda device: pool, 4 * MiB, idle_seconds=0, refill_seconds=5)
    supply.add(0, 1, WEIGHTS)
    before = daemon.stats().allocated_bytes
    pool.hold = True
    outcome: List[Any] = []

    def lease() -> None:
        try:
            outcome.append(supply.add(0, 1, WEIGHTS))
        except vmmd.VmmdError as error:
            outcome.append(error)

    thread = threading.Thread(target=lease)
    thread.start()
    assert pool.leasing.wait(10)
    # The tag falls asleep while the lease is on its way to the daemon.
    slept = supply.sleep(WEIGHTS, "discard")
    pool.gate.set()
    thread.join(10)
    pool.hold = False
    answer = {"outcome": repr(outcome), "slept": slept, "counters": supply.counters(), "allocated": daemon.stats().allocated_bytes, "before": before}
    # The chunk that arrived late went back: nothing of the asleep tag stays mapped, no malloc of it carves.
    assert len(outcome) == 1 and getattr(outcome[0], "code", "") == "ASLEEP", answer
    assert answer["allocated"] == before - slept, answer
    library.vmmd_set_tag(WEIGHTS)
    assert library.vmmd_torch_malloc(MiB, 0, STREAM_A) is None, answer
    library.vmmd_set_tag(0)
    assert supply.wake([WEIGHTS]) == slept
    supply.stop()
    pool.close()


class _GatedLibrary:
    """The C library, with vmmd_add_tagged_chunk held at a gate once `hold` is set."""

    def __init__(self, library: Any) -> None:
        self._library = library
        self.hold = False
        self.adding = threading.Event()
        self.gate = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._library, name)

    def vmmd_add_tagged_chunk(self, *args: Any) -> int:
        if self.hold:
            self.adding.set()
            assert self.gate.wait(10)
        return int(self._library.vmmd_add_tagged_chunk(*args))


def test_a_chunk_leased_as_its_tag_is_prepared_gets_one_copy(library: Any, client: vmmd.VmmdClient, daemon: Any) -> None:  # noqa: F811
    from conftest import eventually
    from vmmd import _sleep

    gated = _GatedLibrary(library)
    pool = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0)
    supply = ChunkSupply(gated, lambda device: pool, 4 * MiB, idle_seconds=0, refill_seconds=5)
    before = daemon.stats().allocated_bytes
    gated.hold = True
    leasing = threading.Thread(target=lambda: supply.add(0, 1, WEIGHTS))
    leasing.start()
    assert gated.adding.wait(10)
    # The tag is prepared while its new chunk is being handed to the C library.
    preparing = threading.Thread(target=lambda: supply.prepare(WEIGHTS))
    preparing.start()
    preparing.join(0.3)
    gated.gate.set()
    leasing.join(10)
    preparing.join(10)
    gated.hold = False
    _sleep.settle(list(supply._segments.values()))
    copies = lambda: daemon.stats().allocated_bytes - before  # noqa: E731
    eventually(lambda: copies() >= 8 * MiB, what="the chunk and its copy")
    answer = {"segments": len(supply._segments), "bytes": copies()}
    # One sleep record, one copy: no second record made beside the first and its copy left behind.
    assert answer == {"segments": 1, "bytes": 8 * MiB}, answer
    supply.stop()
    _sleep.forget(client, list(supply._segments.values()))
    pool.close()
