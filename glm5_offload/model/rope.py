"""Rotary position embedding: default and yarn frequencies, interleaved and half-split rotation.

Both rotations write the rotated pairs as [first elements | second elements]: for the interleaved
layout the pairs are (x0,x1),(x2,x3),... and the output is de-interleaved. Queries and keys always go
through the same function, so dot products are those of the published models.
"""

import math

import torch

from ..config import ModelConfig


def inv_freq_and_scaling(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim/2] (fp32, CPU) and the factor applied to cos and sin."""
    rope, dim = config.rope, config.qk_rope_head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    base_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "default":
        return base_freq, 1.0

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 where the original frequency is kept
    inv_freq = (base_freq / factor) * (1 - extrapolation) + base_freq * extrapolation
    return inv_freq, float(attention_factor)


def cos_sin(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, rope_dim/2] in fp32 for integer positions [S]."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    return angles.cos() * scaling, angles.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [S, ..., rope_dim] by cos, sin [S, rope_dim/2] (cast to x's dtype, as the models do)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.to(x.dtype).view(shape), sin.to(x.dtype).view(shape)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
