"""Compute kernels (installed as glm5_offload.kernels): Triton for the GPU, numba for the CPU.

Each kernel cites its plain-torch reference (glm5_offload.formats, glm5_offload.model) and is tested against it.
Kernels import nothing of the engine but the formats they compute in. Under TRITON_INTERPRET=1 (the CPU tests)
Triton kernels run in Triton's interpreter.
"""

import functools
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def programs_wanted(device: torch.device) -> int:
    """Programs that keep every SM busy (4 per SM); 1 in the interpreter (each program costs time there)."""
    return 1 if INTERPRET else 4 * torch.cuda.get_device_properties(device).multi_processor_count
