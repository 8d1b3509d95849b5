"""Absorbed MLA's two per-head products with kv_b_proj, read as stored (block-scaled FP8 or the compute dtype).

kv_b_proj's W [H * (nope + v), L] holds per head h the rows W_UK[h] [nope, L] then W_UV[h] [v, L]. Absorbed MLA
multiplies a decode step's queries and outputs by them:

    q_lat[s, h, :] = q_nope[s, h, :] @ W_UK[h]        [S, H, nope] -> [S, H, L]
    out[s, h, :]   = o[s, h, :] @ W_UV[h]^T           [S, H, L]    -> [S, H, v]

The reference (model/mla.py, Attention.absorb_query / absorb_output) dequantises the whole W to the compute dtype,
widens its two slices to fp32 and runs two batched matmuls: for GLM-5 that writes and reads ~60 MB a layer and
step. These kernels read W's bytes once, dequantise a tile in registers exactly as fp8_dequantize does (rounded to
the compute dtype), and multiply in fp32: the reference's values, up to the order of the fp32 sums. A tile's
columns lie in one 128-column block of W's scales, so a row's scale is loaded once a tile (a load per value had cost
as many loads as the weights' bytes).
One program: one head and a block of 128 output columns (q_lat) or of output rows (out), every query row at once. Up to
BROADCAST_ROWS query rows (one, for the query's product) multiply in registers, the products summed once after the
loop; more take fp32 dots (padded to 16 rows, wasted on one).
ops/dsa_triton calls them for decode steps (up to linear_triton.DECODE_ROWS query rows, as the projections' GEMV).
"""

import torch
import triton
import triton.language as tl

from .fp8_bits import e4m3_to_f16, has_fp8_dot, round_to_bf16
from .rope_triton import pairs, rotated

# up to this many query rows multiply and sum in registers (32 x 128 products at most); absorb_query's 4 rows took
# 20.3 us so, 14.4 with dots (H100, bench/RESULTS.md session 51): one row there
BROADCAST_ROWS = {"query": 1, "output": 4}


