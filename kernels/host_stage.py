"""The CPU experts' inputs written into pinned host memory by one kernel.

A MoE layer with CPU experts hands the host its input rows (fp32), the chosen experts and their weights. Copied by
torch that is a cast kernel and three device-to-host copies, each a graph node of 1.5-2.5 us on the GPU's critical
path of a decode step (bench/RESULTS.md); here one program per row reads the three and writes them into the host's
pinned buffers in place (the GPU reaches pinned memory through its unified address; host_signal.py's wait reads it
the same way). The host reads them after an event recorded behind the kernel, as it did behind the copies.

Reference: torch's copies (`x.float()`, `ids`, `weights.float()`); the tests compare every byte.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _stage_kernel(x_ptr, ids_ptr, w_ptr, x_host_ptr, ids_host_ptr, w_host_ptr, N, K, BLOCK: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    # x [T, N] (any float dtype), ids [T, K] int64, w [T, K] (any float dtype), all contiguous -> x_host [T, N] fp32,
    # ids_host [T, K] int64, w_host [T, K] fp32; program: row
    t = tl.program_id(0).to(tl.int64)
    for n0 in range(0, N, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        tl.store(x_host_ptr + t * N + n, tl.load(x_ptr + t * N + n, mask=n < N).to(tl.float32), mask=n < N)
    k = tl.arange(0, BLOCK_K)
    tl.store(ids_host_ptr + t * K + k, tl.load(ids_ptr + t * K + k, mask=k < K), mask=k < K)
    tl.store(w_host_ptr + t * K + k, tl.load(w_ptr + t * K + k, mask=k < K).to(tl.float32), mask=k < K)


def stage(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, x_host: torch.Tensor, ids_host: torch.Tensor,
          w_host: torch.Tensor):
    """x [T, N], ids [T, K] int64, weights [T, K] -> x_host (fp32), ids_host (int64), w_host (fp32), host buffers of
    those shapes (pinned, for a GPU's x), queued on the current stream."""
    T, N = x.shape
    K = ids.shape[1]
    assert ids.dtype == ids_host.dtype == torch.int64 and x_host.dtype == w_host.dtype == torch.float32
    assert x_host.shape == x.shape and ids_host.shape == ids.shape == weights.shape == w_host.shape
    if T:
        _stage_kernel[(T,)](x.contiguous(), ids.contiguous(), weights.contiguous(), x_host, ids_host, w_host, N, K,
                            BLOCK=min(triton.next_power_of_2(N), 8192), BLOCK_K=triton.next_power_of_2(K),
                            num_warps=8)
