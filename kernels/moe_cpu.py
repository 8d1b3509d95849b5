"""Routed experts of one MoE layer on the CPU: numba kernels, weight formats, and their torch reference.

Formats (per expert, W13 = [gate; up] fused [2I, H], W2 = down [H, I]):
  bf16  uint16 bit patterns of bfloat16, no scales
  int8  int8 values, one fp32 scale per `group` consecutive inputs of a row (symmetric, q in [-127, 127])
  int4  two values per byte, one fp32 scale per group (symmetric, q in [-8, 7] stored as q + 8); in
        each group of G inputs, byte j holds input j in its low nibble and input j + G/2 in its high one
Activations stay fp32 and every product accumulates in fp32, so a kernel equals its reference on the
same quantised weights up to summation order.

The kernel is one call per layer and token batch: pairs (token, slot) are grouped by expert; phase 1
computes gate and up for every (expert, block of rows) in parallel, reading each weight row once for
all of that expert's tokens; phase 2 computes SiLU(gate) x up; phase 3 splits the output rows into
blocks, each thread summing every active expert's down rows of its block times the routing weight.
Both parallel phases have many more work items than cores, so all cores stay busy with 8 experts.
"""

import numba
import numpy as np
import torch
from numba import njit, prange

FORMATS = {"bf16": 0, "int8": 1, "int4": 2}
GROUP_SIZES = (32, 64, 128)
ROW_BLOCK = 32  # weight rows per work item
_FASTMATH = {"reassoc", "contract", "nsz"}  # reassociation lets LLVM vectorise the fp32 reductions


# ---------------------------------------------------------------- formats and their torch reference

