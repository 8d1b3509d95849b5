"""Routed experts streamed from host memory to a GPU ahead of their use (the long prefill chunks of experts.numba).

Each expert's packed arrays are queued to one of `depth` device slots on a copy stream of its own, while the
calling thread queues the matmuls: the compute stream waits for a slot's arrival, the copy stream for
the slot's release by the compute stream before it overwrites it. Up to `depth` experts are in flight, so the
transfers run under the matmuls of the experts before them and back to back. One ring per GPU, expert shape and
depth serves every layer: as a layer's last matmuls release their slots, the next layer's first experts
(prefetch) already move in, under that layer's attention.

The experts' host memory (the cache read into mappings of their own, or its memory maps) is page-locked
(registered with CUDA) the first time a ring streams it, so each transfer is one DMA straight from it at the bus's
speed, queued by the calling thread itself, and no host core copies anything. Memory the driver refuses to lock,
or all of it with `pin=False`, goes through PINNED pinned buffers instead, copied into by the staging thread
(torch's threaded copy; 13-35 GB/s on the H200 machine's host against a 55 GB/s bus).
"""

import ctypes
import logging
import mmap
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

DEPTH = 8  # experts on the device at once: in flight or being computed
PINNED = 3  # host staging buffers
_ALIGN = 256
_PAGE = 4096
_READ_ONLY = 8  # cudaHostRegisterReadOnly: the cache is mapped read-only
_MAPPED = 2  # cudaHostRegisterMapped: kernels read it in place too (kernels/experts_from_host.py)

_rings: dict[tuple, "ExpertRing"] = {}
_locked: dict[int, bool] = {}  # a memory map's address -> whether CUDA page-locked it
_locking = threading.RLock()  # a collection inside page_locked may free a map (_forget)
log = logging.getLogger("glm5_offload")


def _cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library torch runs on (found among the process's mappings), or None."""
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "/libcudart" in line})
    return ctypes.CDLL(paths[0]) if paths else None


