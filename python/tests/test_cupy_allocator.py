"""The C allocation library behind vmmd's CuPy allocator (_cupy_allocator.c)
and the carver that leases its chunks (_cupy_chunks.py), without CuPy: blocks
carved in C in size classes, stream-ordered reuse (a block freed goes to its
stream, to others once the held blocks are released after a synchronize; a
malloc never waits: no room is NULL at once), chunks of their own for large
requests, and the Python side that leases on the caller's
thread, raises out of memory as a MemoryError and gives chunks back on trim
and when idle."""
from __future__ import annotations

import ctypes
import os
import shutil
from typing import Any, Iterator, List

import pytest

import vmmd
from vmmd import _cupy_chunks
from vmmd.pool import DevicePool

from conftest import MiB, eventually
from test_torch_allocator import session_bytes

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler here")
STREAM_A, STREAM_B = 0x5A, 0x5B
BASE = 0x7000_0000_0000


class CurrentStream:
    """CuPy's get_current_stream_ptr stood in for: answers `stream`."""

    def __init__(self) -> None:
        self.stream = STREAM_A
        self.function = ctypes.CFUNCTYPE(ctypes.c_ssize_t)(lambda: self.stream)

    def address(self) -> int:
        return int(ctypes.cast(self.function, ctypes.c_void_p).value or 0)


@pytest.fixture(scope="module")
def built(tmp_path_factory: Any) -> str:
    """The library built once here (VMMD_CACHE_DIR), as vmmd.cupy builds it."""
    cache = str(tmp_path_factory.mktemp("cache"))
    previous = os.environ.get("VMMD_CACHE_DIR")
    os.environ["VMMD_CACHE_DIR"] = cache
    try:
        return _cupy_chunks.library_path()
    finally:
        if previous is None:
            del os.environ["VMMD_CACHE_DIR"]
        else:
            os.environ["VMMD_CACHE_DIR"] = previous


@pytest.fixture
def current() -> CurrentStream:
    return CurrentStream()


@pytest.fixture
def library(built: str, tmp_path: Any, current: CurrentStream) -> Iterator[Any]:
    """A private copy of the library (its state is per loaded file), large requests above 4 MiB."""
    private = os.path.join(str(tmp_path), "private.so")
    shutil.copy(built, private)
    library = _cupy_chunks.load(private)
    library.vmmd_cupy_configure(current.address(), 4 * MiB)
    yield library


def malloc(library: Any, size: int) -> int:
    return int(library.vmmd_cupy_malloc(None, size, 0) or 0)


def free(library: Any, address: int) -> None:
    library.vmmd_cupy_free(None, address, 0)


def test_blocks_are_carved_in_size_classes_and_reused_by_their_stream(library: Any) -> None:
    assert library.vmmd_cupy_add_chunk(0, BASE, 8 * MiB, 0) == 0
    first = malloc(library, 1000)
    second = malloc(library, 5000)  # 5120: quarters of 4096 above it
    assert (first, second) == (BASE, BASE + 1024)
    assert [library.vmmd_cupy_size_class(n) for n in (1, 512, 513, 4096, 4097, 5000)] == [512, 512, 1024, 4096, 5120, 5120]
    free(library, first)
    assert malloc(library, 600) == first  # the same class, on the same stream: reused at once
    stats = (ctypes.c_uint64 * 6)()
    library.vmmd_cupy_stats(0, stats)
    assert list(stats) == [1, 8 * MiB, 1024 + 5120, 2, 0, 0]


def test_a_block_freed_on_a_stream_goes_to_no_other_stream_until_the_held_blocks_are_released(library: Any, current: CurrentStream) -> None:
    library.vmmd_cupy_add_chunk(0, BASE, 4 * MiB, 0)
    first = malloc(library, 2 * MiB)
    free(library, first)  # a kernel on A may still write it: CuPy's free comes when the array is dropped
    current.stream = STREAM_B
    assert malloc(library, 2 * MiB) == BASE + 2 * MiB, "B got memory that A's work may still write"
    assert malloc(library, 2 * MiB) == 0  # only A's block is left: no room now, and no wait
    current.stream = STREAM_A
    assert malloc(library, 2 * MiB) == first  # A's own later work runs after its free
    free(library, first)
    library.vmmd_cupy_mark_held()
    assert library.vmmd_cupy_release_held() == 2 * MiB  # the caller synchronized the device in between
    current.stream = STREAM_B
    assert malloc(library, MiB) == first and malloc(library, MiB) == first + MiB  # every stream's, coalesced


