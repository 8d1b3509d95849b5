"""Compute kernels (installed as glm5_offload.kernels): Triton for the GPU, numba for the CPU.

Each kernel sits beside its plain-torch reference and is tested against it.
"""
