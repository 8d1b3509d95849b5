"""GLM-5.3-Flash's DSA indexer over pooled groups of `index_kpool` tokens (16), with its plain-torch reference.

Each group of kpool consecutive tokens gets one key: the softmax-weighted mean (per channel, over the group's
tokens) of their keys, weighted by a learned gate logit plus a per-slot position term (`index_kpool_compress_gate`,
`index_kpool_compress_ape`). A query scores the groups complete at or before it (no rope), keeps the top
index_topk / kpool of them, and attends to their tokens and to its own incomplete group's tokens (the tail).

The cache (PooledKeys) holds one key per group and the current group's per-token keys and gate logits: a group's key
is written when its tokens arrive (in decode, rewritten with each token: a group is scored only once complete).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .blocks import Linear
from .mla import SCORE_BUDGET, call_end, head_weights, indexer_scores


@dataclass(frozen=True)
class PooledKeys:
    """One layer's pooled indexer cache: group keys [max_groups, D], the current group's per-token keys and gate
    logits [kpool, D] each (token at position p in slot p % kpool)."""

    groups: torch.Tensor
    tail_keys: torch.Tensor
    tail_gates: torch.Tensor

    @staticmethod
    def empty(config: ModelConfig, max_seq_len: int, device, dtype) -> "PooledKeys":
        kpool, D = config.index_kpool, config.index_head_dim
        n = -(-max_seq_len // kpool)
        return PooledKeys(*(torch.zeros(rows, D, dtype=dtype, device=device) for rows in (n, kpool, kpool)))


def pool(keys, gates, ape, valid):
    """keys, gates [..., kpool, D], ape [kpool, D], valid [..., kpool] bool -> the groups' keys [..., D]."""
    logits = (gates.float() + ape.float()).masked_fill(~valid[..., None], float("-inf"))
    return (logits.softmax(dim=-2).to(keys.dtype) * keys).sum(-2)


def last_complete_group(positions, kpool: int):
    """The last group complete at each of positions [S] (-1: none yet): group g's tokens end at (g + 1) kpool - 1,
    so the indexer's causal mask at these positions keeps exactly the complete groups."""
    return positions.add(1).div(kpool, rounding_mode="floor") - 1


def selected_tokens(scores, positions, n_groups: int, kpool: int, tail: bool):
    """The token positions each query attends to: its top n_groups groups by scores [S, G] (-inf: not a candidate)
    expanded to their kpool tokens, then (tail) the tokens of its own incomplete group -> [S, n_groups * kpool
    (+ kpool - 1)] int64, -1 where none."""
    values, groups = scores.topk(min(n_groups, scores.shape[-1]), dim=-1)
    tokens = (groups[..., None] * kpool + torch.arange(kpool, device=scores.device)).masked_fill(
        (values == float("-inf"))[..., None], -1).flatten(1)
    tokens = F.pad(tokens, (0, n_groups * kpool - tokens.shape[1]), value=-1)
    if not tail:
        return tokens
    first = positions - positions.add(1).remainder(kpool) + 1  # the query's incomplete group starts here
    own = first[:, None] + torch.arange(kpool - 1, device=scores.device)
    return torch.cat([tokens, own.masked_fill(own > positions[:, None], -1)], dim=1)


