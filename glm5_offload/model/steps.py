"""A forward pass as a list of steps on the pass's state, so that CUDA-graph decode (runtime/decode_graphs.py)
replays the very steps the model's own forward runs: one forward to change.

A step is a callable of a Pass. Two markers cut the list where the host takes part:
  CUT        the host's next wait covers the GPU work queued before this point only (a MoE block's routing and
             its input's copy to the host), so what comes after it (the shared expert) runs while the host works
  HostStep   work the host does between GPU steps (the CPU experts); it reads and writes only host buffers that
             stay put from step to step, so a replayed graph feeds it and takes its result
Run eagerly (run_steps) the markers are plain: CUT does nothing and a HostStep is called in its turn.
"""

from collections.abc import Callable

import torch


class Pass:
    """One forward pass of S tokens: its inputs, the residual stream `x` (with `add`, its pending addition: a
    sublayer's output that the next norm adds in its own kernel), and what steps hand on to later ones
    (the rope angles, the last full layer's selection for IndexShare, a MoE block's routed work, the logits).
    Steps may set further attributes of their own."""

    def __init__(self, tokens: torch.Tensor, positions: torch.Tensor, end: int, cache, last_only: bool = False):
        self.tokens = tokens  # [S] int64 on the residual stream's device
        self.positions = positions  # [S] int64 on the same device: cache.length .. +S-1
        self.end = end  # rows 0..end-1 of the cache may be read (>= positions[-1] + 1; masked past each position)
        self.cache = cache
        self.last_only = last_only  # logits of the last token only
        self.x = self.cos = self.sin = self.indices = self.logits = None
        self.add = ()  # the residual stream's pending addition: the stream is x + blocks.summed(add)


CUT = object()


class HostStep:
    def __init__(self, fn: Callable[[Pass], None]):
        self.fn = fn

    def __call__(self, s: Pass):
        self.fn(s)


def beside_host(steps: list, fork, join) -> list:
    """steps with `fork` put where the GPU runs beside the host's work, and `join` where that stretch ends: fork
    first after the CUT that the host waits on (in decode's graphs, the piece that runs while the CPU experts do,
    ahead of its own GPU work: the shared expert, the GPU's experts), join just before the first HostStep; both at
    the end of steps without one. For GPU work that later layers need and this layer's next steps do not: fork
    queues it on a side stream, which join may have the current stream wait for."""
    hosts = [i for i, t in enumerate(steps) if isinstance(t, HostStep)]
    at = hosts[0] if hosts else len(steps)
    cuts = [i for i, t in enumerate(steps[:at]) if t is CUT]
    start = cuts[-1] + 1 if cuts else at
    return steps[:start] + [fork] + steps[start:at] + [join] + steps[at:]


def run_steps(steps: list, s: Pass):
    """Run steps in order, eagerly."""
    for step in steps:
        if step is not CUT:
            step(s)
