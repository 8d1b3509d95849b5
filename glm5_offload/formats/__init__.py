"""What stored bytes mean: each format with its plain-torch codec and its byte count.

    fp8_blocks   weights as float8_e4m3fn with one fp32 scale per 128x128 block (the FP8 releases)
    int_groups   weights as int8 or int4 with one fp32 scale per group of inputs (bf16 bit patterns beside them)
    kv_rows      the latent KV rows and indexer keys a cache stores, in the model's dtype or their FP8 forms

The kernels (glm5_offload.kernels) compute in these formats; the loader, the operators, the planner and
make-tiny read and write them through these codecs.
"""

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: the largest finite e4m3 value, what a scale maps amax to
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def dtype_name(dtype: torch.dtype) -> str:
    """bf16, fp16 or fp32: a compute dtype as the formats name it."""
    return DTYPE_NAMES[dtype]
