"""The C allocation library behind vmmd's PyTorch MemPool (_torch_allocator.c)
and the thread that supplies its chunks (_torch_chunks.py), without PyTorch:
mallocs carved in C from chunks held ahead, stream-ordered reuse with the
driver's events stood in for, a malloc that waits for a refill (and never
longer than its limit), and chunks given back to the daemon once emptied or
idle."""
from __future__ import annotations

import ctypes
import os
import shutil
import threading
import time
from typing import Any, Dict, Iterator, List

import pytest

import vmmd
from vmmd import _allocator_lib
from vmmd._torch_chunks import TAKE_FREED, ChunkSupply
from vmmd.pool import DevicePool

from conftest import MiB, eventually

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler here")
STREAM_A, STREAM_B = 0x5A, 0x5B
BASE = 0x7000_0000_0000
NOT_READY = 600


class FakeEvents:
    """cuEventCreate/Record/Query/Synchronize/Destroy over streams that are `busy` until finished."""

    def __init__(self) -> None:
        self.busy: set = set()
        self.events: Dict[int, Dict[str, Any]] = {}
        create = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)(self._create)
        record = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(self._record)
        query = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda e: 0 if self.events[e]["done"] else NOT_READY)
        sync = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(self._sync)
        destroy = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda e: self.events[e].update(destroyed=True) or 0)
        self.functions = (create, record, query, sync, destroy)

    def _create(self, out: Any, flags: int) -> int:
        event = 0x100 + len(self.events)
        self.events[event] = {"stream": None, "done": False, "destroyed": False, "waited": False}
        out[0] = event
        return 0

    def _record(self, event: int, stream: int) -> int:
        self.events[event].update(stream=stream, done=stream not in self.busy)
        return 0

    def _sync(self, event: int) -> int:
        self.busy.discard(self.events[event]["stream"])
        self.events[event].update(done=True, waited=True)
        return 0

    def pointers(self) -> List[int]:
        return [ctypes.cast(f, ctypes.c_void_p).value for f in self.functions]


@pytest.fixture(scope="module")
def built(tmp_path_factory: Any) -> str:
    """The library built once here (VMMD_CACHE_DIR), as vmmd.torch builds it without an installed copy."""
    cache = str(tmp_path_factory.mktemp("cache"))
    previous = os.environ.get("VMMD_CACHE_DIR")
    os.environ["VMMD_CACHE_DIR"] = cache
    try:
        return _allocator_lib.library_path()
    finally:
        if previous is None:
            del os.environ["VMMD_CACHE_DIR"]
        else:
            os.environ["VMMD_CACHE_DIR"] = previous


@pytest.fixture
def library(built: str, tmp_path: Any) -> Iterator[Any]:
    """A private copy of the library: its state is per loaded file."""
    private = os.path.join(str(tmp_path), "private.so")
    shutil.copy(built, private)
    library = _allocator_lib.load(private)
    yield library
    library.vmmd_stop()


def counters(library: Any) -> Dict[str, int]:
    from vmmd._torch_chunks import COUNTERS

    values = (ctypes.c_uint64 * len(COUNTERS))()
    library.vmmd_counters(values)
    return dict(zip(COUNTERS, values))


def test_mallocs_are_carved_in_c_from_the_chunks_it_holds(library: Any) -> None:
    assert library.vmmd_add_chunk(0, BASE, 8 * MiB) == 0
    first = library.vmmd_torch_malloc(2 * MiB, 0, STREAM_A)
    second = library.vmmd_torch_malloc(1000, 0, STREAM_A)
    assert (first, second) == (BASE, BASE + 2 * MiB)
    library.vmmd_torch_free(second, 1000, 0, STREAM_A)
    assert library.vmmd_torch_malloc(512, 0, STREAM_A) == second  # rounded to 512 bytes, reused by its stream
    assert counters(library)["mallocs"] == 3 and counters(library)["frees"] == 1


def test_a_block_freed_on_a_busy_stream_is_reused_at_once_only_by_that_stream(library: Any) -> None:
    events = FakeEvents()
    library.vmmd_set_driver(*events.pointers())
    library.vmmd_add_chunk(0, BASE, 4 * MiB)
    first = library.vmmd_torch_malloc(2 * MiB, 0, STREAM_A)
    events.busy.add(STREAM_A)  # a kernel on A still writes the block
    library.vmmd_torch_free(first, 2 * MiB, 0, STREAM_A)
    other = library.vmmd_torch_malloc(2 * MiB, 0, STREAM_B)
    assert other == BASE + 2 * MiB, "B got memory that A's work still writes"
    assert library.vmmd_torch_malloc(2 * MiB, 0, STREAM_A) == first  # A's own later work runs after
    library.vmmd_torch_free(first, 2 * MiB, 0, STREAM_A)
    # Full but for A's block: B waits for an event recorded on A after the free, then reuses it.
    assert library.vmmd_torch_malloc(2 * MiB, 0, STREAM_B) == first
    waited = [e for e in events.events.values() if e["waited"]]
    assert [e["stream"] for e in waited] == [STREAM_A] and all(e["destroyed"] for e in events.events.values())
    assert counters(library)["same_stream_reused"] == 1 and counters(library)["stream_waits"] == 1


