"""The GPU waiting, inside a CUDA graph, for a signal the host gives in pinned memory.

Decode from graphs (runtime/decode_graphs.py) replays a MoE layer's next piece before the CPU experts it reads are
done, so that the graph's launch (tens of microseconds of host time) happens while the GPU still runs the piece
before; the piece starts with `wait`, which holds the stream until the host has given its signal, after writing the
experts' sum. A signal is a count: the host's `given` in pinned memory against the device's `waited` (a graph replays
the same kernel every step, so what it waits for lives in memory, not in its arguments).

Reference: `wait_reference`, the count the kernel keeps, on the host.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _wait_kernel(given_ptr, waited_ptr):
    # given: pinned host int64, the signals the host has given; waited: device int64, the signals waited for
    target = tl.load(waited_ptr) + 1
    while tl.load(given_ptr, volatile=True) < target:  # a read of host memory over PCIe each time
        pass
    tl.store(waited_ptr, target)


def wait_reference(given: torch.Tensor, waited: torch.Tensor):
    """What the kernel does once the signal is there: one more signal waited for."""
    assert int(given[0]) > int(waited[0]), "the host has not given this signal"
    waited += 1


class HostSignal:
    def __init__(self, device: torch.device):
        self.given = torch.zeros(1, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._given = self.given.numpy()  # written through numpy: 0.2 us a signal, torch's indexing 5 us
        self.waited = torch.zeros(1, dtype=torch.int64, device=device)

    def wait(self):
        """Queue, on the current stream (or into the graph being captured), a wait for the next signal."""
        _wait_kernel[(1,)](self.given, self.waited)

    def give(self):
        """The next signal: whatever the host wrote before is there for the work queued after its wait."""
        self._given[0] += 1

    def release(self):
        """After a step given up half way (an error, Ctrl-C): every wait queued lets go, then both counts agree again
        (the waits let go read whatever the host buffers hold: that step's results are void)."""
        self.given[0] = 1 << 62
        torch.cuda.synchronize(self.waited.device)
        self.given[0] = int(self.waited[0])
