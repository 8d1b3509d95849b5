"""Some of a decode token's routed experts computed by the GPU, their weights read where they lie in host memory.

A decode step's experts are bounded by how fast host memory is read. The cores are not the only reader: a GPU reads
page-locked host memory over PCIe in its kernels, at once with the cores. On the H100 machine the cores read 99 GB/s
alone; beside a GPU kernel reading pinned memory (51 GB/s alone), 81 and 50.5: together 1.33x the cores' alone
(bench/RESULTS.md, session 47). So the token's last few slots (of top-k) run here while the cores run the others.

The weights stay in the CPU's packed formats (formats/int_groups.py: bf16 bit patterns, int8 or int4 with one fp32
scale per group of a row's inputs; int4 byte j of a group holds input j in its low nibble, input j + G/2 in its high
one), [E, rows, packed cols] per matrix, read in place: each program reads rows of one expert in spans of a few
hundred bytes, dequantises them in registers and keeps fp32 sums; nothing is copied to the device first. With
`act_int8` the inputs of both projections are rounded as the CPU's int8 activations are (experts_triton), so a
token's sum does not depend on which experts ran where, up to fp32 rounding.

Reference: int_groups.dequantize, model.swiglu and int_groups.quantize_activations, in plain torch (the tests).
"""

import math

import numpy as np
import torch
import triton
import triton.language as tl

from ..formats.int_groups import BITS
from . import INTERPRET
from .experts_triton import round_activations, swiglu

FORMATS = {"bf16": 0, "int8": 1, "int4": 2}
# on a GPU, a program's rows, its warps and the bytes of a row it reads at once (bench_decode_split.py --tiles: on
# an H100 host, 3 experts' rows beside the cores' 5 took 1.375 ms at 4 x 4 x 4096, 1.397-1.443 at 8 x 4 x 512)
TILE = (4, 4, 4096)


