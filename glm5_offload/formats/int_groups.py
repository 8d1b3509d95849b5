"""Weights packed for the expert kernels (numba on the CPU, Triton on the GPU): bf16 bit patterns, or int8 / int4
with one fp32 scale per group of consecutive inputs of a row.

Per matrix [rows, cols] (a stack of them: [E, rows, cols]):
  bf16  uint16 bit patterns of bfloat16, no scales
  int8  int8 values, one fp32 scale per `group` inputs of a row (symmetric, q in [-127, 127])
  int4  two values per byte, one fp32 scale per group (symmetric, q in [-8, 7] stored as q + 8); in each group of
        G inputs, byte j holds input j in its low nibble and input j + G/2 in its high one
Activations may be int8-quantised per group too (quantize_activations: what the kernels' int8 dots see).
"""

import numpy as np
import torch

from ..errors import Glm5Error

BITS = {"bf16": 16, "int8": 8, "int4": 4}  # the formats, and bits per weight
GROUP_SIZES = (32, 64, 128)
GROUP = 128  # the group size where none is given


def nbytes(n_weights: int, fmt: str, group: int = GROUP) -> int:
    """Bytes of n_weights in a format: the payload, plus one fp32 scale per group for int8/int4."""
    payload = n_weights * BITS[fmt] // 8
    return payload if fmt == "bf16" else payload + n_weights // group * 4


def describe(fmt: str, group: int = GROUP) -> str:
    """The format as tables show it: bf16, int8/g128, int4/g32."""
    return fmt if fmt == "bf16" else f"{fmt}/g{group}"


def fitting_group(dims: tuple[int, ...], group: int | None) -> int:
    """The group size for matrices whose inputs number each of dims: `group` if it divides them all, else (None
    asked) the largest of GROUP_SIZES that does; a Glm5Error says which fit where none or the asked one does not."""
    fits = [g for g in sorted(GROUP_SIZES, reverse=True) if all(d % g == 0 for d in dims)]
    if group is None and fits:
        return fits[0]
    if group is not None and group in fits:
        return group
    fix = f"use group_size {' or '.join(map(str, fits))}" if fits else "use a format without groups (bf16)"
    asked = f"group_size {group} does not divide" if group is not None else "no group size divides"
    raise Glm5Error(f"{asked} the inputs ({', '.join(map(str, dims))}): {fix}"
                    + (", or leave group_size out to take the largest that fits" if group is not None and fits else ""))


def quantize(w: torch.Tensor, fmt: str, group: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
    """w [..., rows, cols] (any float dtype) -> (values, scales) as numpy arrays in the format."""
    if fmt == "bf16":
        values = w.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
        return values, np.zeros((0,), np.float32)
    if group not in GROUP_SIZES or w.shape[-1] % group:
        raise ValueError(f"group size {group} must be one of {GROUP_SIZES} and divide {w.shape[-1]}")
    qmax = 127 if fmt == "int8" else 7
    grouped = w.float().reshape(*w.shape[:-1], -1, group)  # [..., rows, ngroups, group]
    scales = grouped.abs().amax(-1).clamp(min=1e-12) / qmax
    q = torch.round(grouped / scales[..., None]).clamp(-qmax - (fmt == "int4"), qmax).to(torch.int8)
    if fmt == "int8":
        return q.reshape(w.shape).numpy(), scales.numpy()
    nibbles = (q + 8).to(torch.uint8)
    half = group // 2
    packed = nibbles[..., :half] | (nibbles[..., half:] << 4)  # [..., rows, ngroups, half]
    return packed.reshape(*w.shape[:-1], -1).numpy(), scales.numpy()


def dequantize(values: np.ndarray, scales: np.ndarray, fmt: str, group: int = GROUP) -> torch.Tensor:
    """The fp32 weights [..., rows, cols] a format stands for (the reference the kernels are tested against)."""
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


def quantize_activations(v: torch.Tensor, group: int) -> torch.Tensor:
    """v [N, K] fp32 -> the values int8 activations stand for: each group of `group` inputs rounded to multiples
    of its amax / 127 (what kernels/moe_cpu.py's _quantize_rows computes)."""
    grouped = v.float().reshape(v.shape[0], -1, group)
    scale = grouped.abs().amax(-1, keepdim=True) / np.float32(127.0)
    q = torch.where(scale > 0, torch.round(grouped / torch.where(scale > 0, scale, 1.0)), 0.0)
    return (q * scale).reshape(v.shape)
