"""FP8 block weights, as GLM-5-FP8 and DeepSeek-V3.2 are released: W [out, in] stored as float8_e4m3fn beside
`weight_scale_inv` [ceil(out/b0), ceil(in/b1)] fp32, one scale per b0 x b1 block (128 x 128), W = W8 * scale.
Blocks at the right and bottom edges may be partial."""

import torch

from . import FP8_MAX

BLOCK = (128, 128)  # what make-tiny writes; a checkpoint's own comes from its quantization_config


def scale_shape(shape: tuple[int, int], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """The weight_scale_inv shape of a weight of `shape`."""
    return tuple(-(-d // b) for d, b in zip(shape, block))


def quantize(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (W8 float8_e4m3fn, scale_inv fp32) with W ~ W8 * scale: each block's amax maps to FP8_MAX."""
    out_f, in_f = weight.shape
    rows, cols = scale_shape(weight.shape, block)
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32, device=weight.device)
    padded[:out_f, :in_f] = weight.float()
    blocks = padded.view(rows, block[0], cols, block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [rows, cols]
    w8 = (blocks / scale[:, None, :, None]).view(rows * block[0], cols * block[1])[:out_f, :in_f]
    return w8.to(torch.float8_e4m3fn), scale


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """W8 [out, in] float8_e4m3fn and its scale_inv -> W8 * scale, fp32."""
    out_f, in_f = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:out_f].repeat_interleave(block[1], 1)[:, :in_f]
    return weight.float() * scale


def nbytes(shape: tuple[int, int], block: tuple[int, int] = BLOCK) -> int:
    """Bytes of a weight in this form: one byte a value, four a block's scale."""
    rows, cols = scale_shape(shape, block)
    return shape[0] * shape[1] + 4 * rows * cols


def quantize_activations(x: torch.Tensor, block: int = BLOCK[1]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x8 [M, K] float8_e4m3fn, scales [M, cdiv(K, block)] fp32): each row's groups of `block` inputs
    scaled so their amax maps to FP8_MAX (DeepSeek's act_quant; what an FP8-dot prefill GEMM multiplies)."""
    M, K = x.shape
    groups = -(-K // block)
    padded = torch.nn.functional.pad(x.float(), (0, groups * block - K)).view(M, groups, block)
    scales = padded.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    x8 = (padded / scales[..., None]).view(M, -1)[:, :K].to(torch.float8_e4m3fn)
    return x8, scales


def dequantize_activations(x8: torch.Tensor, scales: torch.Tensor, block: int = BLOCK[1]) -> torch.Tensor:
    """x8 [M, K] float8_e4m3fn and scales [M, cdiv(K, block)] -> fp32 [M, K]."""
    return x8.float() * scales.float().repeat_interleave(block, 1)[:, : x8.shape[1]]
