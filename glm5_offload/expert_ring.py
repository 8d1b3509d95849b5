"""Routed experts streamed from host memory to a GPU ahead of their use (the long prefill chunks of experts.numba).

A staging thread copies each expert's packed arrays from the memory-mapped cache into one of PINNED pinned
buffers (torch's threaded copy) and queues that buffer's copy to one of DEPTH device slots on a copy stream of
its own, while the calling thread queues the matmuls: the compute stream waits for a slot's arrival, the copy
stream for the slot's release by the compute stream before it overwrites it. Up to DEPTH experts are in
flight, so the transfers run under the matmuls of the experts before them and back to back, and the host's
copies under the host's kernel launches. An expert's arrays lie in one block (one transfer each). One ring per
GPU and expert shape serves every layer.
"""

import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

DEPTH = 8  # experts on the device at once: in flight or being computed
PINNED = 3  # host staging buffers
_ALIGN = 256

_rings: dict[tuple, "ExpertRing"] = {}


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def views(block: torch.Tensor, layout: dict) -> dict[str, torch.Tensor]:
    """The arrays of `layout` ({name: (shape, dtype, offset, nbytes)}) as views into a uint8 block."""
    return {n: block[o : o + b].view(d).view(s) for n, (s, d, o, b) in layout.items()}


class ExpertRing:
    """DEPTH device slots for one expert's arrays, PINNED host buffers, a copy stream and a staging thread."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        self.layout, size = {}, 0
        for name, (shape, dtype) in shapes.items():
            nbytes = int(np.prod(shape)) * dtype.itemsize
            self.layout[name] = (shape, dtype, size, nbytes)
            size += -(-nbytes // _ALIGN) * _ALIGN
        self.copies = torch.cuda.Stream(device)
        self.pinned = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(PINNED)]
        self.slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(DEPTH)]
        self.pinned_read: list[torch.cuda.Event | None] = [None] * PINNED  # the copy that last read each buffer
        self.slot_free: list[torch.cuda.Event | None] = [None] * DEPTH  # the compute stream done with each slot
        self.staged = 0
        # torch's copies use as many threads there as on the caller's (OpenMP's count is per thread)
        self.stager = ThreadPoolExecutor(1, thread_name_prefix="expert-ring", initializer=torch.set_num_threads,
                                         initargs=(torch.get_num_threads(),))

    @staticmethod
    def on(device: torch.device, arrays: dict[str, np.ndarray]) -> "ExpertRing":
        """The ring of `device` for experts shaped like `arrays` ({name: [E, ...]})."""
        shapes = {n: (tuple(a.shape[1:]), torch_dtype(a.dtype)) for n, a in arrays.items()}
        key = (device, tuple(shapes.items()))
        if key not in _rings:
            _rings[key] = ExpertRing(shapes, device)
        return _rings[key]

    def _copy(self, expert: dict[str, np.ndarray], p: int, s: int) -> torch.cuda.Event:
        """On the staging thread: expert into pinned buffer p, then queued to slot s; the event of its arrival."""
        if self.pinned_read[p] is not None:
            self.pinned_read[p].synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only memory map: torch only reads it
            for name, buf in views(self.pinned[p], self.layout).items():
                buf.copy_(torch.from_numpy(expert[name]))
        with torch.cuda.stream(self.copies):
            if self.slot_free[s] is not None:
                self.copies.wait_event(self.slot_free[s])
            self.slots[s].copy_(self.pinned[p], non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.copies)
        self.pinned_read[p] = arrived
        return arrived

    def stage(self, expert: dict[str, np.ndarray]) -> tuple[int, Future]:
        """Hand one expert's arrays to the staging thread: (its slot, a future of its arrival event)."""
        p, s = self.staged % PINNED, self.staged % DEPTH
        self.staged += 1
        return s, self.stager.submit(self._copy, expert, p, s)

    def stream(self, arrays: dict[str, np.ndarray], experts: Iterable[int]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Yield (e, expert e's arrays on the device) for each e in order, usable on the current stream. Queue the
        work on one before asking for the next: its slot is then handed back to the copies. `experts` is drawn
        DEPTH - 1 ahead: the first DEPTH - 1 before the first yield."""
        compute = torch.cuda.current_stream(self.copies.device)
        todo, in_flight = iter(experts), deque()
        for _ in range(DEPTH - 1):
            if (e := next(todo, None)) is not None:
                in_flight.append((e, *self.stage({n: a[e] for n, a in arrays.items()})))
        while in_flight:
            if (e := next(todo, None)) is not None:  # into the slot released last round
                in_flight.append((e, *self.stage({n: a[e] for n, a in arrays.items()})))
            e, s, arrival = in_flight.popleft()
            compute.wait_event(arrival.result())
            try:
                yield e, views(self.slots[s], self.layout)
            finally:  # also when the caller stops early: what it queued on the slot is not overwritten
                self.slot_free[s] = torch.cuda.Event()
                self.slot_free[s].record(compute)
