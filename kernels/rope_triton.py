"""Rotary position embedding in one Triton kernel: rows of heads, each row's first values rotated, the rest copied.

The reference is model/rope.py's apply_rope, nine kernels in torch (cos and sin cast, four products, a difference,
a sum, the cat), and for the indexer's queries a split and a second cat around it. A full layer ropes four tensors
per step (MLA's query and key parts, the indexer's queries, and its keys): in a decode step over FP8 cache rows (the
shipped rules) each is roped inside the kernel that reads it next (`pairs` and `rotated` here: mla_absorb's W_UK
product, dsa_triton's indexer scores and its FP8 key and latent rows), so it launches no rope kernel instead of some
forty; this kernel ropes the rest (a prefill's indexer queries, keys bound for rows in the compute dtype).

Bit-exact with the reference in bf16 (each product, difference and sum rounded to bf16 as torch's bf16 ops round
their fp32 result, by bits: Triton's interpreter truncates bf16 casts); fp32 to rounding, where the GPU may contract
a product and a difference into one fused multiply-add.
"""

import torch
import triton
import triton.language as tl

from . import INTERPRET
from .fp8_bits import round_to_bf16

ROWS = 4096 if INTERPRET else 64  # rows (token, head) a program: the interpreter pays per program (and per row of
# its block: there a block is cut to the rows there are)


@triton.jit
def pairs(src, i, mask, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The two values of each rotated pair i [.., HALF] of the rows at src (pointers [.., 1]), as fp32: (2i, 2i+1)
    interleaved, else (i, HALF+i)."""
    if INTERLEAVED:
        x1 = tl.load(src + 2 * i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def rotated(x1, x2, c, sn, BF16: tl.constexpr):
    """apply_rope's (first, second) halves of the pairs (x1, x2) by cos c and sin sn (fp32). BF16: each op's result
    rounded as torch's bf16 ops round theirs (by bits, not a helper per op: the interpreter pays for every call of a
    jit function)."""
    if BF16:
        c, sn = round_to_bf16(c), round_to_bf16(sn)
        first = round_to_bf16(round_to_bf16(x1 * c) - round_to_bf16(x2 * sn))
        second = round_to_bf16(round_to_bf16(x2 * c) + round_to_bf16(x1 * sn))
    else:
        first = x1 * c - x2 * sn
        second = x2 * c + x1 * sn
    return first, second


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, N, M, stride_s, stride_m, D: tl.constexpr, HALF: tl.constexpr,
                 REST: tl.constexpr, BLOCK_R: tl.constexpr, INTERLEAVED: tl.constexpr, BF16: tl.constexpr):
    # x [S, M, D] (values contiguous, rows at stride_s / stride_m), cos/sin [S, HALF] fp32 -> out [S, M, D]
    # contiguous; rows r = s * M + m, N = S * M; program: BLOCK_R rows. Values 0..2 HALF-1 rotated (interleaved
    # pairs (2i, 2i+1) or halves (i, HALF+i)), written de-interleaved as [first | second]; the D - 2 HALF after copied.
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    row_ok = r < N
    s, m = r // M, r % M
    src = x_ptr + s * stride_s + m * stride_m
    dst = out_ptr + r * D
    i = tl.arange(0, HALF)[None, :]
    c = tl.load(cos_ptr + s * HALF + i, mask=row_ok, other=0.0)
    sn = tl.load(sin_ptr + s * HALF + i, mask=row_ok, other=0.0)
    x1, x2 = pairs(src, i, row_ok, HALF, INTERLEAVED)
    first, second = rotated(x1, x2, c, sn, BF16)
    tl.store(dst + i, first.to(out_ptr.dtype.element_ty), mask=row_ok)
    tl.store(dst + HALF + i, second.to(out_ptr.dtype.element_ty), mask=row_ok)
    if REST > 0:
        j = 2 * HALF + tl.arange(0, REST)[None, :]
        ok = row_ok & (j < D)
        tl.store(dst + j, tl.load(src + j, mask=ok, other=0.0), mask=ok)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, interleaved: bool) -> torch.Tensor:
    """x [S, D] or [S, M, D] (bf16 or fp32; its last dim contiguous), cos, sin [S, rope_dim/2] fp32 -> a new
    contiguous tensor like x: the first rope_dim values of each row rotated as apply_rope rotates them (cos and sin
    cast to x's dtype first), the other D - rope_dim copied."""
    rows = x if x.dim() == 3 else x[:, None]
    S, M, D = rows.shape
    half = rope_dim // 2
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rope_dim % 2 or half & (half - 1) or rope_dim > D:
        raise ValueError(f"rope_triton: rope_dim {rope_dim} must be even, half a power of two, and at most {D}")
    out = torch.empty((S, M, D), dtype=x.dtype, device=x.device)
    n = S * M
    if n:
        block = min(ROWS, triton.next_power_of_2(n)) if INTERPRET else ROWS
        _rope_kernel[(triton.cdiv(n, block),)](
            rows, cos.float().contiguous(), sin.float().contiguous(), out, n, M, rows.stride(0), rows.stride(1),
            D=D, HALF=half, REST=triton.next_power_of_2(D - rope_dim) if D > rope_dim else 0, BLOCK_R=block,
            INTERLEAVED=interleaved, BF16=x.dtype == torch.bfloat16)
    return out.view(x.shape)
