"""Where a decode step's time goes: named spans, timed only while a Timeline is active (`glm5 bench`).

Operators mark their parts with `with span("attention", device): ...`; outside a Timeline a span costs one
global lookup. Inside one, a span synchronises its device's current stream at both ends, so on a GPU it
measures the work itself, not the host's enqueueing of it; the price is that the host and the GPU do not
overlap while a split is taken, and `glm5 bench` times speed in separate, unmarked steps. Side streams go
on across span edges: the expert ring's copies of the next layer run under the attention's span, as they do
unmarked, and what the compute stream waits for of them lands in the span that waits.
"""

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

_active: "Timeline | None" = None


class Timeline:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def __enter__(self):
        global _active
        _active = self
        return self

    def __exit__(self, *exc):
        global _active
        _active = None


def is_active() -> bool:
    return _active is not None


def _sync(device):
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@contextmanager
def span(name: str, device=None):
    """Time the block under `name` in the active Timeline (device: the one whose work it queues)."""
    timeline = _active
    if timeline is None:
        yield
        return
    _sync(device)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _sync(device)
        timeline.seconds[name] += time.perf_counter() - t0
