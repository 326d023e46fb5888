"""The host-testable parts of the integrations: IPC handle bytes, the weights
helper (a file loaded once into a store, opened by other processes), typed
views, and the C allocation library PyTorch loads (its callbacks into Python).
The CUDA paths themselves run on a GPU host (test/gpu/python)."""
from __future__ import annotations

import hashlib
import os

import numpy
import pytest

import vmmd
import vmmd.weights
from vmmd.ipc import decode_ipc_handle, encode_ipc_handle

from conftest import MiB, Daemon, PythonPeer


def test_ipc_handles_name_allocation_offset_and_key_in_64_bytes() -> None:
    key = "A" * 32
    raw = encode_ipc_handle(7, 4096 + 256, key)
    assert len(raw) == 64 and raw[:4] == b"VMMD"
    assert decode_ipc_handle(raw) == (7, 4352, key)
    # As Numba hands them over: an object with .reserved, or a tuple of signed chars.
    class Handle:
        reserved = tuple(b - 256 if b > 127 else b for b in raw)
    assert decode_ipc_handle(Handle()) == (7, 4352, key)
    assert decode_ipc_handle(bytes(64)) is None  # a driver handle: not ours
    with pytest.raises(vmmd.VmmdError) as raised:
        encode_ipc_handle(1, 0, "k" * 43)
    assert raised.value.code == "SHARE_KEY_TOO_LONG"


def test_a_file_loaded_once_is_opened_by_other_processes(daemon: Daemon, tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "weights.bin")
    values = numpy.arange(3 * MiB // 4, dtype="<f4")
    values.tofile(path)
    with daemon.connect() as loader:
        store = vmmd.weights.load_file(path, "weights-host", client=loader)
        assert store.read_only and store.size == values.nbytes and store.owner_session == 0
    # The loader is gone; the store stays (the daemon owns it) and opens elsewhere.
    peer = PythonPeer(daemon)
    try:
        digest = peer.run(
            "import hashlib, numpy, vmmd.weights\n"
            "s = vmmd.weights.open_store('weights-host', client=client)\n"
            "a = numpy.asarray(s.view('<f4'))\n"
            "result = [hashlib.sha256(a.tobytes()).hexdigest(), float(a[12345]), a.flags.writeable]\n"
            "del a"
        )
        assert digest == [hashlib.sha256(values.tobytes()).hexdigest(), 12345.0, False]
    finally:
        peer.close()
    with daemon.connect() as client:
        client.stores.detach("weights-host")


def test_loading_refuses_empty_files_and_taken_names(daemon: Daemon, client: vmmd.VmmdClient, tmp_path: object) -> None:
    empty = os.path.join(str(tmp_path), "empty")
    open(empty, "wb").close()
    before = daemon.stats().allocations
    with pytest.raises(vmmd.VmmdError) as raised:
        vmmd.weights.load_file(empty, "empty", client=client)
    assert raised.value.code == "ZERO_SIZE"
    full = os.path.join(str(tmp_path), "full")
    with open(full, "wb") as f:
        f.write(b"x" * 5000)
    vmmd.weights.load_file(full, "taken", client=client)
    with pytest.raises(vmmd.VmmdError) as raised:
        vmmd.weights.load_file(full, "taken", client=client)
    assert raised.value.code == "NAME_TAKEN"
    assert daemon.stats().allocations == before + 1  # the refused load left nothing
    client.stores.detach("taken")


def test_typed_views_of_host_memory(client: vmmd.VmmdClient) -> None:
    memory = client.vmm.allocate(2 * MiB)
    array = numpy.asarray(memory.view("<i8", (4, 8), offset=256))
    array[:] = numpy.arange(32).reshape(4, 8)
    assert memory.read(256 + 8 * 9, 8) == (9).to_bytes(8, "little")
    assert not hasattr(memory.view(), "__cuda_array_interface__")  # host memory is not device memory
    del array
    memory.close()


def test_dlpack_views_of_host_memory(client: vmmd.VmmdClient) -> None:
    from vmmd import _dlpack

    memory = client.vmm.allocate(2 * MiB)
    view = memory.view("<f8", (4, 4))
    assert view.__dlpack_device__() == (1, 0)
    array = numpy.from_dlpack(view)
    memory.write(0, numpy.arange(16, dtype="<f8").tobytes())
    assert array.shape == (4, 4) and array[1, 1] == 5.0  # the same pages, no copy
    assert _dlpack.alive() == 1
    del array
    import gc

    gc.collect()
    assert _dlpack.alive() == 0  # the consumer's deleter ran
    unconsumed = view.__dlpack__()
    assert _dlpack.alive() == 1
    del unconsumed
    gc.collect()
    assert _dlpack.alive() == 0  # the capsule's destructor deleted it
    store = client.stores.attach_bytes(b"\0" * 64, name="dlpack-ro", read_only=True)
    with client.stores.open(store.id) as opened:
        with pytest.raises(vmmd.VmmdError) as raised:
            opened.view("<f8").__dlpack__()
        assert raised.value.code == "READ_ONLY"
    memory.close()
