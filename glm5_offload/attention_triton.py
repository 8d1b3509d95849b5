"""`attention.dsa_triton` and `indexer.dsa_triton`: the same modules with their cores in Triton kernels.

Weights, cache layout and IndexShare behaviour are the reference's (model.py): a shared layer still
runs no indexer and keeps no indexer cache. Selection uses torch.topk on the kernel's scores.
"""

from .kernels import dsa_triton
from .model import _SCORE_BUDGET, Attention, Indexer


class TritonIndexer(Indexer):
    def scores(self, q, keys, weights, start):
        return dsa_triton.indexer_scores(q, keys, weights, start)

    def query_chunk(self, n_keys: int) -> int:
        """The kernel sums over heads as it goes: only [queries, keys] scores are held."""
        return max(1, 2 * _SCORE_BUDGET // n_keys)


class TritonAttention(Attention):
    def attend(self, q_lat, q_pe, latent, indices):
        return dsa_triton.sparse_mla(q_lat, q_pe, latent, indices, self.kv_lora_rank, self.scale)[0]
