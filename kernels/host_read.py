"""The host's read bandwidth, measured the way decode's CPU experts read their weights: every core summing its own
rows of one large array (a STREAM-style read). The ceiling `glm5 bench` and bench/bench_experts.py quote decode
against. Reference: numpy's sum of the same array (the value, not the speed)."""

import time

import numpy as np
from numba import njit, prange


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def read_sum(a):
    total = 0.0
    for i in prange(a.shape[0]):
        acc = np.float32(0.0)
        for j in range(a.shape[1]):
            acc += a[i, j]
        total += acc
    return total


def read_bandwidth_gb_s(n_bytes: int = 4 << 30, repeats: int = 5) -> float:
    """A parallel sum over n_bytes of fp32 on every core numba uses: GB/s of the best of `repeats`."""
    a = np.ones((max(1, n_bytes // 4 // 65536), 65536), np.float32)
    read_sum(a[:2])  # compiled (or loaded from numba's cache) first
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        read_sum(a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9
