"""Compute kernels (installed as glm5_offload.kernels): Triton for the GPU, numba for the CPU.

Each kernel cites its plain-torch reference (glm5_offload.formats, glm5_offload.model) and is tested against it.
Kernels import nothing of the engine but the formats they compute in. Under TRITON_INTERPRET=1 (the CPU tests)
Triton kernels run in Triton's interpreter.
"""

import os

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
