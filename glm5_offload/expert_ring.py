"""Routed experts streamed from host memory to a GPU ahead of their use (the long prefill chunks of experts.numba).

Each expert's packed arrays go from the memory-mapped cache into one of two pinned staging buffers (torch's
threaded copy, on the calling thread), then on a copy stream of their own into one of DEPTH device slots. The
compute stream waits for a slot's arrival, the copy stream for the slot's release by the compute stream before
it overwrites it: up to DEPTH experts are in flight, so the transfers run under the matmuls of the experts
before them and after one another, not between them. One ring per GPU and expert shape serves every layer.
"""

from collections import deque
from collections.abc import Iterable, Iterator
import warnings

import numpy as np
import torch

DEPTH = 8  # experts on the device at once: in flight or being computed

_rings: dict[tuple, "ExpertRing"] = {}


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


class ExpertRing:
    """DEPTH device slots for one expert's arrays ({name: (shape, dtype)}), two pinned buffers, a copy stream."""

    def __init__(self, layout: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        self.copies = torch.cuda.Stream(device)
        self.pinned = [{n: torch.empty(s, dtype=d, pin_memory=True) for n, (s, d) in layout.items()} for _ in range(2)]
        self.slots = [{n: torch.empty(s, dtype=d, device=device) for n, (s, d) in layout.items()}
                      for _ in range(DEPTH)]
        self.pinned_read: list[torch.cuda.Event | None] = [None] * 2  # the copy that last read each pinned buffer
        self.slot_free: list[torch.cuda.Event | None] = [None] * DEPTH  # the compute stream done with each slot
        self.staged = 0

    @staticmethod
    def on(device: torch.device, arrays: dict[str, np.ndarray]) -> "ExpertRing":
        """The ring of `device` for experts shaped like `arrays` ({name: [E, ...]})."""
        layout = {n: (tuple(a.shape[1:]), torch_dtype(a.dtype)) for n, a in arrays.items()}
        key = (device, tuple(layout.items()))
        if key not in _rings:
            _rings[key] = ExpertRing(layout, device)
        return _rings[key]

    def stage(self, expert: dict[str, np.ndarray]) -> tuple[int, torch.cuda.Event]:
        """Queue one expert's arrays into the next slot: (the slot, the event of its arrival)."""
        p, s = self.staged % 2, self.staged % DEPTH
        self.staged += 1
        if self.pinned_read[p] is not None:
            self.pinned_read[p].synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only memory map: torch only reads it
            for name, array in expert.items():
                self.pinned[p][name].copy_(torch.from_numpy(array))  # threaded: 74 GB/s on the H200 host
        with torch.cuda.stream(self.copies):
            if self.slot_free[s] is not None:
                self.copies.wait_event(self.slot_free[s])
            for name, buf in self.pinned[p].items():
                self.slots[s][name].copy_(buf, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.copies)
        self.pinned_read[p] = arrived
        return s, arrived

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
            if (e := next(todo, None)) is not None:  # the slot released last round
                in_flight.append((e, *self.stage({n: a[e] for n, a in arrays.items()})))
            e, s, arrived = in_flight.popleft()
            compute.wait_event(arrived)
            try:
                yield e, self.slots[s]
            finally:  # also when the caller stops early: what it queued on the slot is not overwritten
                self.slot_free[s] = torch.cuda.Event()
                self.slot_free[s].record(compute)
