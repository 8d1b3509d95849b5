"""Small things every layer uses: sizes and their printing, count checks, the cache folder, device syncs, a GPU's
side stream (work beside the current stream's), and the named timing spans of `glm5 bench`.

Spans: operators mark their parts with `with span("attention", device): ...`; outside a Timeline a span costs
one global lookup. Inside one, a span synchronises its device's current stream at both ends, so on a GPU it
measures the work itself, not the host's enqueueing of it; the price is that the host and the GPU do not
overlap while a split is taken, and `glm5 bench` times speed in separate, unmarked steps. Side streams go on
across span edges: the expert ring's copies of the next layer run under the attention's span, as they do
unmarked, and what the compute stream waits for of them lands in the span that waits.
"""

import os
import re
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from .errors import Glm5Error

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, flag: str) -> int:
    """'24GiB', '512G' (binary), '80GB' (decimal), '1.5TiB' -> bytes; flag names the option or kwarg at fault."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise Glm5Error(f"{flag}: {text!r} is not a size such as 24GiB, 512G or 80GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def check_writable(folder: str | Path, what: str) -> None:
    """That a file can be made in folder, tried by making one: os.access passes root anywhere, and a folder found
    unwritable only when a context is saved costs the whole run. Else Glm5Error f"{what} (the reason)"."""
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise Glm5Error(f"{what} ({e.strerror})") from None


def human_bytes(n: int | float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def ranges(values: list[int]) -> str:
    """[0,1,2,6,10,11] -> '0-2,6,10-11'."""
    out, values = [], sorted(values)
    start = prev = values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(out)


def is_positive_int(value) -> bool:
    """A count (threads, tokens): an int >= 1; YAML's true/false are not numbers here."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def cache_dir() -> Path:
    """The user's cache folder for this project (the embedded tiny model, converted experts)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "glm5-offload"


def sync(device):
    """Wait for the work queued on a CUDA device's current stream (nothing to wait for on the CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()


_side_streams: dict[tuple[torch.device, int], "torch.cuda.Stream"] = {}


def side_stream(device: torch.device, index: int = 0) -> "torch.cuda.Stream":
    """Side stream `index` of a CUDA device (made at first use), for work beside its current stream's (and beside
    the other side streams')."""
    if (device, index) not in _side_streams:
        _side_streams[device, index] = torch.cuda.Stream(device)
    return _side_streams[device, index]


class Beside:
    """GPU work queued in `with beside:` goes to the device's side stream number `stream`, which first waits for what
    the current stream has queued; work queued after the block runs beside it until join() makes the current stream
    wait for it (or the current stream waits for an event recorded on `side`). Off a GPU, or with on=False, the block
    runs in order like any other code (`side` None).

    Safe for memory as used here: whatever the side stream allocates is freed into its own pool and given out again
    only to later work on it, which (every use waits for the current stream first) comes after every use of it.
    Meant for small tensors (a decode step's): a block of the side stream's pool is not reused by the current
    stream's allocations."""

    def __init__(self, device: torch.device, on: bool = True, stream: int = 0):
        self.side = side_stream(device, stream) if on and device.type == "cuda" else None
        self.main = torch.cuda.current_stream(device) if self.side is not None else None

    def __enter__(self):
        if self.side is not None:
            self.side.wait_stream(self.main)
            torch.cuda.set_stream(self.side)
        return self

    def __exit__(self, *exc):
        if self.side is not None:
            torch.cuda.set_stream(self.main)

    def join(self):
        if self.side is not None:
            self.main.wait_stream(self.side)


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


@contextmanager
def span(name: str, device=None):
    """Time the block under `name` in the active Timeline (device: the one whose work it queues)."""
    timeline = _active
    if timeline is None:
        yield
        return
    sync(device)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        sync(device)
        timeline.seconds[name] += time.perf_counter() - t0
