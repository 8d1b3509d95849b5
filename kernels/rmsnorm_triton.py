"""RMSNorm in one Triton kernel: one program per row, the row in registers.

The reference is model/blocks.py's RMSNorm.forward, eight kernels in torch (widen, square, mean, add, rsqrt,
multiply, narrow, scale): h = x in fp32, y = h / sqrt(mean(h^2) + eps) rounded to x's dtype, out = weight * y in the
promoted dtype of weight and x. A decode step's norms (four per layer: the layer's two, MLA's q_a and kv_a) are
then four launches instead of 32; a row of up to 8192 values fits one program.

add_rmsnorm also takes the residual stream's pending addition first (RMSNorm.add_forward's reference: a sublayer's
output, or the routed experts' sum and the shared expert's, added in x's dtype, then to x): the new stream and its
norm in one launch, where torch took one kernel for each add and one for the norm.
"""

import torch
import triton
import triton.language as tl

from .fp8_bits import round_to_bf16


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, add_ptr, add2_ptr, sum_ptr, N, stride, eps, BLOCK: tl.constexpr,
                    ADDS: tl.constexpr, X_BF16: tl.constexpr, OUT_BF16: tl.constexpr):
    # x [T, N] (rows `stride` apart, values contiguous), w [N] -> out [T, N] contiguous; program: row.
    # ADDS 1 or 2: add (and add2) [T, N] contiguous in any float dtype; x + (add + add2), each sum in x's dtype, is
    # stored to sum [T, N] contiguous and normalised. x, w, out fp32 or bf16 (the X_BF16 and OUT_BF16 roundings by
    # bits: in the interpreter too)
    row = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK)
    mask = n < N
    h = tl.load(x_ptr + row * stride + n, mask=mask, other=0.0).to(tl.float32)
    if ADDS > 0:
        a = tl.load(add_ptr + row * N + n, mask=mask, other=0.0).to(tl.float32)
        if X_BF16:
            a = round_to_bf16(a)
        if ADDS > 1:
            b = tl.load(add2_ptr + row * N + n, mask=mask, other=0.0).to(tl.float32)
            if X_BF16:
                a = round_to_bf16(a + round_to_bf16(b))
            else:
                a += b
        h += a
        if X_BF16:
            h = round_to_bf16(h)
        tl.store(sum_ptr + row * N + n, h.to(sum_ptr.dtype.element_ty), mask=mask)
    y = h / tl.sqrt_rn(tl.sum(h * h, axis=0) / N + eps)
    if X_BF16:
        y = round_to_bf16(y)
    out = tl.load(w_ptr + n, mask=mask, other=0.0).to(tl.float32) * y
    if OUT_BF16:
        out = round_to_bf16(out)
    tl.store(out_ptr + row * N + n, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, adds: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    N = x.shape[-1]
    rows = x.reshape(-1, N)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    adds = [a.reshape(rows.shape).contiguous() for a in adds]
    total = torch.empty(rows.shape, dtype=x.dtype, device=x.device) if adds else rows  # (rows: not written)
    if rows.shape[0]:
        block = triton.next_power_of_2(N)
        add, add2 = (adds + [rows, rows])[:2]  # (pointers the kernel does not read: any tensor)
        _rmsnorm_kernel[(rows.shape[0],)](rows, weight, out, add, add2, total, N, rows.stride(0), eps, BLOCK=block,
                                          ADDS=len(adds), X_BF16=x.dtype == torch.bfloat16,
                                          OUT_BF16=out.dtype == torch.bfloat16, num_warps=8 if block > 2048 else 4)
    return (total.view(x.shape) if adds else x), out.view(x.shape)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] (fp32 or bf16 each) -> RMSNorm(x) [..., N] in torch.promote_types(weight.dtype,
    x.dtype)."""
    return _launch(x, weight, eps, ())[1]


def add_rmsnorm(x: torch.Tensor, adds: tuple, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] and one or two addends of its shape (any float dtype, on x's device) -> (x + sum of adds in x's
    dtype, RMSNorm of that), as RMSNorm.add_forward."""
    if not 1 <= len(adds) <= 2:
        raise ValueError(f"add_rmsnorm takes one or two addends, not {len(adds)}")
    return _launch(x, weight, eps, tuple(adds))