def quantize(w: torch.Tensor, fmt: str, group: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """w [E, rows, cols] (any float dtype) -> (values, scales) as numpy arrays in the CPU format."""
    if fmt == "bf16":
        values = w.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
        return values, np.zeros((0,), np.float32)
    if group not in GROUP_SIZES or w.shape[-1] % group:
        raise ValueError(f"group size {group} must be one of {GROUP_SIZES} and divide {w.shape[-1]}")
    qmax = 127 if fmt == "int8" else 7
    grouped = w.float().reshape(*w.shape[:-1], -1, group)  # [E, rows, ngroups, group]
    scales = grouped.abs().amax(-1).clamp(min=1e-12) / qmax
    q = torch.round(grouped / scales[..., None]).clamp(-qmax - (fmt == "int4"), qmax).to(torch.int8)
    if fmt == "int8":
        return q.reshape(w.shape).numpy(), scales.numpy()
    nibbles = (q + 8).to(torch.uint8)
    half = group // 2
    packed = nibbles[..., :half] | (nibbles[..., half:] << 4)  # [E, rows, ngroups, half]
    return packed.reshape(*w.shape[:-1], -1).numpy(), scales.numpy()


def dequantize(values: np.ndarray, scales: np.ndarray, fmt: str, group: int = 128) -> torch.Tensor:
    """The fp32 weights [E, rows, cols] a format stands for (the reference the kernels are tested against)."""
    v = torch.from_numpy(np.ascontiguousarray(values))
    if fmt == "bf16":
        return v.view(torch.int16).view(torch.bfloat16).float()
    s = torch.from_numpy(np.ascontiguousarray(scales))
    if fmt == "int8":
        q = v.float().reshape(*v.shape[:-1], -1, group)
    else:
        packed = v.reshape(*v.shape[:-1], -1, group // 2).to(torch.int16)
        q = torch.cat([(packed & 15) - 8, (packed >> 4) - 8], dim=-1).float()
    return (q * s[..., None]).reshape(*v.shape[:-1], -1)


def moe_reference(x, w13, w2, ids, weights):
    """Plain torch: x [T, H] fp32, w13 [E, 2I, H], w2 [E, H, I] fp32, ids/weights [T, k] -> [T, H] fp32."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            gu = w13[e] @ x[t]
            out[t] += w * (w2[e] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    return out


# ---------------------------------------------------------------------------- the numba kernels

# Inner loops index slices from 0 (never `base + j`): numba's negative-index wrap-around on a computed
# index turns LLVM's vector loads into gathers, which made these loops 10x slower.

@njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _nibbles(byte):
    """A packed int4 byte -> (high, low) nibbles as fp32, split in fp32 arithmetic (exact below 256): integer
    masks and shifts on a uint8 would be widened to int64 by numba, four times the vector instructions."""
    b = np.float32(byte)
    high = np.floor(b * np.float32(0.0625))
    return high, b - np.float32(16.0) * high


@njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _row_f32(fmt, row, scales, group, buf):
    """One weight row (values row, scales [ngroups]) dequantised into buf (fp32, the row's length)."""
    if fmt == 0:
        bits = buf.view(np.uint32)
        for j in range(bits.shape[0]):
            bits[j] = np.uint32(row[j]) << np.uint32(16)
        return
    half = group // 2
    for g in range(buf.shape[0] // group):
        scale = scales[g]
        if fmt == 1:
            w, out = row[g * group : (g + 1) * group], buf[g * group : (g + 1) * group]
            for j in range(group):
                out[j] = np.float32(w[j]) * scale
        else:
            w = row[g * half : (g + 1) * half]
            lo, hi = buf[g * group : g * group + half], buf[g * group + half : (g + 1) * group]
            for j in range(half):
                high, low = _nibbles(w[j])
                lo[j] = (low - np.float32(8.0)) * scale
                hi[j] = (high - np.float32(8.0)) * scale


@njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _dot(a, b):
    acc = np.float32(0.0)
    for j in range(a.shape[0]):
        acc += a[j] * b[j]
    return acc


@njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _row_dot(fmt, row, scales, group, v, v_group_sums, buf):
    """row . v; int8 and int4 without writing the row out (int4's +8 offset comes off through v's group sums)."""
    if fmt == 0:
        _row_f32(fmt, row, scales, group, buf)
        return _dot(buf, v)
    acc = np.float32(0.0)
    half = group // 2
    for g in range(v.shape[0] // group):
        part = np.float32(0.0)
        if fmt == 1:
            w, x = row[g * group : (g + 1) * group], v[g * group : (g + 1) * group]
            for j in range(group):
                part += np.float32(w[j]) * x[j]
        else:
            w = row[g * half : (g + 1) * half]
            lo, hi = v[g * group : g * group + half], v[g * group + half : (g + 1) * group]
            for j in range(half):
                high, low = _nibbles(w[j])
                part += low * lo[j] + high * hi[j]
            part -= np.float32(8.0) * v_group_sums[g]
        acc += part * scales[g]
    return acc


@njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _rows_times(fmt, row, scales, group, vectors, sums, which, first, last, buf, out):
    """out[p] = row . vectors[which[p]] for p in first..last-1: one vector fused, more: the row dequantised once."""
    if last - first == 1:
        out[first] = _row_dot(fmt, row, scales, group, vectors[which[first]], sums[which[first]], buf)
        return
    _row_f32(fmt, row, scales, group, buf)
    for p in range(first, last):
        out[p] = _dot(buf, vectors[which[p]])


@njit(nogil=True, fastmath=_FASTMATH, cache=True)
def _group_sums(v, group):
    sums = np.empty((v.shape[0], v.shape[1] // group), np.float32)
    for i in range(v.shape[0]):
        for g in range(sums.shape[1]):
            sums[i, g] = v[i, g * group : (g + 1) * group].sum()
    return sums


@njit(parallel=True, nogil=True, fastmath=_FASTMATH, cache=True)
def moe_layer(fmt, group, w13, s13, w2, s2, x, pair_token, pair_weight, expert_ids, expert_start, gu, act, out):
    """One MoE layer's routed experts for T tokens, summed into out [T, H] (fp32, zeroed by the caller).

    x [T, H] fp32; pairs (token, slot) sorted by expert: pair_token [P] int32, pair_weight [P] fp32;
    expert_ids [A] int32 the active experts, expert_start [A+1] int32 their pair ranges;
    scratch gu [P, 2I], act [P, I] fp32.
    """
    hidden, rows13 = x.shape[1], w13.shape[1]
    inter = rows13 // 2
    n_active, n_pairs = expert_ids.shape[0], gu.shape[0]
    x_sums = _group_sums(x, group) if fmt == 2 else np.zeros((x.shape[0], 1), np.float32)
    blocks13 = (rows13 + ROW_BLOCK - 1) // ROW_BLOCK
    for item in prange(n_active * blocks13):  # gate and up: (expert, block of rows)
        a, block = item // blocks13, item % blocks13
        e = expert_ids[a]
        buf = np.empty(hidden, np.float32)
        dots = np.empty(n_pairs, np.float32)
        for r in range(block * ROW_BLOCK, min(rows13, (block + 1) * ROW_BLOCK)):
            _rows_times(fmt, w13[e, r], s13[e, r] if fmt else s13[0, 0], group, x, x_sums, pair_token,
                        expert_start[a], expert_start[a + 1], buf, dots)
            for p in range(expert_start[a], expert_start[a + 1]):
                gu[p, r] = dots[p]
    for p in prange(n_pairs):  # SiLU(gate) * up
        for i in range(inter):
            g = gu[p, i]
            act[p, i] = g / (np.float32(1.0) + np.exp(-g)) * gu[p, inter + i]
    act_sums = _group_sums(act, group) if fmt == 2 else np.zeros((n_pairs, 1), np.float32)
    pairs = np.arange(n_pairs).astype(np.int32)
    blocks2 = (hidden + ROW_BLOCK - 1) // ROW_BLOCK
    for block in prange(blocks2):  # down: each thread owns a block of output rows
        buf = np.empty(inter, np.float32)
        dots = np.empty(n_pairs, np.float32)
        for a in range(n_active):
            e = expert_ids[a]
            for r in range(block * ROW_BLOCK, min(hidden, (block + 1) * ROW_BLOCK)):
                _rows_times(fmt, w2[e, r], s2[e, r] if fmt else s2[0, 0], group, act, act_sums, pairs,
                            expert_start[a], expert_start[a + 1], buf, dots)
                for p in range(expert_start[a], expert_start[a + 1]):
                    out[pair_token[p], r] += pair_weight[p] * dots[p]


def group_by_expert(ids: np.ndarray, weights: np.ndarray):
    """ids/weights [T, k] -> pair_token, pair_weight, expert_ids, expert_start (see moe_layer)."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    experts, counts = np.unique(flat[order], return_counts=True)
    start = np.zeros(len(experts) + 1, np.int32)
    np.cumsum(counts, out=start[1:])
    pair_token = (order // ids.shape[1]).astype(np.int32)
    pair_weight = weights.reshape(-1)[order].astype(np.float32)
    return pair_token, pair_weight, experts.astype(np.int32), start


def moe_forward(fmt: str, group: int, w13, s13, w2, s2, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                threads: int | None = None) -> np.ndarray:
    """x [T, H] fp32, ids/weights [T, k] -> routed-expert output [T, H] fp32 (numba, all cores, no GIL)."""
    if threads:
        numba.set_num_threads(threads)
    pair_token, pair_weight, experts, start = group_by_expert(ids, weights)
    pairs = len(pair_token)
    gu = np.empty((pairs, w13.shape[1]), np.float32)
    act = np.empty((pairs, w13.shape[1] // 2), np.float32)
    out = np.zeros_like(x)
    # empty scales cannot be indexed; give the bf16 kernel a dummy of the right rank
    s13 = s13 if s13.ndim == 3 else np.zeros((1, 1, 1), np.float32)
    s2 = s2 if s2.ndim == 3 else np.zeros((1, 1, 1), np.float32)
    moe_layer(FORMATS[fmt], group, w13, s13, w2, s2, x, pair_token, pair_weight, experts, start, gu, act, out)
    return out