def page_locked(array: np.ndarray) -> bool:
    """Whether the pages of `array`, memory in a mapping of its own (np.memmap, checkpoint.read_into_memory's), are
    locked for DMA; the first call asks CUDA to lock them (their whole pages; a page not yet read is read first)
    until the array is freed. Anything else stays pageable: an array in the heap may share its pages with another.
    A refusal is logged once per array and clears the runtime's error, which would otherwise surface at torch's
    next kernel launch."""
    if not _own_mapping(array) or array.nbytes == 0:
        return False
    address = array.ctypes.data
    with _locking:
        if address not in _locked:
            runtime = _cuda_runtime()
            start = address // _PAGE * _PAGE
            size = -(-(address + array.nbytes) // _PAGE) * _PAGE - start
            err = -1 if runtime is None else runtime.cudaHostRegister(ctypes.c_void_p(start), ctypes.c_size_t(size),
                                                                      ctypes.c_uint(_READ_ONLY | _MAPPED))
            if err and runtime is not None:
                runtime.cudaGetLastError()
            if err:
                log.warning("experts' host memory (%s at %#x) not page-locked (CUDA error %s): staged through pinned "
                            "buffers instead", f"{array.nbytes / 2**20:.0f} MiB", address,
                            "no runtime found" if runtime is None else err)
            _locked[address] = not err
            # forgotten (and unlocked) with the array, before its pages are unmapped: a later map at this address, or
            # a copy from it, must not find them still registered (CUDA refuses those: "resource already mapped")
            weakref.finalize(array, _forget, runtime if not err else None, start, address)
        return _locked[address]


def _own_mapping(array: np.ndarray) -> bool:
    """Whether array's memory lies in an mmap of its own (at the root of its chain of views)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    base = array.base.obj if isinstance(array.base, memoryview) else array.base  # np.frombuffer's: a memoryview
    return isinstance(base, mmap.mmap)


def _forget(runtime: ctypes.CDLL | None, start: int, address: int):
    with _locking:
        if runtime is not None:
            runtime.cudaHostUnregister(ctypes.c_void_p(start))
            runtime.cudaGetLastError()  # at exit the runtime may be gone already: nothing to surface later
        _locked.pop(address, None)


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def views(block: torch.Tensor, layout: dict) -> dict[str, torch.Tensor]:
    """The arrays of `layout` ({name: (shape, dtype, offset, nbytes)}) as views into a uint8 block."""
    return {n: block[o : o + b].view(d).view(s) for n, (s, d, o, b) in layout.items()}


class ExpertRing:
    """`depth` device slots for one expert's arrays, PINNED host buffers, a copy stream and a staging thread.
    `queue` holds the experts staged and not yet handed out: (stage number, layer, expert, slot, arrival).
    pin: lock the experts' memory maps and transfer from them (else always through the pinned buffers)."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device, depth: int,
                 pin: bool = True):
        self.layout, size = {}, 0
        for name, (shape, dtype) in shapes.items():
            nbytes = int(np.prod(shape)) * dtype.itemsize
            self.layout[name] = (shape, dtype, size, nbytes)
            size += -(-nbytes // _ALIGN) * _ALIGN
        self.depth, self.pin = depth, pin
        self.copies = torch.cuda.Stream(device)
        self.pinned = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(PINNED)]
        self.slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(depth)]
        self.slot_views = [views(slot, self.layout) for slot in self.slots]  # made once: a view costs the host ~5 us
        self.pinned_read: list[torch.cuda.Event | None] = [None] * PINNED  # the copy that last read each buffer
        self.slot_free: list[torch.cuda.Event | None] = [None] * depth  # the compute stream done with each slot
        self.staged = 0
        self.queue: deque[tuple[int, object, int, int, Future]] = deque()
        # torch's copies use as many threads there as on the caller's (OpenMP's count is per thread)
        self.stager = ThreadPoolExecutor(1, thread_name_prefix="expert-ring", initializer=torch.set_num_threads,
                                         initargs=(torch.get_num_threads(),))

    @staticmethod
    def on(device: torch.device, arrays: dict[str, np.ndarray], depth: int = DEPTH, pin: bool = True) -> "ExpertRing":
        """The ring of `device` with `depth` slots for experts shaped like `arrays` ({name: [E, ...]})."""
        shapes = {n: (tuple(a.shape[1:]), torch_dtype(a.dtype)) for n, a in arrays.items()}
        key = (device, tuple(shapes.items()), depth, pin)
        if key not in _rings:
            _rings[key] = ExpertRing(shapes, device, depth, pin)
        return _rings[key]

    def _copy(self, arrays: dict[str, np.ndarray], e: int, p: int, s: int) -> torch.cuda.Event:
        """Expert e queued to slot s, from its page-locked arrays (direct) or through pinned buffer p (on the staging
        thread); the event of its arrival."""
        direct = self._direct(arrays)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only memory map: torch only reads it
            expert = {name: torch.from_numpy(a[e]) for name, a in arrays.items()}
            if not direct:
                if self.pinned_read[p] is not None:
                    self.pinned_read[p].synchronize()
                for name, buf in views(self.pinned[p], self.layout).items():
                    buf.copy_(expert[name])
        with torch.cuda.stream(self.copies):
            if self.slot_free[s] is not None:
                self.copies.wait_event(self.slot_free[s])
            if direct:
                for name, buf in self.slot_views[s].items():
                    buf.copy_(expert[name], non_blocking=True)
            else:
                self.slots[s].copy_(self.pinned[p], non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.copies)
        if not direct:
            self.pinned_read[p] = arrived
        return arrived

    def _direct(self, arrays: dict[str, np.ndarray]) -> bool:
        """Whether experts of `arrays` go to the device straight from their locked pages."""
        return self.pin and all(page_locked(a) for a in arrays.values())

    def _fill(self, layer, arrays: dict[str, np.ndarray], todo: Iterator[int], skip=frozenset()) -> None:
        """Queue experts drawn from `todo` (but those in `skip`) while a slot is free: stage number n takes slot
        n % depth, free once every expert staged before n - depth + 1 is handed out and released."""
        while not self.queue or self.queue[0][0] > self.staged - self.depth:
            e = next((e for e in todo if e not in skip), None)
            if e is None:
                return
            n, s, p = self.staged, self.staged % self.depth, self.staged % PINNED
            self.staged += 1
            if self._direct(arrays):  # only DMAs to queue: at once, on this thread
                arrival = Future()
                arrival.set_result(self._copy(arrays, e, p, s))
            else:
                arrival = self.stager.submit(self._copy, arrays, e, p, s)
            self.queue.append((n, layer, e, s, arrival))

    def prefetch(self, layer, arrays: dict[str, np.ndarray], experts: Iterable[int]) -> None:
        """Start moving `layer`'s first `experts` (as many as slots are free) before its stream() is called:
        their transfers then run under whatever the GPU does until then (the layer's attention)."""
        self._fill(layer, arrays, iter(experts))

    def staged_for(self, layer) -> set[int]:
        """The experts of `layer` staged (prefetched) and not yet handed out."""
        return {e for _, l, e, _, _ in self.queue if l is layer}

    def stream(self, layer, arrays: dict[str, np.ndarray],
               experts: Iterable[int]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Yield (e, expert e's arrays on the device), usable on the current stream: first the experts of `layer`
        prefetched, then each e of `experts` not among them, in order. Queue the work on one before asking for
        the next: its slot is then handed back to the copies. `experts` is drawn as far ahead as slots are free
        (depth items when none are prefetched) before the first yield. `layer` is any object naming the layer."""
        compute = torch.cuda.current_stream(self.copies.device)
        while self.queue and self.queue[0][1] is not layer:  # prefetched for a layer that ran elsewhere: dropped
            self.queue.popleft()
        prefetched, todo = self.staged_for(layer), iter(experts)
        while True:
            self._fill(layer, arrays, todo, prefetched)
            if not self.queue:
                return
            _, owner, e, s, arrival = self.queue.popleft()
            if owner is not layer:
                continue
            compute.wait_event(arrival.result())
            try:
                yield e, self.slot_views[s]
            finally:  # also when the caller stops early: what it queued on the slot is not overwritten
                self.slot_free[s] = torch.cuda.Event()
                self.slot_free[s].record(compute)
