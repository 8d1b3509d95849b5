"""Routed-expert weights from their CPU formats (int8, int4 with group scales) to bf16 on the GPU, in Triton.

For long prefill chunks the experts stream to the GPU and run there as bf16 matmuls instead of on the
CPU cores: each expert's packed weights cross once, are dequantised here, and feed torch's matmul. The
reference is `glm5_offload.formats.int_groups.dequantize` (the same layouts: int4 byte j of a group holds
input j in its low nibble and input j + G/2 in its high one).
"""

import torch
import triton
import triton.language as tl


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
    block_r = 32
    _dequantize_kernel[(triton.cdiv(rows, block_r), cols // group)](
        values, scales, out, rows, cols, GROUP=group, INT4=fmt == "int4", BLOCK_R=block_r)
    return out