def test_a_block_freed_after_the_mark_stays_held(library: Any) -> None:
    library.vmmd_cupy_add_chunk(0, BASE, 4 * MiB, 0)
    early, late = malloc(library, MiB), malloc(library, MiB)
    free(library, early)
    library.vmmd_cupy_mark_held()
    free(library, late)  # another thread, while the device synchronizes: its work may be queued after the synchronize
    assert library.vmmd_cupy_release_held() == MiB
    stats = (ctypes.c_uint64 * 6)()
    library.vmmd_cupy_stats(0, stats)
    assert (stats[4], stats[5]) == (MiB, 1)
    assert malloc(library, MiB) == late  # still its stream's


def test_many_held_blocks_of_many_streams_are_each_found_by_their_stream(library: Any, current: CurrentStream) -> None:
    library.vmmd_cupy_add_chunk(0, BASE, 64 * MiB, 0)
    blocks = {}
    for stream in range(1, 41):
        current.stream = stream
        blocks[stream] = [malloc(library, size) for size in (512, 4096, 70000, 1 << 20)]
    for stream, addresses in blocks.items():
        for address in addresses:
            free(library, address)
    for stream in reversed(range(1, 41)):
        current.stream = stream
        assert [malloc(library, size) for size in (1 << 20, 70000, 4096, 512)] == blocks[stream][::-1]
    values = (ctypes.c_uint64 * 8)()
    library.vmmd_counters(values)
    assert values[2] == 160


def test_a_chunk_of_its_own_stays_whole_for_large_requests(library: Any) -> None:
    library.vmmd_cupy_add_chunk(0, BASE, 64 * MiB, 1)
    assert malloc(library, MiB) == 0  # a small request never splits it
    large = malloc(library, 64 * MiB)
    assert large == BASE
    free(library, large)
    assert malloc(library, 64 * MiB) == BASE


def test_a_free_of_an_unknown_address_is_counted_and_changes_nothing(library: Any) -> None:
    library.vmmd_cupy_add_chunk(0, BASE, 4 * MiB, 0)
    block = malloc(library, MiB)
    free(library, block + 512)
    free(library, 0x1234)
    free(library, block)
    free(library, block)  # twice: the block is held, not in use
    values = (ctypes.c_uint64 * 8)()
    library.vmmd_counters(values)
    assert values[7] == 3


def test_mallocs_and_frees_leave_the_clock_to_the_stamp(library: Any) -> None:
    # The clock can cost microseconds a read; the idle check stamps the chunks used since it last looked.
    library.vmmd_cupy_add_chunk(0, BASE, 4 * MiB, 0)
    free(library, malloc(library, MiB))
    device, base, size = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_uint64()
    take = lambda: library.vmmd_take_empty_chunk(_cupy_chunks.TAKE_IDLE, ctypes.c_double(1e-9), ctypes.byref(device), ctypes.byref(base), ctypes.byref(size))  # noqa: E731
    assert take() == 0  # used since the last stamp: not idle, however long ago
    library.vmmd_cupy_stamp(0)
    assert take() == 1 and (base.value, size.value) == (BASE, 4 * MiB)


class FakeMemory:
    """CuPy's CFunctionAllocatorMemory as far as the carver goes: `.ptr`, freed when dropped."""

    def __init__(self, library: Any, size: int) -> None:
        self.library = library
        self.ptr = malloc(library, size) if size else 0

    def __del__(self) -> None:
        if self.ptr:
            free(self.library, self.ptr)


def carver(library: Any, client: vmmd.VmmdClient, idle_seconds: float = 0, **settings: Any) -> Any:
    pool = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0, location={"type": "LOCATION_TYPE_HOST", "id": 0})
    return _cupy_chunks.Carver(library, lambda device: pool, lambda size: FakeMemory(library, size), lambda: 0, 4 * MiB, idle_seconds, **settings)


def test_the_carver_leases_on_the_callers_thread_and_trim_gives_every_empty_chunk_back(library: Any, client: vmmd.VmmdClient) -> None:
    chunks = carver(library, client)
    small = [chunks.malloc(MiB) for _ in range(5)]  # a chunk holds four
    large = chunks.malloc(10 * MiB)
    assert all(m.ptr for m in small + [large]) and len({m.ptr for m in small + [large]}) == 6
    assert session_bytes(client) == 2 * 4 * MiB + 10 * MiB
    assert chunks.stats(0)["chunks"] == 3 and chunks.stats(0)["blocks"] == 6
    assert chunks.malloc(0).ptr == 0
    del small[:4]
    assert chunks.trim() == 4 * MiB  # the chunk emptied; the others still hold a block
    del small, large
    assert chunks.trim() == 4 * MiB + 10 * MiB and session_bytes(client) == 0


