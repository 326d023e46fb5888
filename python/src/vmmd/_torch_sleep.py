"""Sleep and wake of PyTorch memory by tag, with torch_memory_saver's API
(region, cuda_graph, pause, resume, disable) and vLLM's sleep mode
(sleep(level), wake_up(tags)), over vmmd's MemPool: an engine that calls
either changes one import.

    from vmmd.torch import torch_memory_saver
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        model = Model().cuda()
    with torch_memory_saver.region(tag="kv_cache"):
        cache = torch.empty(n, device="cuda")
    torch_memory_saver.pause("kv_cache")     # memory back to the daemon, addresses kept
    torch_memory_saver.resume("kv_cache")    # same addresses, contents dropped (no backup)

Each (tag, backup) pair has a MemPool per device and a tag number in the C
library (a region sets its thread's number, as torch_memory_saver's region
config); pause and sleep put the numbers' chunks to sleep, resume and wake_up
ask the daemon for all their memory in one request. torch is imported where
a MemPool is needed only: pausing and resuming are the C library's and the
daemon's business."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from . import _sleep
from .errors import STATUS, VmmdError
from .pool import DEFAULT_TAG, check_tag

# Tag numbers of the C library (_torch_allocator.c's MAX_TAGS); 0 is memory outside any region.
MAX_TAG_NUMBERS = 15
# The tag vLLM's sleep level 1 keeps (offloaded); everything else is discarded.
WEIGHTS_TAG = "weights"


class TorchMemorySaver:
    """torch_memory_saver's API over vmmd memory (see the module's
    documentation); `allocator` is vmmd.torch's (made on first use)."""

    def __init__(self, allocator: Any = None) -> None:
        self._allocator = allocator
        self._lock = threading.Lock()
        # Invariant: every (tag, backup) pair ever used has one number in 1..MAX_TAG_NUMBERS, never reused.
        self._numbers: Dict[Tuple[str, bool], int] = {}
        self._pools: Dict[Tuple[int, int, bool], Any] = {}
        # Regions with enable_cpu_backup get their host copies made ahead, while the engine runs, and kept
        # while awake (host memory as large as the region): the first pause then costs the copy alone.
        self.prepare_cpu_backup = True

    @property
    def allocator(self) -> Any:
        if self._allocator is None:
            from .torch import allocator

            self._allocator = allocator()
        return self._allocator

    @property
    def enabled(self) -> bool:
        return True

    @property
    def retain_cpu_backup(self) -> bool:
        """Whether resume keeps the host copies of backed-up regions for the next pause (torch_memory_saver's name)."""
        return bool(self.allocator.supply.retain)

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self.allocator.supply.retain = bool(value)

    def _number(self, tag: str, backup: bool) -> int:
        check_tag(tag)
        with self._lock:
            number = self._numbers.get((tag, backup))
            if number is None:
                if len(self._numbers) >= MAX_TAG_NUMBERS:
                    raise VmmdError("BAD_TAG", STATUS["INVALID_ARGUMENT"], f"tag {tag!r}: at most {MAX_TAG_NUMBERS} (tag, enable_cpu_backup) pairs per process, and {sorted(self._numbers)} are taken")
                number = self._numbers[(tag, backup)] = len(self._numbers) + 1
                prepare = backup and self.prepare_cpu_backup
            else:
                prepare = False
        if prepare:
            self.allocator.supply.prepare(number)
        return number

    def _mem_pool(self, number: int, device: int, graph: bool = False) -> Any:
        """The MemPool of a tag number on a device; graphs capture into one of their own (a pool that
        eager tensors also use would mix graph-private blocks with theirs), of the same tag."""
        import torch

        with self._lock:
            pool = self._pools.get((number, device, graph))
            if pool is None:
                pool = self._pools[(number, device, graph)] = torch.cuda.MemPool(self.allocator.pluggable.allocator())
            return pool

    @contextlib.contextmanager
    def _tagged(self, number: int) -> Iterator[None]:
        library = self.allocator._library
        previous = int(library.vmmd_get_tag())
        library.vmmd_set_tag(number)
        try:
            yield
        finally:
            library.vmmd_set_tag(previous)

    def _check_awake(self, number: int, tag: str) -> None:
        if self.allocator.supply.asleep(number):
            raise VmmdError("ASLEEP", STATUS["FAILED_PRECONDITION"], f"tag {tag!r} is paused: resume it before allocating in its region")

    @contextlib.contextmanager
    def region(self, tag: str = DEFAULT_TAG, enable_cpu_backup: bool = False) -> Iterator[None]:
        """Tensors made inside live in vmmd memory of `tag` and pause with it:
        their contents are kept in the daemon's host memory when
        `enable_cpu_backup`, else dropped. Raises VmmdError BAD_TAG, ASLEEP."""
        import torch

        number = self._number(tag, bool(enable_cpu_backup))
        self._check_awake(number, tag)
        device = torch.cuda.current_device()
        with torch.cuda.use_mem_pool(self._mem_pool(number, device)), self._tagged(number):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph: Any, pool: Any = None, stream: Any = None, capture_error_mode: str = "global", tag: str = DEFAULT_TAG, enable_cpu_backup: bool = False) -> Iterator[None]:
        """torch.cuda.graph, with the graph's memory pool in vmmd memory of
        `tag` (the tag's MemPool unless `pool` is given), so that pausing the
        tag gives the graph's memory back too; the graph replays after resume.
        Raises VmmdError BAD_TAG, ASLEEP."""
        import torch

        number = self._number(tag, bool(enable_cpu_backup))
        self._check_awake(number, tag)
        device = torch.cuda.current_device()
        mem_pool = self._mem_pool(number, device, graph=True)
        # Room before capture: the refill thread's driver calls must not run while the stream captures.
        supply = self.allocator.supply
        supply.add(device, 1, number)
        supply.captures += 1
        try:
            with self._tagged(number), torch.cuda.graph(cuda_graph, pool=pool if pool is not None else mem_pool.id, stream=stream, capture_error_mode=capture_error_mode):
                yield
        finally:
            supply.captures -= 1

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Tensors made inside are outside every region (PyTorch's own memory), as torch_memory_saver's disable()."""
        import torch

        with self._tagged(0), torch.cuda.use_mem_pool(torch.cuda.MemPool()):
            yield

    def _selected(self, tag: Optional[str]) -> List[Tuple[str, bool, int]]:
        if tag is not None:
            check_tag(tag)
        with self._lock:
            return [(name, backup, number) for (name, backup), number in self._numbers.items() if tag is None or name == tag]

    def pause(self, tag: Optional[str] = None, timeout: Optional[float] = None) -> None:
        """Gives the memory of `tag` (None: every tag) back to the daemon, every
        address kept: contents of regions with enable_cpu_backup offloaded, the
        rest dropped. All or nothing.
        Raises VmmdError ASLEEP (a selected tag is paused already; nothing done), OUT_OF_MEMORY."""
        self._sleep(self._selected(tag), lambda name, backup: _sleep.OFFLOAD if backup else _sleep.DISCARD, strict=True)

    def resume(self, tag: Optional[str] = None, timeout: Optional[float] = None) -> None:
        """Maps memory again at every address of `tag` (None: every tag), asked
        of the daemon in one request; offloaded contents are copied back.
        `timeout`: how long the daemon may queue the request for memory that
        another process's sleep frees.
        Raises VmmdError NOT_ASLEEP (a selected tag is not paused; nothing done), OUT_OF_MEMORY (still paused)."""
        selected = self._selected(tag)
        awake = [name for name, _, number in selected if not self.allocator.supply.asleep(number)]
        if awake:
            raise VmmdError("NOT_ASLEEP", STATUS["FAILED_PRECONDITION"], f"tag {awake[0]!r} is not paused: nothing was resumed")
        self.allocator.supply.wake([number for _, _, number in selected], timeout)

    def _sleep(self, selected: Sequence[Tuple[str, bool, int]], mode_of: Any, strict: bool) -> List[int]:
        supply = self.allocator.supply
        asleep = [name for name, _, number in selected if supply.asleep(number)]
        if asleep and strict:
            raise VmmdError("ASLEEP", STATUS["FAILED_PRECONDITION"], f"tag {asleep[0]!r} is paused already: nothing was paused")
        done: List[int] = []
        try:
            for name, backup, number in selected:
                if not supply.asleep(number):
                    supply.sleep(number, mode_of(name, backup))
                    done.append(number)
        except BaseException:
            if done:
                supply.wake(done)
            raise
        return done

    # -- vLLM's sleep mode ---------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep: level 1 offloads the "weights" tag to the daemon's
        host memory and discards everything else; level 2 discards everything.
        Tags asleep already stay as they are.
        Raises VmmdError BAD_SLEEP_MODE (another level), OUT_OF_MEMORY."""
        if level not in (1, 2):
            raise VmmdError("BAD_SLEEP_MODE", STATUS["INVALID_ARGUMENT"], f"sleep level {level!r}: level 1 offloads the weights and discards the rest, level 2 discards everything")
        self._sleep(self._selected(None), lambda name, backup: _sleep.OFFLOAD if level == 1 and name == WEIGHTS_TAG else _sleep.DISCARD, strict=False)

    def wake_up(self, tags: Optional[Sequence[str]] = None, timeout: Optional[float] = None) -> None:
        """vLLM's wake_up: wakes the asleep memory of `tags` (None: all), in one
        request to the daemon; tags awake are left as they are.
        Raises VmmdError BAD_TAG, OUT_OF_MEMORY (still asleep)."""
        names = None if tags is None else {check_tag(tag) for tag in tags}
        numbers = [number for name, _, number in self._selected(None) if (names is None or name in names) and self.allocator.supply.asleep(number)]
        if numbers:
            self.allocator.supply.wake(numbers, timeout)

    @contextlib.contextmanager
    def use_memory_pool(self, tag: str = DEFAULT_TAG) -> Iterator[None]:
        """vLLM's CuMemAllocator.use_memory_pool: a region of `tag` (sleep() decides what is kept)."""
        with self.region(tag):
            yield
