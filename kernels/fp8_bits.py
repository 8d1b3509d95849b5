"""float8_e4m3fn by bit arithmetic in Triton: bytes to values and values to bytes.

Triton refuses its float8e4nv type below sm89 (RTX 3090 and A100 have no FP8 conversion instructions), so the
kernels that keep FP8 data (the latent rows, the indexer keys, the linear weights) load and store it as bytes and
convert with these, on every GPU alike. Both are exact: the references are torch's `.to(torch.float8_e4m3fn)`
(round to nearest even) and `.float()`; tests/test_fp8_bits.py checks every byte and a sweep of values.
"""

import functools

import torch
import triton
import triton.language as tl

from . import INTERPRET


@functools.cache
def has_fp8_dot(device: torch.device) -> bool:
    """FP8 tensor cores and conversions: sm89 (Ada), sm90 (Hopper), sm120 (Blackwell desktop) and up; never in the
    interpreter (there the same products come from the bit arithmetic below)."""
    return not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def e4m3_to_f16(b):
    """e4m3 bytes -> their values / 256 as fp16, exactly: the sign to bit 15, exponent and mantissa to bits 13..7
    (fp16's exponent bias is 8 above e4m3's; subnormals map to subnormals). Multiply by 256 (in a scale) after."""
    u = b.to(tl.uint16)
    return (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def round_to_bf16(x):
    """fp32 values -> the nearest bf16 values (ties to even), still fp32: what a cast to bf16 gives on a GPU, by bits
    (the interpreter's casts to bf16 truncate)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_e4m3(x):
    """fp32 values -> e4m3 bytes (uint8), rounded to nearest even as torch rounds: what rounds past 448, the largest
    finite value, saturates there (infinities too) and NaN stays NaN (0x7F with its sign), as torch's cast does."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.abs(x)
    magnitude = a.to(tl.int32, bitcast=True)
    rounded = magnitude + 0x7FFFF + ((magnitude >> 20) & 1)  # to 3 mantissa bits, ties to even
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)  # exponent rebiased from 127 to 7
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # multiples of 2^-9, ties to even
    code = tl.minimum(tl.where(a < 0.015625, subnormal, normal), 126)  # 126: 448, the largest finite
    code = tl.where(a != a, 127, code)  # NaN
    return (code | (sign << 7)).to(tl.uint8)