def test_a_stream_whose_work_is_done_lends_its_block_without_a_wait(library: Any) -> None:
    events = FakeEvents()
    library.vmmd_set_driver(*events.pointers())
    library.vmmd_add_chunk(0, BASE, 2 * MiB)
    first = library.vmmd_torch_malloc(2 * MiB, 0, STREAM_A)
    library.vmmd_torch_free(first, 2 * MiB, 0, STREAM_A)
    assert library.vmmd_torch_malloc(1 * MiB, 0, STREAM_B) == first
    assert library.vmmd_torch_malloc(1 * MiB, 0, STREAM_B) == first + MiB  # freed blocks coalesce
    assert not any(e["waited"] for e in events.events.values())


def test_a_malloc_with_no_room_waits_no_longer_than_its_limit(library: Any) -> None:
    library.vmmd_configure(0.3, 0, 0.0)
    start = time.monotonic()
    assert library.vmmd_torch_malloc(MiB, 0, STREAM_A) is None  # nobody refills: PyTorch's out of memory
    assert 0.25 < time.monotonic() - start < 5 and counters(library)["refill_timeouts"] == 1


def session_bytes(client: vmmd.VmmdClient) -> int:
    return sum(int(s.allocated_bytes) for s in client.admin.list_sessions().sessions if int(s.id) == int(client.session.id))


def test_the_supply_thread_refills_a_waiting_malloc_and_takes_emptied_chunks_back(library: Any, client: vmmd.VmmdClient) -> None:
    pool = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0)
    # An idle time well above what a loaded machine may stall between the third chunk's lease and the last give-back.
    supply = ChunkSupply(library, lambda device: pool, 4 * MiB, idle_seconds=6, refill_seconds=10)
    results: List[Any] = []
    # From another thread, as PyTorch calls it: the call releases the GIL, the supply thread leases meanwhile.
    waiter = threading.Thread(target=lambda: results.append(library.vmmd_torch_malloc(6 * MiB, 0, STREAM_A)))
    waiter.start()
    waiter.join(10)
    address = results[0]
    assert address and supply.locate(address)[2] == 0
    # Room goes ahead (half a chunk, the largest malloc and a quarter of what is held: 9.5 MiB): the next one does not wait.
    eventually(lambda: supply.counters()["chunks"] == 2, what="the chunk leased ahead")
    assert session_bytes(client) == 6 * MiB + 10 * MiB
    small = library.vmmd_torch_malloc(MiB, 0, STREAM_A)
    assert small and counters(library)["refill_waits"] == 1
    # The room left (9 MiB) is below what goes ahead now (2 + 6 + 4 MiB): a third chunk comes, of the chunk size.
    eventually(lambda: supply.counters()["chunks"] == 3, what="the second chunk leased ahead")
    assert session_bytes(client) == 6 * MiB + 10 * MiB + 4 * MiB
    library.vmmd_torch_free(address, 6 * MiB, 0, STREAM_A)  # as empty_cache() does
    eventually(lambda: session_bytes(client) == 14 * MiB, what="the emptied chunk to go back")  # at once: the others have room
    library.vmmd_torch_free(small, MiB, 0, STREAM_A)
    eventually(lambda: session_bytes(client) == 4 * MiB, what="the second emptied chunk to go back")
    eventually(lambda: session_bytes(client) == 0, timeout=20, what="the last chunk to go back")  # unused for the idle time
    assert not supply.errors
    supply.stop()


def test_an_emptied_chunk_stays_while_no_other_chunk_has_room_for_the_next_mallocs(library: Any) -> None:
    library.vmmd_configure(0.3, 2 * MiB, 0.0)  # 2 MiB kept spare, as ChunkSupply keeps half a chunk
    device, base, size = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_uint64()
    take = lambda: library.vmmd_take_empty_chunk(TAKE_FREED, ctypes.c_double(0), ctypes.byref(device), ctypes.byref(base), ctypes.byref(size))  # noqa: E731
    library.vmmd_add_chunk(0, BASE, 4 * MiB)
    block = library.vmmd_torch_malloc(MiB, 0, STREAM_A)
    library.vmmd_torch_free(block, MiB, 0, STREAM_A)
    assert take() == 0  # the only chunk: it is the next mallocs' room
    library.vmmd_add_chunk(0, BASE + 4 * MiB, MiB)
    assert take() == 0  # 1 MiB elsewhere is below the 2 MiB kept spare
    library.vmmd_add_chunk(0, BASE + 5 * MiB, 2 * MiB)
    assert take() == 1 and (base.value, size.value) == (BASE, 4 * MiB)
    assert take() == 0  # the others were never used: only the idle time takes them


def test_a_refill_the_daemon_refuses_fails_the_malloc_at_once(library: Any, client: vmmd.VmmdClient) -> None:
    pool = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0)
    supply = ChunkSupply(library, lambda device: pool, 4 * MiB, idle_seconds=0, refill_seconds=30)
    start = time.monotonic()
    assert library.vmmd_torch_malloc(1 << 40, 0, STREAM_A) is None  # a TiB: more than the daemon has
    assert time.monotonic() - start < 10 and counters(library)["refill_failures"] == 1
    assert len(supply.errors) == 1 and supply.errors[0].out_of_memory
    supply.stop()


def test_chunks_unused_for_the_idle_time_go_back(library: Any, client: vmmd.VmmdClient) -> None:
    pool = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0)
    supply = ChunkSupply(library, lambda device: pool, 4 * MiB, idle_seconds=0.3)
    supply.add(0, 1)
    assert session_bytes(client) == 4 * MiB
    eventually(lambda: session_bytes(client) == 0, timeout=5, what="the idle chunk to go back")
    supply.stop()