class PooledIndexer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.kpool = config.index_n_heads, config.index_head_dim, config.index_kpool
        self.n_groups, self.tail = config.index_topk // config.index_kpool, config.index_select_tail
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = Linear(config.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(config.hidden_size, self.n_heads)
        self.index_kpool_compress_ape = nn.Parameter(torch.empty(self.kpool, self.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(self.head_dim, config.hidden_size))

    @property
    def width(self) -> int:
        """Tokens a query selects at most."""
        return self.n_groups * self.kpool + (self.kpool - 1 if self.tail else 0)

    def write_keys(self, k, gates, cache: PooledKeys, positions):
        """The new tokens' keys and gate logits [S, D] at positions [S] into cache: the groups they complete get
        their keys; the rest wait in the tail. One token (decode, CUDA-graph safe): its group's key is rewritten
        from the tail, complete or not."""
        kpool = self.kpool
        if k.shape[0] == 1:
            slot = positions.remainder(kpool)
            cache.tail_keys.index_copy_(0, slot, k.to(cache.tail_keys.dtype))
            cache.tail_gates.index_copy_(0, slot, gates.to(cache.tail_gates.dtype))
            valid = torch.arange(kpool, device=k.device) <= slot
            key = pool(cache.tail_keys, cache.tail_gates, self.index_kpool_compress_ape, valid)
            cache.groups.index_copy_(0, positions.div(kpool, rounding_mode="floor"), key[None].to(cache.groups.dtype))
            return
        start = int(positions[0])
        held = start % kpool  # tokens of start's group already in the tail
        keys = torch.cat([cache.tail_keys[:held], k.to(cache.tail_keys.dtype)])
        gates = torch.cat([cache.tail_gates[:held], gates.to(cache.tail_gates.dtype)])
        complete = keys.shape[0] // kpool
        if complete:
            n = complete * kpool
            valid = torch.ones(complete, kpool, dtype=torch.bool, device=k.device)
            first = start // kpool
            cache.groups[first : first + complete] = pool(keys[:n].view(complete, kpool, -1),
                                                          gates[:n].view(complete, kpool, -1),
                                                          self.index_kpool_compress_ape, valid).to(cache.groups.dtype)
        rest = keys.shape[0] % kpool
        cache.tail_keys[:rest] = keys[keys.shape[0] - rest :]
        cache.tail_gates[:rest] = gates[gates.shape[0] - rest :]

    def head_weights(self, x):
        """Each head's weight in a query's score [S, n_heads] fp32 (mla.head_weights)."""
        return head_weights(self.weights_proj, x, self.n_heads)

    def scores(self, q, cache: PooledKeys, weights, positions, end: int):
        """Group scores [S, end // kpool]: the lightning indexer's (mla.indexer_scores) over the group keys, -inf for
        groups not complete at the query (plain torch here; a fast operator may override it)."""
        return indexer_scores(q, cache.groups[: end // self.kpool], weights, last_complete_group(positions, self.kpool))

    def forward(self, x, qr, cos, sin, cache: PooledKeys, positions, end: int, k=None):
        """x [S, hidden], qr [S, q_lora] of the tokens at positions [S]; cache: this layer's PooledKeys; end >= the
        last position + 1 (cos, sin: unused, no rope); k: wk(x) where the caller computed it already. Returns the
        selected token positions [S, width] (int64, -1 where none). In mla.Indexer's three parts."""
        weights = self.write(x, cos, sin, cache, positions, k)
        return self.selected(self.query(qr, cos, sin), cache, weights, positions, end)

    def write(self, x, cos, sin, cache: PooledKeys, positions, k=None):
        """The tokens' keys and gate logits into cache; returns their head weights [S, n_heads] fp32."""
        self.write_keys(self.k_norm(self.wk(x) if k is None else k), F.linear(x, self.index_kpool_compress_gate), cache,
                        positions)
        return self.head_weights(x)

    def query(self, qr, cos, sin):
        """The indexer's queries [S, n_heads, head_dim] (wq_b of qr; no rope)."""
        return self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim)

    def selected(self, q, cache: PooledKeys, weights, positions, end: int):
        """The queries' selected positions (forward's), their group scores taken in chunks."""
        S = q.shape[0]
        chunk = max(1, SCORE_BUDGET // (self.n_heads * max(1, end // self.kpool)))
        return torch.cat([
            selected_tokens(self.scores(q[s : s + chunk], cache, weights[s : s + chunk], positions[s : s + chunk],
                                        call_end(end, S, s + chunk)),
                            positions[s : s + chunk], self.n_groups, self.kpool, self.tail)
            for s in range(0, S, chunk)
        ])