def test_out_of_memory_is_a_memory_error_after_the_cached_chunks_went_back(library: Any, client: vmmd.VmmdClient) -> None:
    chunks = carver(library, client)
    kept: List[Any] = [chunks.malloc(MiB)]
    kept.clear()  # its chunk is cached, empty
    with pytest.raises(MemoryError) as raised:
        chunks.malloc(1 << 40)  # a TiB: more than the daemon has
    assert isinstance(raised.value, vmmd.OutOfMemoryError) and raised.value.code == "OUT_OF_MEMORY"
    assert chunks.counters["out_of_memory_retries"] == 1 and session_bytes(client) == 0


def test_chunks_unused_for_the_idle_time_go_back(library: Any, client: vmmd.VmmdClient) -> None:
    chunks = carver(library, client, idle_seconds=0.3)
    block = chunks.malloc(MiB)
    assert session_bytes(client) == 4 * MiB
    del block
    # The idle thread counts its trim once the chunk's release is answered: the bytes can be back before the count.
    eventually(lambda: session_bytes(client) == 0 and chunks.counters["idle_trims"] >= 1, timeout=5, what="the idle chunk to go back, counted")


def test_sleep_keeps_every_address_and_byte_and_a_malloc_while_asleep_is_refused(library: Any, client: vmmd.VmmdClient) -> None:
    chunks = carver(library, client)
    blocks = [chunks.malloc(size) for size in (MiB, 3000, 10 * MiB)]
    for index, block in enumerate(blocks):
        ctypes.memset(block.ptr, 0x10 + index, 3000)
    spare = chunks.malloc(MiB)
    del spare  # held: it sleeps with its chunk
    assert chunks.sleep("offload") == 4 * MiB + 10 * MiB
    assert chunks.asleep and chunks.trim() == 0
    with pytest.raises(vmmd.VmmdError) as raised:
        chunks.malloc(MiB)
    assert (raised.value.code, raised.value.status_name) == ("ASLEEP", "FAILED_PRECONDITION")
    assert chunks.wake() == 4 * MiB + 10 * MiB and not chunks.asleep
    assert all(ctypes.string_at(block.ptr, 3000) == bytes([0x10 + index]) * 3000 for index, block in enumerate(blocks))
    assert chunks.malloc(MiB).ptr  # carved from the woken chunk again
    assert chunks.stats(0)["chunks"] == 2


def test_prepared_copies_are_made_as_chunks_are_leased_serve_the_first_sleep_and_go_with_their_chunk(library: Any, client: vmmd.VmmdClient) -> None:
    chunks = carver(library, client, prepare_copies=True)
    blocks = [chunks.malloc(MiB), chunks.malloc(10 * MiB)]
    for index, block in enumerate(blocks):
        ctypes.memset(block.ptr, 0x20 + index, 3000)
    eventually(lambda: chunks.stats(0)["prepared_bytes"] == 14 * MiB and chunks.stats(0)["prepare_pending"] == 0, what="the copies made ahead")
    assert chunks.prepare_error is None
    # The chunks and a copy of each, made while awake.
    assert session_bytes(client) == 2 * (4 * MiB + 10 * MiB)
    assert chunks.sleep("offload") == 14 * MiB
    answer = {"asleep": session_bytes(client), "stats": chunks.stats(0)}
    # The sleep made no copy of its own: the daemon holds the prepared copies alone.
    assert answer["asleep"] == 14 * MiB, answer
    assert chunks.wake() == 14 * MiB
    assert all(ctypes.string_at(block.ptr, 3000) == bytes([0x20 + index]) * 3000 for index, block in enumerate(blocks))
    # Kept after wake for the next sleep; a chunk given back takes its copy along.
    assert session_bytes(client) == 2 * 14 * MiB and chunks.stats(0)["prepared_bytes"] == 14 * MiB
    del blocks, block
    assert chunks.trim() == 14 * MiB
    answer = {"after_trim": session_bytes(client), "stats": chunks.stats(0)}
    assert answer["after_trim"] == 0 and answer["stats"]["prepared_bytes"] == 0, answer
