"""Absorbed MLA's two per-head products with kv_b_proj, read as stored (block-scaled FP8 or the compute dtype).

kv_b_proj's W [H * (nope + v), L] holds per head h the rows W_UK[h] [nope, L] then W_UV[h] [v, L]. Absorbed MLA
multiplies a decode step's queries and outputs by them:

    q_lat[s, h, :] = q_nope[s, h, :] @ W_UK[h]        [S, H, nope] -> [S, H, L]
    out[s, h, :]   = o[s, h, :] @ W_UV[h]^T           [S, H, L]    -> [S, H, v]

The reference (model/mla.py, Attention.absorb_query / absorb_output) dequantises the whole W to the compute dtype,
widens its two slices to fp32 and runs two batched matmuls: for GLM-5 that writes and reads ~60 MB a layer and
step. These kernels read W's bytes once, dequantise a tile in registers exactly as fp8_dequantize does (rounded to
the compute dtype), and multiply in fp32: the reference's values, up to the order of the fp32 sums.
One program: one head and a block of 128 output columns (q_lat) or of output rows (out), every query row at once. Up to
BROADCAST_ROWS query rows multiply and sum in registers; more take fp32 dots (padded to 16 rows, wasted on one).
ops/dsa_triton calls them for decode steps (up to linear_triton.DECODE_ROWS query rows, as the projections' GEMV).
"""

import torch
import triton
import triton.language as tl

from .fp8_bits import e4m3_to_f16, round_to_bf16

BROADCAST_ROWS = 4  # up to this many query rows multiply and sum in registers (32 x 128 products at most)


@triton.jit
def _weight_tile(w_ptr, ws_ptr, rows, row_ok, col_block, L, FP8: tl.constexpr, ROUND_BF16: tl.constexpr):
    """W[rows, 128 columns from col_block * 128] as fp32 (rows [R] of W [*, L]; one scale block's columns)."""
    cols = col_block * 128 + tl.arange(0, 128)
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * L + cols[None, :], mask=row_ok[:, None] & (cols < L)[None, :],
                other=0)
    if FP8:
        scale = tl.load(ws_ptr + (rows // 128) * tl.cdiv(L, 128) + col_block, mask=row_ok, other=0.0)
        w = e4m3_to_f16(w).to(tl.float32) * (scale * 256.0)[:, None]
        if ROUND_BF16:  # as fp8_dequantize writes it in a bf16 model
            w = round_to_bf16(w)
    return w.to(tl.float32)


@triton.jit
def _absorb_query_kernel(q_ptr, w_ptr, ws_ptr, out_ptr, S, H, L, NOPE: tl.constexpr, HEAD_ROWS: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, ROUND_BF16: tl.constexpr,
                         DOT: tl.constexpr):
    # q [S, H, NOPE] -> out [S, H, L] fp32; program (h, 128 columns of L)
    h, lb = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    cols = lb * 128 + tl.arange(0, 128)
    acc = tl.zeros((BLOCK_S, 128), tl.float32)
    for d0 in range(0, NOPE, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        w = _weight_tile(w_ptr, ws_ptr, h * HEAD_ROWS + d, d < NOPE, lb, L, FP8, ROUND_BF16)
        q = tl.load(q_ptr + (s[:, None] * H + h) * NOPE + d[None, :], mask=(s < S)[:, None] & (d < NOPE)[None, :],
                    other=0).to(tl.float32)
        if DOT:
            acc += tl.dot(q, w, input_precision="ieee")
        else:
            acc += tl.sum(q[:, :, None] * w[None, :, :], axis=1)
    tl.store(out_ptr + (s[:, None] * H + h) * L + cols[None, :], acc, mask=(s < S)[:, None] & (cols < L)[None, :])


@triton.jit
def _absorb_output_kernel(o_ptr, w_ptr, ws_ptr, out_ptr, S, H, L, V: tl.constexpr, NOPE: tl.constexpr,
                          HEAD_ROWS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, FP8: tl.constexpr,
                          ROUND_BF16: tl.constexpr, DOT: tl.constexpr):
    # o [S, H, L] fp32 -> out [S, H, V] fp32; program (h, BLOCK_V rows of W_UV[h])
    h, vb = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    acc = tl.zeros((BLOCK_S, BLOCK_V), tl.float32)
    for l0 in range(0, L, 128):
        cols = l0 + tl.arange(0, 128)
        w = _weight_tile(w_ptr, ws_ptr, h * HEAD_ROWS + NOPE + v, v < V, l0 // 128, L, FP8, ROUND_BF16)
        o = tl.load(o_ptr + (s[:, None] * H + h) * L + cols[None, :], mask=(s < S)[:, None] & (cols < L)[None, :],
                    other=0.0)
        if DOT:
            acc += tl.dot(o, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.sum(o[:, None, :] * w[None, :, :], axis=2)
    tl.store(out_ptr + (s[:, None] * H + h) * V + v[None, :], acc, mask=(s < S)[:, None] & (v < V)[None, :])


def _launch_args(weight: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype, S: int) -> tuple:
    """(weight's bytes, its scales or a placeholder, the kernels' shared constexprs) for S query rows."""
    fp8, dot = scales is not None, S > BROADCAST_ROWS
    w = weight.view(torch.uint8) if fp8 else weight
    meta = {"FP8": fp8, "ROUND_BF16": fp8 and dtype == torch.bfloat16, "DOT": dot,
            "BLOCK_S": max(16, triton.next_power_of_2(S)) if dot else triton.next_power_of_2(S)}
    return w, scales if fp8 else w, meta


def absorb_query(q_nope: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype,
                 head_rows: int) -> torch.Tensor:
    """q_nope [S, H, nope] through W_UK -> [S, H, L] fp32. weight: kv_b_proj's [H * head_rows, L], float8_e4m3fn
    with scales [cdiv(rows, 128), cdiv(L, 128)] fp32 (dequantised as to `dtype`), or dense with scales None."""
    S, H, nope = q_nope.shape
    L = weight.shape[1]
    out = torch.empty(S, H, L, dtype=torch.float32, device=q_nope.device)
    w, ws, meta = _launch_args(weight, scales, dtype, S)
    block_d = min(64 if meta["DOT"] else 32 // meta["BLOCK_S"], max(16, triton.next_power_of_2(nope)))
    _absorb_query_kernel[(H, triton.cdiv(L, 128))](q_nope.contiguous(), w, ws, out, S, H, L, NOPE=nope,
                                                    HEAD_ROWS=head_rows, BLOCK_D=block_d, num_warps=4, **meta)
    return out


def absorb_output(o: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype,
                  nope: int, head_rows: int) -> torch.Tensor:
    """o [S, H, L] fp32 through W_UV^T -> [S, H, v] fp32, v = head_rows - nope (weight and scales as absorb_query's)."""
    S, H, L = o.shape
    V = head_rows - nope
    out = torch.empty(S, H, V, dtype=torch.float32, device=o.device)
    w, ws, meta = _launch_args(weight, scales, dtype, S)
    block_v = min(64 if meta["DOT"] else 32 // meta["BLOCK_S"], max(16, triton.next_power_of_2(V)))
    _absorb_output_kernel[(H, triton.cdiv(V, block_v))](o.float().contiguous(), w, ws, out, S, H, L, V=V, NOPE=nope,
                                                         HEAD_ROWS=head_rows, BLOCK_V=block_v, num_warps=4, **meta)
    return out
