"""torch_memory_saver's pause/resume and vLLM's sleep(level)/wake_up(tags) of
vmmd.torch, on the C library and the chunk supply without PyTorch: the tags
a region made, what each mode keeps, strict pause and resume, lenient
wake_up, and a wake that finds no room leaving every tag asleep."""
from __future__ import annotations

import ctypes
import types
from typing import Any, Iterator, Tuple

import pytest

import vmmd
from vmmd import _sleep
from vmmd._torch_chunks import ChunkSupply
from vmmd._torch_sleep import TorchMemorySaver
from vmmd.pool import DevicePool

from conftest import MiB, Daemon
from test_torch_allocator import STREAM_A, built, library  # noqa: F401 - fixtures


@pytest.fixture
def saver(library: Any, client: vmmd.VmmdClient) -> Iterator[Tuple[TorchMemorySaver, Any]]:  # noqa: F811
    pool = DevicePool(client, chunk_size=4 * MiB, idle_seconds=0)
    supply = ChunkSupply(library, lambda device: pool, 4 * MiB, idle_seconds=0, refill_seconds=5)
    library.vmmd_configure(5.0, 0, 0.0)  # no room leased ahead: each tag holds what its tensors need
    saver = TorchMemorySaver(types.SimpleNamespace(supply=supply, _library=library))
    yield saver, library
    library.vmmd_set_tag(0)
    supply.stop()
    pool.close()


def tensor(saver: TorchMemorySaver, library: Any, tag: str, backup: bool, fill: int) -> int:
    """What a tensor made in region(tag, enable_cpu_backup=backup) gets: a block of the tag's number, filled."""
    with saver._tagged(saver._number(tag, backup)):
        address = library.vmmd_torch_malloc(MiB, 0, STREAM_A)
    ctypes.memset(address, fill, MiB)
    return int(address)


def kept(address: int, fill: int) -> bool:
    return ctypes.string_at(address, MiB) == bytes([fill]) * MiB


def test_pause_and_resume_as_torch_memory_saver(saver: Any, daemon: Daemon) -> None:
    saver, library = saver
    backed = tensor(saver, library, "type1", True, 0x11)
    dropped = tensor(saver, library, "type2", False, 0x22)
    # A region with a backup has its copy made ahead (prepare_cpu_backup): held from here on.
    _sleep.settle(list(saver.allocator.supply._segments.values()))
    before = daemon.stats().allocated_bytes
    saver.pause("type2")
    assert daemon.stats().allocated_bytes == before - 4 * MiB  # discarded: nothing kept
    with pytest.raises(vmmd.VmmdError) as raised:
        saver.pause()  # type2 is paused already: nothing is paused
    assert raised.value.code == "ASLEEP" and "type2" in raised.value.message
    assert not saver.allocator.supply.asleep(saver._number("type1", True))
    with pytest.raises(vmmd.VmmdError) as raised:
        saver.resume("type1")
    assert raised.value.code == "NOT_ASLEEP"
    saver.pause("type1")
    assert daemon.stats().allocated_bytes == before - 8 * MiB  # type1's device memory goes; its copy was there already
    saver.resume()
    assert kept(backed, 0x11)
    ctypes.memset(dropped, 0x33, MiB)  # mapped and writable again
    with pytest.raises(vmmd.VmmdError) as raised:
        saver.pause("")
    assert raised.value.code == "BAD_TAG"


def test_sleep_levels_as_vllm(saver: Any, daemon: Daemon) -> None:
    saver, library = saver
    weights = tensor(saver, library, "weights", False, 0x77)
    cache = tensor(saver, library, "kv_cache", False, 0x55)
    with pytest.raises(vmmd.VmmdError) as raised:
        saver.sleep(3)
    assert raised.value.code == "BAD_SLEEP_MODE" and "3" in raised.value.message
    before = daemon.stats().allocated_bytes
    saver.sleep(1)
    assert daemon.stats().allocated_bytes == before - 4 * MiB  # the weights' copy stays, the cache goes
    saver.wake_up(["weights"])
    assert kept(weights, 0x77) and saver.allocator.supply.asleep(saver._number("kv_cache", False))
    saver.wake_up()  # the cache; the weights, awake, are left as they are
    ctypes.memset(cache, 0x56, MiB)
    saver.sleep(2)
    assert daemon.stats().allocated_bytes == before - 8 * MiB  # everything discarded
    saver.wake_up()
    assert daemon.stats().allocated_bytes == before


def test_a_wake_without_room_leaves_every_tag_asleep(saver: Any, daemon: Daemon) -> None:
    saver, library = saver
    weights = tensor(saver, library, "weights", True, 0x42)
    tensor(saver, library, "kv_cache", False, 0)
    saver.pause()
    other = daemon.connect()
    free = int(other.devices.get_memory_info(device=0).free_bytes)
    hog = other.vmm.allocate(free - free % (2 * MiB) - 4 * MiB)  # room for one tag, not for both
    with pytest.raises(vmmd.VmmdError) as raised:
        saver.resume(timeout=1)
    assert raised.value.out_of_memory
    supply = saver.allocator.supply
    assert supply.asleep(saver._number("weights", True)) and supply.asleep(saver._number("kv_cache", False))
    hog.close()
    other.vmm.release(allocation_id=hog.allocation_id)
    other.close()
    saver.resume()
    assert kept(weights, 0x42)


def test_retain_cpu_backup_keeps_the_copies_across_resumes(saver: Any, daemon: Daemon) -> None:
    saver, library = saver
    weights = tensor(saver, library, "weights", True, 0x61)
    saver.retain_cpu_backup = True
    assert saver.retain_cpu_backup
    saver.pause()
    saver.resume()
    held = daemon.stats().allocated_bytes  # the chunk and its copy
    ctypes.memset(weights, 0x62, MiB)
    saver.pause()
    assert daemon.stats().allocated_bytes == held - 4 * MiB  # the copy was reused, the chunk released
    saver.resume()
    assert kept(weights, 0x62) and daemon.stats().allocated_bytes == held
