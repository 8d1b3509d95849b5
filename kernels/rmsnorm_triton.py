"""RMSNorm in one Triton kernel: one program per row, the row in registers.

The reference is model/blocks.py's RMSNorm.forward, eight kernels in torch (widen, square, mean, add, rsqrt,
multiply, narrow, scale): h = x in fp32, y = h / sqrt(mean(h^2) + eps) rounded to x's dtype, out = weight * y in the
promoted dtype of weight and x. A decode step's norms (four per layer: the layer's two, MLA's q_a and kv_a) are
then four launches instead of 32; a row of up to 8192 values fits one program.
"""

import torch
import triton
import triton.language as tl

from .fp8_bits import round_to_bf16


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, N, stride, eps, BLOCK: tl.constexpr, X_BF16: tl.constexpr,
                    OUT_BF16: tl.constexpr):
    # x [T, N] (rows `stride` apart, values contiguous), w [N] -> out [T, N] contiguous; program: row.
    # x, w, out fp32 or bf16 (the X_BF16 and OUT_BF16 roundings by bits: in the interpreter too)
    row = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK)
    mask = n < N
    h = tl.load(x_ptr + row * stride + n, mask=mask, other=0.0).to(tl.float32)
    y = h / tl.sqrt_rn(tl.sum(h * h, axis=0) / N + eps)
    if X_BF16:
        y = round_to_bf16(y)
    out = tl.load(w_ptr + n, mask=mask, other=0.0).to(tl.float32) * y
    if OUT_BF16:
        out = round_to_bf16(out)
    tl.store(out_ptr + row * N + n, out.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] (fp32 or bf16 each) -> RMSNorm(x) [..., N] in torch.promote_types(weight.dtype,
    x.dtype)."""
    N = x.shape[-1]
    rows = x.reshape(-1, N)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(N)
        _rmsnorm_kernel[(rows.shape[0],)](rows, weight, out, N, rows.stride(0), eps, BLOCK=block,
                                          X_BF16=x.dtype == torch.bfloat16, OUT_BF16=out.dtype == torch.bfloat16,
                                          num_warps=8 if block > 2048 else 4)
    return out.view(x.shape)
