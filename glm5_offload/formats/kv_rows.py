"""The rows a DSA cache stores per token: latent rows (every layer) and indexer keys (full layers), in the model's
dtype or in their FP8 forms.

Latent row [kv_lora_rank + qk_rope_head_dim] = [normed c | roped k_pe] (576 values for GLM-5). FP8 form, as
bytes: [c as e4m3 | one fp32 scale per 128 values of c (per latent_group) | k_pe as bf16]: 656 B for GLM-5.
Indexer key [index_head_dim] (roped). FP8 form: e4m3 values and one fp32 scale per key: 132 B for GLM-5.
A form is "fp8" or a compute dtype's name (bf16, fp16, fp32).
"""

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from . import FP8_MAX

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def latent_group(kv_lora_rank: int) -> int:
    """Values of c per fp32 scale in the FP8 row: 128 (GLM-5: 4 scales), or the whole c when it is smaller."""
    return 128 if kv_lora_rank % 128 == 0 else kv_lora_rank


def fp8_row_width(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one latent row in the FP8 form."""
    return kv_lora_rank + kv_lora_rank // latent_group(kv_lora_rank) * 4 + rope_dim * 2


def latent_row_bytes(config: ModelConfig, form: str) -> int:
    """One token's latent row in one layer: bf16 1152 B for GLM-5, FP8 656 B."""
    if form == "fp8":
        return fp8_row_width(config.kv_lora_rank, config.qk_rope_head_dim)
    return config.latent_dim * ELEMENT_BYTES[form]


def quantize_latent(rows: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """Latent rows [N, L+R] -> their FP8 form [N, L + 4L/G + 2R] uint8."""
    N, L = rows.shape[0], kv_lora_rank
    G = latent_group(L)
    c = rows[:, :L].float().view(N, L // G, G)
    scale = c.abs().amax(-1).clamp(min=1e-12) / FP8_MAX  # [N, L/G]
    c8 = (c / scale[..., None]).to(torch.float8_e4m3fn).view(N, L)
    pe = rows[:, L:].to(torch.bfloat16)
    return torch.cat([c8.view(torch.uint8), scale.view(torch.uint8), pe.view(torch.uint8)], dim=1)


def dequantize_latent(packed: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """FP8 rows [N, L + 4L/G + 2R] uint8 -> fp32 [N, L+R]."""
    N, L = packed.shape[0], kv_lora_rank
    G = latent_group(L)
    c8 = packed[:, :L].contiguous().view(torch.float8_e4m3fn).float().view(N, L // G, G)
    scale = packed[:, L : L + 4 * (L // G)].contiguous().view(torch.float32)
    pe = packed[:, L + 4 * (L // G) :].contiguous().view(torch.bfloat16).float()
    return torch.cat([(c8 * scale[..., None]).view(N, L), pe], dim=1)


@dataclass(frozen=True)
class FP8Keys:
    """A full layer's indexer keys in the FP8 form: e4m3 values [max_seq_len, D] and fp32 scales [max_seq_len]."""

    values: torch.Tensor
    scales: torch.Tensor


def key_bytes(config: ModelConfig, form: str) -> int:
    """One token's indexer key in one full layer: FP8 132 B (e4m3 + one fp32 scale), bf16 256 B. GLM-5.3-Flash keeps
    one key per group of index_kpool tokens, in bf16 whatever the form (16 B per token)."""
    if config.model_type == "glm5_next":
        return -(-config.index_head_dim * 2 // config.index_kpool)
    if form == "fp8":
        return config.index_head_dim + 4
    return config.index_head_dim * ELEMENT_BYTES[form]


def quantize_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer keys [N, D] -> FP8 form: e4m3 values [N, D] and one fp32 scale per key [N]."""
    scale = k.float().abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (k.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def dequantize_keys(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP8 keys [N, D] and their scales [N] -> fp32 [N, D]."""
    return values.float() * scales[:, None]