@triton.jit
def _rows_kernel(x_ptr, ids_ptr, w_ptr, values_ptr, scales_ptr, out_ptr, first, slots, R, K, FMT: tl.constexpr,
                 G: tl.constexpr, NG: tl.constexpr, BLOCK_R: tl.constexpr, SUM: tl.constexpr):
    # values [E, R, K] (bf16 bits as int16, int8) or [E, R, K/2] uint8 (int4), scales [E, R, K/G] fp32 (int formats);
    # ids, w [k]: one token's experts and weights, slots first .. first + slots here; x [slots, K] fp32 (SUM) or
    # [K] -> out [R] = sum over the slots of w * (W_ids x_slot) (SUM), or [slots, R] = W_ids x per slot;
    # program: BLOCK_R rows of one slot's expert (axis 1), or of each slot's in turn (SUM)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    groups = K // G
    if SUM:
        j0, j1 = 0, slots
    else:
        j0 = tl.program_id(1)
        j1 = j0 + 1
    total = tl.zeros((BLOCK_R,), tl.float32)
    for j in range(j0, j1):
        e = tl.load(ids_ptr + first + j).to(tl.int64)
        x_row = x_ptr + (j * K if SUM else 0)
        acc = tl.zeros((BLOCK_R,), tl.float32)
        for g0 in range(0, groups, NG):
            ng = g0 + tl.arange(0, NG)
            g_ok = ng < groups
            ok = r_ok[:, None, None] & g_ok[None, :, None]
            if FMT == 2:  # int4: [BLOCK_R, NG, G/2] bytes, the low nibbles inputs 0 .. G/2 of each group
                b = tl.arange(0, G // 2)
                at = e * R * (K // 2) + r[:, None, None] * (K // 2) + ng[None, :, None] * (G // 2) + b[None, None, :]
                packed = tl.load(values_ptr + at, mask=ok, other=0x88).to(tl.int32)  # masked: 0, 0
                x_at = ng[:, None] * G + b[None, :]
                x_lo = tl.load(x_row + x_at, mask=g_ok[:, None], other=0.0)
                x_hi = tl.load(x_row + x_at + G // 2, mask=g_ok[:, None], other=0.0)
                dots = tl.sum(((packed & 15) - 8).to(tl.float32) * x_lo[None, :, :]
                              + ((packed >> 4) - 8).to(tl.float32) * x_hi[None, :, :], axis=2)
            else:
                b = tl.arange(0, G)
                at = e * R * K + r[:, None, None] * K + ng[None, :, None] * G + b[None, None, :]
                q = tl.load(values_ptr + at, mask=ok, other=0)
                if FMT == 0:  # bf16 bit patterns: the high half of an fp32
                    w = ((q.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
                else:
                    w = q.to(tl.float32)
                x_g = tl.load(x_row + ng[:, None] * G + b[None, :], mask=g_ok[:, None], other=0.0)
                dots = tl.sum(w * x_g[None, :, :], axis=2)
            if FMT == 0:
                acc += tl.sum(dots, axis=1)
            else:  # [BLOCK_R, NG]: each group's dot by its row's scale
                s_at = e * R * groups + r[:, None] * groups + ng[None, :]
                scale = tl.load(scales_ptr + s_at, mask=r_ok[:, None] & g_ok[None, :], other=0.0)
                acc += tl.sum(dots * scale, axis=1)
        if SUM:
            total += acc * tl.load(w_ptr + first + j).to(tl.float32)
        else:
            total = acc
    tl.store(out_ptr + (0 if SUM else j0 * R) + r, total, mask=r_ok)


def host_matrices(w13: np.ndarray, s13: np.ndarray, w2: np.ndarray, s2: np.ndarray) -> tuple:
    """A layer's packed arrays as routed_from_host takes them: tensors over the same memory (bf16 bit patterns as
    int16, which Triton reads anywhere), None for bf16's empty scales."""
    return tuple(torch.from_numpy(a.view(np.int16) if a.dtype == np.uint16 else a) if a.size else None
                 for a in (w13, s13, w2, s2))


def _rows(x, ids, weights, values, scales, out, first, slots, fmt, group, summed):
    R, K = values.shape[1], x.shape[-1]
    if fmt == "bf16":  # no scales: any power of two dividing the inputs spans them
        group = math.gcd(K, 128)
    block_r, warps, span = TILE
    block_r = 64 if INTERPRET else block_r  # the interpreter's cost is per program
    ng = max(1, span * 8 // (group * BITS[fmt]))  # groups a program reads of a row at once
    grid = (triton.cdiv(R, block_r), 1 if summed else slots)
    _rows_kernel[grid](x, ids, weights, values, values if scales is None else scales, out, first, slots, R, K,
                       FMT=FORMATS[fmt], G=group, NG=triton.next_power_of_2(ng), BLOCK_R=block_r, SUM=summed,
                       num_warps=warps)


def routed_from_host(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, first: int,
                     matrices: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None], fmt: str,
                     group: int, act_int8: bool, limit: float | None) -> torch.Tensor:
    """One token's routed experts of slots first .. k - 1, on x's device: x [1, H], ids / weights [1, k] (int64 /
    any float) on it; matrices (w13 [E, 2I, H packed], s13, w2 [E, H, I packed], s2; scales None for bf16) as
    host_matrices gives them, in memory the device reads (page-locked host memory; any under the interpreter)
    -> [1, H] fp32 = sum over those slots s of weights[s] * expert_ids[s](x): gate and up, SwiGLU (clamped by limit
    where given), down."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if x.shape[0] != 1 or ids.shape[0] != 1 or not 0 <= first < ids.shape[1]:
        raise ValueError(f"one token and a slot of its {ids.shape[1]} to start from, got x {tuple(x.shape)}, first "
                         f"{first}")
    w13, s13, w2, s2 = matrices
    slots, hidden = ids.shape[1] - first, x.shape[1]
    x = x.float().contiguous()
    if act_int8:
        x = round_activations(x, group)
    gate_up = torch.empty(slots, w13.shape[1], dtype=torch.float32, device=x.device)
    ids, weights = ids.contiguous(), weights.contiguous()
    _rows(x, ids, weights, w13, s13, gate_up, first, slots, fmt, group, summed=False)
    act = swiglu(gate_up, limit, group, act_int8)  # [slots, I] fp32
    out = torch.empty(1, hidden, dtype=torch.float32, device=x.device)
    _rows(act, ids, weights, w2, s2, out, first, slots, fmt, group, summed=True)
    return out


class GraphedSlots:
    """A token's last n slots by routed_from_host, captured in a CUDA graph over static inputs, as a decode step
    replays them (no launches on the host): choose() the token, replay(), then out [1, H] fp32 holds their sum."""

    def __init__(self, matrices: tuple, fmt: str, group: int, act_int8: bool, limit: float | None, top_k: int, n: int):
        hidden = matrices[2].shape[1]  # w2 [E, H, I packed]
        self.x = torch.zeros(1, hidden, device="cuda")
        self.ids = torch.zeros(1, top_k, dtype=torch.int64, device="cuda")
        self.weights = torch.zeros(1, top_k, device="cuda")
        run = lambda: routed_from_host(self.x, self.ids, self.weights, top_k - n, matrices, fmt,  # noqa: E731
                                       group, act_int8, limit)
        run()  # compiled before the capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = run()

    def choose(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray):
        """The token's input [1, H], experts and weights [1, top_k], here before the next replay."""
        for dst, src in ((self.x, x), (self.ids, ids), (self.weights, weights)):
            dst.copy_(torch.from_numpy(src))
        torch.cuda.synchronize()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out
