"""The latent KV cache of one sequence: 576 values per token per layer, never expanded K/V.

Per layer: latent rows [max_seq_len, kv_lora_rank + qk_rope_head_dim] = [normed c | roped k_pe].
Per full (indexer-owning) layer: indexer keys [max_seq_len, index_head_dim]. Shared layers keep none.
"""

import torch

from .config import ModelConfig
from .errors import Glm5Error


class KVCache:
    def __init__(self, config: ModelConfig, max_seq_len: int, latent_devices: list, index_devices: dict,
                 dtype: torch.dtype):
        """latent_devices: one device per layer; index_devices: full layer -> device of its indexer keys."""
        self.max_seq_len = max_seq_len
        self.latent = [torch.empty(max_seq_len, config.latent_dim, device=d, dtype=dtype) for d in latent_devices]
        self.index_keys = {
            i: torch.empty(max_seq_len, config.index_head_dim, device=d, dtype=dtype) for i, d in index_devices.items()
        }
        self.length = 0  # tokens whose rows are written in every layer

    def check_room(self, n_new: int):
        if self.length + n_new > self.max_seq_len:
            raise Glm5Error(
                f"context of {self.length + n_new} tokens exceeds max_seq_len {self.max_seq_len}"
            )

    def nbytes(self) -> int:
        tensors = self.latent + list(self.index_keys.values())
        return sum(t.numel() * t.element_size() for t in tensors)
