"""glm5-offload: GLM-5 and DeepSeek-V3.2 on one workstation (attention on the GPU, experts on the CPU)."""

import os
from pathlib import Path

__version__ = "0.1.0"


def cache_dir() -> Path:
    """The user's cache folder for this project (the embedded tiny model, converted experts)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "glm5-offload"
