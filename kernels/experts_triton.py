"""Routed experts on the GPU, in Triton: their weights from the CPU formats (int8, int4 with group scales) to bf16,
and the inputs of both projections rounded as the CPU's int8 activations round them (the down projection's in
SwiGLU's kernel).

For long prefill chunks the experts stream to the GPU and run there as bf16 matmuls instead of on the
CPU cores: each expert's packed weights cross once, are dequantised here, and feed torch's matmul. The
references are `glm5_offload.formats.int_groups.dequantize` (the same layouts: int4 byte j of a group holds
input j in its low nibble and input j + G/2 in its high one), `glm5_offload.model.swiglu` and
`int_groups.quantize_activations`.
"""

import math

import torch
import triton
import triton.language as tl

from . import INTERPRET


@triton.jit
def _dequantize_kernel(values_ptr, scales_ptr, out_ptr, rows, cols, GROUP: tl.constexpr, INT4: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    # values [rows, cols] int8 or [rows, cols/2] uint8 (int4), scales [rows, cols/GROUP] fp32 -> out [rows, cols];
    # one program: BLOCK_R rows x one group of inputs
    pid_r, g = tl.program_id(0), tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows
    scale = tl.load(scales_ptr + r * (cols // GROUP) + g, mask=r_ok, other=0.0)
    if INT4:
        j = tl.arange(0, GROUP // 2)
        packed = tl.load(values_ptr + r[:, None] * (cols // 2) + g * (GROUP // 2) + j[None, :], mask=r_ok[:, None],
                         other=0).to(tl.int32)
        low = ((packed & 15) - 8).to(tl.float32) * scale[:, None]
        high = ((packed >> 4) - 8).to(tl.float32) * scale[:, None]
        base = out_ptr + r[:, None] * cols + g * GROUP + j[None, :]
        tl.store(base, low.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])
        tl.store(base + GROUP // 2, high.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])
    else:
        j = tl.arange(0, GROUP)
        q = tl.load(values_ptr + r[:, None] * cols + g * GROUP + j[None, :], mask=r_ok[:, None], other=0)
        w = q.to(tl.float32) * scale[:, None]
        tl.store(out_ptr + r[:, None] * cols + g * GROUP + j[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=r_ok[:, None])


def dequantize(values: torch.Tensor, scales: torch.Tensor, fmt: str, group: int,
               out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One expert matrix in an int format (values [rows, cols] int8 or [rows, cols/2] uint8, scales
    [rows, cols/group] fp32, on one device) -> [rows, cols] of dtype."""
    if fmt not in ("int8", "int4"):
        raise ValueError(f"format must be int8 or int4, got {fmt!r}")
    rows = values.shape[0]
    cols = values.shape[1] * (2 if fmt == "int4" else 1)
    out = torch.empty(rows, cols, dtype=dtype, device=values.device) if out is None else out
    block_r = 256 if INTERPRET else 32  # the interpreter's cost is per program
    _dequantize_kernel[(triton.cdiv(rows, block_r), cols // group)](
        values, scales, out, rows, cols, GROUP=group, INT4=fmt == "int4", BLOCK_R=block_r)
    return out


@triton.jit
def _int8_steps(v):
    # v [BLOCK_T, G] fp32 -> each row rounded to multiples of its amax / 127, IEEE divisions and ties to even
    # (int_groups.quantize_activations: the values the CPU experts' int8 inputs stand for)
    scale = tl.div_rn(tl.max(tl.abs(v), axis=1), 127.0)
    scale = tl.where(tl.max((v != v).to(tl.int32), axis=1) > 0, float("nan"), scale)[:, None]  # a NaN's, as amax's
    steps = tl.div_rn(v, tl.where(scale > 0, scale, 1.0))
    steps = (steps + 12582912.0) - 12582912.0  # 1.5 * 2^23: rounds |steps| <= 127 to an integer, ties to even
    return tl.where(scale > 0, steps, 0.0) * scale


@triton.jit
def _round_kernel(x_ptr, out_ptr, T, K, G: tl.constexpr, BLOCK_T: tl.constexpr):
    # x [T, K] -> out [T, K]: each group of G inputs of a row by _int8_steps; one program: BLOCK_T rows x one group
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    at = t.to(tl.int64)[:, None] * K + tl.program_id(1) * G + tl.arange(0, G)[None, :]
    ok = (t < T)[:, None]
    v = _int8_steps(tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32))
    tl.store(out_ptr + at, v.to(out_ptr.dtype.element_ty), mask=ok)


def round_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [T, K] (on one device) -> [T, K] of x's dtype: each group of `group` inputs rounded as the CPU experts' int8
    activations are (reference: int_groups.quantize_activations), in one pass."""
    T, K = x.shape
    out = torch.empty_like(x)
    if T:
        block_t = 64 if INTERPRET else 4
        _round_kernel[(triton.cdiv(T, block_t), K // group)](x.contiguous(), out, T, K, G=group, BLOCK_T=block_t)
    return out


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, T, inter, limit, G: tl.constexpr, BLOCK_T: tl.constexpr, LIMIT: tl.constexpr,
                   QUANT: tl.constexpr):
    # gu [T, 2 inter] = [gate | up] -> out [T, inter] = silu(gate) * up, in fp32 (LIMIT: gate <= limit and
    # |up| <= limit first); QUANT: each group of G outputs by _int8_steps; one program: BLOCK_T rows x G columns
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.program_id(1) * G + tl.arange(0, G)
    ok = (t < T)[:, None]
    row = gu_ptr + t.to(tl.int64)[:, None] * (2 * inter) + j[None, :]
    gate = tl.load(row, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(row + inter, mask=ok, other=0.0).to(tl.float32)
    if LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = tl.div_rn(gate, 1.0 + tl.exp(-gate)) * up
    if QUANT:
        act = _int8_steps(act)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * inter + j[None, :], act.to(out_ptr.dtype.element_ty), mask=ok)


def swiglu(gu: torch.Tensor, limit: float | None, group: int, quantize: bool) -> torch.Tensor:
    """gu [T, 2I] (gate | up, on one device) -> [T, I] of gu's dtype: silu(gate) * up, clamped by limit
    (GLM-5.3-Flash's swiglu_limit) where given; quantize: each group of `group` values rounded as int8 activations
    are (what the CPU experts' down projection takes with `activations: int8`)."""
    T, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(T, inter, dtype=gu.dtype, device=gu.device)
    width = group if quantize else math.gcd(inter, 128)  # a program's columns: a group, or any power of two dividing I
    if T:
        block_t = 64 if INTERPRET else 4
        _swiglu_kernel[(triton.cdiv(T, block_t), inter // width)](
            gu.contiguous(), out, T, inter, 0.0 if limit is None else float(limit), G=width, BLOCK_T=block_t,
            LIMIT=limit is not None, QUANT=quantize)
    return out
