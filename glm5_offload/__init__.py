"""glm5-offload: GLM-5 and DeepSeek-V3.2 on one workstation (attention on the GPU, experts on the CPU)."""

__version__ = "0.1.0"