@triton.jit
def _weight_tile(w_ptr, ws_ptr, rows, row_ok, col0, L, C: tl.constexpr, FP8: tl.constexpr, FP8_HW: tl.constexpr,
                 ROUND_BF16: tl.constexpr):
    """W[rows, col0 : col0 + C] as fp32 (rows [R] of W [*, L]; C divides 128 and col0 is a multiple of C: the columns
    lie in one 128-column block). FP8: each value times its 128 x 128 block's scale, loaded once a row (a load a
    value cost as many loads as the weights' bytes); FP8_HW: the GPU's conversions (sm89+), else bit arithmetic (the
    same values: the 1/256 of e4m3_to_f16 goes into the scale exactly)."""
    cols = col0 + tl.arange(0, C)
    ok = row_ok[:, None] & (cols < L)[None, :]
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * L + cols[None, :], mask=ok, other=0)
    if FP8:
        scale = tl.load(ws_ptr + (rows // 128) * tl.cdiv(L, 128) + col0 // 128, mask=row_ok, other=0.0)
        if FP8_HW:
            w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
            if ROUND_BF16:  # as fp8_dequantize writes it in a bf16 model (the GPU's cast rounds to nearest even)
                w = w.to(tl.bfloat16).to(tl.float32)
        else:
            w = e4m3_to_f16(w).to(tl.float32) * (scale * 256.0)[:, None]
            if ROUND_BF16:
                w = round_to_bf16(w)
    return w.to(tl.float32)


@triton.jit
def _out(acc, out_ptr, OUT_BF16: tl.constexpr):
    """fp32 products as out's dtype stores them: bf16 rounded to nearest even (by bits: the interpreter's casts
    truncate), as torch's cast of the fp32 result rounds."""
    if OUT_BF16:
        acc = round_to_bf16(acc)
    return acc.to(out_ptr.dtype.element_ty)


@triton.jit
def _absorb_query_kernel(q_ptr, w_ptr, ws_ptr, out_ptr, pe_ptr, cos_ptr, sin_ptr, pe_out_ptr, S, H, L, stride_s,
                         stride_h, NOPE: tl.constexpr, HEAD_ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, FP8: tl.constexpr, FP8_HW: tl.constexpr,
                         ROUND_BF16: tl.constexpr, DOT: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                         PE_BF16: tl.constexpr, OUT_BF16: tl.constexpr):
    # q [S, H, NOPE] (rows at stride_s / stride_h) -> out [S, H, L] fp32 or (OUT_BF16) bf16; program (h, BLOCK_C
    # columns of L).
    # HALF > 0: the first column block's programs also rope q_pe [S, H, 2 HALF] (q's strides; cos/sin [S, HALF]
    # fp32) into pe_out [S, H, 2 HALF] (rope_triton's rope: the same values)
    h, lb = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    cols = lb * BLOCK_C + tl.arange(0, BLOCK_C)
    if DOT:
        acc = tl.zeros((BLOCK_S, BLOCK_C), tl.float32)
    else:  # the products summed over d once, after the loop
        acc_d = tl.zeros((BLOCK_S, BLOCK_D, BLOCK_C), tl.float32)
    for d0 in tl.static_range(0, NOPE, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        w = _weight_tile(w_ptr, ws_ptr, h * HEAD_ROWS + d, d < NOPE, lb * BLOCK_C, L, BLOCK_C, FP8, FP8_HW,
                         ROUND_BF16)
        q = tl.load(q_ptr + s[:, None] * stride_s + h * stride_h + d[None, :],
                    mask=(s < S)[:, None] & (d < NOPE)[None, :], other=0).to(tl.float32)
        if DOT:
            acc += tl.dot(q, w, input_precision="ieee")
        else:
            acc_d += q[:, :, None] * w[None, :, :]
    if not DOT:
        acc = tl.sum(acc_d, axis=1)
    tl.store(out_ptr + (s[:, None] * H + h) * L + cols[None, :], _out(acc, out_ptr, OUT_BF16),
             mask=(s < S)[:, None] & (cols < L)[None, :])
    if HALF > 0:
        if lb == 0:
            i = tl.arange(0, HALF)[None, :]
            row_ok = (s < S)[:, None]
            c = tl.load(cos_ptr + s[:, None] * HALF + i, mask=row_ok, other=0.0)
            sn = tl.load(sin_ptr + s[:, None] * HALF + i, mask=row_ok, other=0.0)
            x1, x2 = pairs(pe_ptr + s[:, None] * stride_s + h * stride_h, i, row_ok, HALF, INTERLEAVED)
            first, second = rotated(x1, x2, c, sn, PE_BF16)
            dst = pe_out_ptr + (s[:, None] * H + h) * (2 * HALF)
            tl.store(dst + i, first.to(pe_out_ptr.dtype.element_ty), mask=row_ok)
            tl.store(dst + HALF + i, second.to(pe_out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _absorb_output_kernel(o_ptr, w_ptr, ws_ptr, out_ptr, S, H, L: tl.constexpr, V: tl.constexpr, NOPE: tl.constexpr,
                          HEAD_ROWS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_L: tl.constexpr,
                          FP8: tl.constexpr, FP8_HW: tl.constexpr, ROUND_BF16: tl.constexpr, DOT: tl.constexpr,
                          OUT_BF16: tl.constexpr):
    # o [S, H, L] fp32 -> out [S, H, V] fp32 or (OUT_BF16) bf16; program (h, BLOCK_V rows of W_UV[h]), BLOCK_L
    # columns at a time
    h, vb = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    if DOT:
        acc = tl.zeros((BLOCK_S, BLOCK_V), tl.float32)
    else:  # the products summed over the columns once, after the loop
        acc_l = tl.zeros((BLOCK_S, BLOCK_V, BLOCK_L), tl.float32)
    for l0 in tl.static_range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        w = _weight_tile(w_ptr, ws_ptr, h * HEAD_ROWS + NOPE + v, v < V, l0, L, BLOCK_L, FP8, FP8_HW,
                         ROUND_BF16)
        o = tl.load(o_ptr + (s[:, None] * H + h) * L + cols[None, :], mask=(s < S)[:, None] & (cols < L)[None, :],
                    other=0.0)
        if DOT:
            acc += tl.dot(o, tl.trans(w), input_precision="ieee")
        else:
            acc_l += o[:, None, :] * w[None, :, :]
    if not DOT:
        acc = tl.sum(acc_l, axis=2)
    tl.store(out_ptr + (s[:, None] * H + h) * V + v[None, :], _out(acc, out_ptr, OUT_BF16),
             mask=(s < S)[:, None] & (v < V)[None, :])


def _launch_args(weight: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype, S: int, out: torch.Tensor,
                 product: str) -> tuple:
    """(weight's bytes, its scales or a placeholder, the kernels' shared constexprs) for S query rows into out, of
    `product` (query or output)."""
    if out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"mla_absorb: out_dtype must be float32 or bfloat16, not {out.dtype}")
    fp8, dot = scales is not None, S > BROADCAST_ROWS[product]
    w = weight.view(torch.uint8) if fp8 else weight
    meta = {"FP8": fp8, "FP8_HW": fp8 and has_fp8_dot(weight.device), "ROUND_BF16": fp8 and dtype == torch.bfloat16,
            "DOT": dot, "BLOCK_S": max(16, triton.next_power_of_2(S)) if dot else triton.next_power_of_2(S),
            "OUT_BF16": out.dtype == torch.bfloat16}
    return w, scales if fp8 else w, meta


def _in_a_scale_block(name: str, columns: int) -> int:
    """A tile's columns of W lie in one 128-column block of its scales (_weight_tile): a power of two up to 128."""
    if columns < 1 or columns > 128 or columns & (columns - 1):
        raise ValueError(f"mla_absorb: {name} must be a power of two up to 128, got {columns}")
    return columns


def absorb_query(q_nope: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype,
                 head_rows: int, rope: tuple | None = None, out_dtype: torch.dtype = torch.float32,
                 block_c: int = 128, block_d: int | None = None, num_warps: int = 4):
    """q_nope [S, H, nope] (a view; its last dim contiguous) through W_UK -> [S, H, L] in out_dtype (fp32 or bf16:
    the fp32 products rounded as torch's cast rounds them). weight: kv_b_proj's
    [H * head_rows, L], float8_e4m3fn with scales [cdiv(rows, 128), cdiv(L, 128)] fp32 (dequantised as to
    `dtype`), or dense with scales None.
    rope: (q_pe [S, H, R], the query's rope part with q_nope's strides (q_b_proj's output split), cos, sin
    [S, R/2] fp32, interleaved): then returns (q_lat, q_pe rotated as rope_triton.rope rotates it, contiguous), one
    launch for both.
    block_c, block_d, num_warps: a program's columns of L (up to 128: one scale block), the rows of W_UK it reads at a
    time (default: 64, or as many as a register tile of 64 x 128 products per query row allows), its warps
    (bench_decode_parts.py --sweep: on an H200 one query row took 8.3 us with block_d 64, 9.7 with 32, RESULTS.md
    session 45; H100, session 51: 6.0-6.3 us for (64 or 128, 64, 4 or 8))."""
    S, H, nope = q_nope.shape
    L = weight.shape[1]
    if q_nope.stride(-1) != 1:
        q_nope = q_nope.contiguous()
    out = torch.empty(S, H, L, dtype=out_dtype, device=q_nope.device)
    w, ws, meta = _launch_args(weight, scales, dtype, S, out, "query")
    block_d = block_d or min(64 // (1 if meta["DOT"] else meta["BLOCK_S"]), max(16, triton.next_power_of_2(nope)))
    if rope is None:
        pe = cos = sin = pe_out = out  # (not read: HALF 0)
        half, interleaved = 0, False
    else:
        pe, cos, sin, interleaved = rope
        half = pe.shape[-1] // 2
        if pe.stride() != q_nope.stride() or half & (half - 1) or pe.shape[-1] % 2:
            raise ValueError("mla_absorb: q_pe must share q_nope's strides and have 2 x a power of two values")
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        pe_out = torch.empty(pe.shape, dtype=pe.dtype, device=pe.device)
    block_c = _in_a_scale_block("block_c", block_c)
    _absorb_query_kernel[(H, triton.cdiv(L, block_c))](
        q_nope, w, ws, out, pe, cos, sin, pe_out, S, H, L, q_nope.stride(0), q_nope.stride(1), NOPE=nope,
        HEAD_ROWS=head_rows, BLOCK_D=block_d, BLOCK_C=block_c, HALF=half, INTERLEAVED=interleaved,
        PE_BF16=pe_out.dtype == torch.bfloat16, num_warps=num_warps, **meta)
    return out if rope is None else (out, pe_out)


def absorb_output(o: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype,
                  nope: int, head_rows: int, out_dtype: torch.dtype = torch.float32, block_v: int | None = None,
                  block_l: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """o [S, H, L] fp32 through W_UV^T -> [S, H, v] in out_dtype (as absorb_query's), v = head_rows - nope (weight
    and scales as absorb_query's).
    block_v, block_l, num_warps: a program's rows of W_UV, the columns it reads at a time (up to 128: one scale
    block), its warps (default with dots 64 x 128 on 4 warps; else 8 x 128 on 2 for one row, 16 x 128 on 4 for 2-4:
    bench_decode_parts.py --sweep and .exp's old-against-new timings, RESULTS.md session 51)."""
    S, H, L = o.shape
    V = head_rows - nope
    out = torch.empty(S, H, V, dtype=out_dtype, device=o.device)
    w, ws, meta = _launch_args(weight, scales, dtype, S, out, "output")
    if meta["DOT"]:
        block_v, num_warps = block_v or min(64, max(16, triton.next_power_of_2(V))), num_warps or 4
    else:  # one row: 8 x 128 on 2 warps took 6.7 us, 16 x 128 on 4 warps 7.7 (H100, RESULTS.md session 51)
        block_v, num_warps = block_v or (8 if S == 1 else 16), num_warps or (2 if S == 1 else 4)
    block_l = _in_a_scale_block("block_l", block_l or 128)
    _absorb_output_kernel[(H, triton.cdiv(V, block_v))](o.float().contiguous(), w, ws, out, S, H, L=L, V=V,
                                                         NOPE=nope, HEAD_ROWS=head_rows, BLOCK_V=block_v,
                                                         BLOCK_L=block_l, num_warps=num_warps, **meta)
    return out
