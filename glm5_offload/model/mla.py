"""Multi-head latent attention (MLA) with DeepSeek Sparse Attention (DSA): the lightning indexer selects the cached
rows each query attends to, and attention runs in the absorbed latent form over them, with plain-torch reference
forwards (`indexer_scores`, `topk_indices` and `sparse_mla` are also the references of kernels/dsa_triton.py).

The cache (runtime/kv_cache.py) holds per token and layer one latent row [c | k_pe] (576 values for GLM-5, never
expanded K/V) and, in full layers, one indexer key; IndexShare's shared layers reuse the full layer's selection.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..formats.kv_rows import FP8Keys, dequantize_keys, dequantize_latent, quantize_keys
from ..util import Beside, span
from .blocks import Linear, RMSNorm
from .rope import apply_rope

SCORE_BUDGET = 1 << 26  # queries per chunk are bounded so that heads x queries x keys scores stay near this many
BESIDE_ROWS = 16  # a pass of up to this many tokens computes its attention's query on a side stream (on a GPU)


@dataclass(frozen=True)
class LatentLayout:
    """Where and in which form one layer keeps its cache (set by its attention operator from the rule's kwargs)."""

    device: torch.device  # the attention's: its latent rows, or their hot buffer with offload
    index_device: torch.device | None  # its indexer's keys (None: a shared layer, no indexer)
    fp8: bool = False  # latent rows in the 656 B form, and the layer's indexer keys in the 132 B one
    offload: bool = False  # rows in host memory, a hot buffer on the attention's device
    hot_bytes: int = 256 << 20  # with offload: the hot buffer's budget
    window: int = 1024  # with offload: recent tokens always hot
    prefill_rows: int = 1 << 18  # with offload: rows a prefill chunk's staging buffer holds

    def hot_rows(self, row_bytes: int) -> int:
        """With offload: the rows of row_bytes its hot buffer's budget holds."""
        return self.hot_bytes // row_bytes


class Indexer(nn.Module):
    """The lightning indexer: scores every cached key for each query, keeps the top index_topk."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim, self.topk = config.qk_rope_head_dim, config.index_topk
        self.interleaved = config.indexer_rope_interleave
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = Linear(config.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(config.hidden_size, self.n_heads)  # kept fp32

    def scores(self, q, keys, weights, positions, end: int):
        """Index scores [S, end] of the queries at positions [S] against the first `end` cached keys (plain torch
        here; indexer.dsa_triton's kernel overrides it)."""
        if isinstance(keys, FP8Keys):
            return indexer_scores(q, dequantize_keys(keys.values[:end], keys.scales[:end]), weights, positions)
        return indexer_scores(q, keys[:end], weights, positions)

    def write_keys(self, k, cos, sin, keys, positions):
        """Rope the new keys k [S, head_dim] and write them into the cache rows at positions [S] (FP8: values
        and scales)."""
        k = self._rope(k, cos, sin)
        if isinstance(keys, FP8Keys):
            values, scales = quantize_keys(k)
            keys.values.view(torch.uint8).index_copy_(0, positions, values.view(torch.uint8))  # no e4m3 kernel
            keys.scales.index_copy_(0, positions, scales)
        else:
            keys.index_copy_(0, positions, k.to(keys.dtype))

    def head_weights(self, x):
        """Each head's weight in a query's score [S, n_heads] fp32: weights_proj (kept fp32) of x, times
        n_heads^-0.5."""
        return head_weights(self.weights_proj, x, self.n_heads)

    def query_chunk(self, n_keys: int) -> int:
        """Queries scored per call: the reference holds [queries, heads, keys] logits at once."""
        return max(1, SCORE_BUDGET // (self.n_heads * n_keys))

    def _rope(self, t, cos, sin):
        """t [S, (H,) head_dim] with its first rope_dim values rotated (plain torch here)."""
        rot, rest = t.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rope(rot, cos, sin, self.interleaved), rest], dim=-1)

    def forward(self, x, qr, cos, sin, keys, positions, end: int, k=None):
        """x [S, hidden], qr [S, q_lora] of the tokens at positions [S] (int64, on x's device); keys: this
        layer's indexer-key cache rows (a tensor, or FP8Keys); end: scores cover keys 0..end-1 (>= the last
        position + 1; keys past a query's position score -inf); k: wk(x) where the caller computed it already.

        Returns the selected token positions [S, min(topk, end)] (int64), -1 where fewer are valid. In three parts
        (Attention runs the first beside the second): write, query, selected.
        """
        weights = self.write(x, cos, sin, keys, positions, k)
        return self.selected(self.query(qr, cos, sin), keys, weights, positions, end)

    def write(self, x, cos, sin, keys, positions, k=None):
        """The tokens' keys into their cache rows; returns their head weights [S, n_heads] fp32."""
        self.write_keys(self.k_norm(self.wk(x) if k is None else k), cos, sin, keys, positions)
        return self.head_weights(x)

    def query(self, qr, cos, sin):
        """The indexer's queries [S, n_heads, head_dim] (wq_b of qr, roped)."""
        return self._rope(self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim), cos, sin)

    def selected(self, q, keys, weights, positions, end: int):
        """The queries' selected positions (forward's), their scores taken query_chunk queries at a time."""
        S = q.shape[0]
        chunk = self.query_chunk(end)
        parts = [self.top(q[s : s + chunk], keys, weights[s : s + chunk], positions[s : s + chunk],
                          call_end(end, S, s + chunk, self.topk)) for s in range(0, S, chunk)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # (a cat of one part is still a copy)

    def top(self, q, keys, weights, positions, end: int):
        """The selected positions [S, min(topk, end)] of the queries at positions [S]: select of their scores."""
        return self.select(self.scores(q, keys, weights, positions, end))

    def select(self, scores):
        """The top index_topk positions of each row of scores [S, T] (topk_indices; indexer.dsa_triton's kernel
        overrides it)."""
        return topk_indices(scores, self.topk)


def head_weights(weights_proj, x, n_heads: int):
    """The indexer's head weights (Indexer.head_weights; GLM-5.3-Flash's pooled indexer has the same)."""
    return weights_proj(x.float()).float() * n_heads**-0.5


def call_end(end: int, S: int, stop: int, least: int = 0) -> int:
    """The keys a call of the queries before `stop` of a pass's S needs scored, at least `least` of them (so that
    every call's selection has the same width): a pass's positions are consecutive and end at end - 1 or before,
    so the call's last query is at end - S + stop - 1 at most; the keys past it are causal-masked for every query
    of the call (a long prefill chunk's first calls skip up to the chunk's length)."""
    return max(end - S + min(stop, S), min(least, end))


def indexer_scores(q, keys, weights, positions):
    """score[s, t] = sum_h w[s,h] * relu(q[s,h] . k[t]) * head_dim^-0.5; -inf where t > positions[s].

    q [S, H, D], keys [T, D], weights [S, H] fp32, positions [S] int64 -> [S, T] fp32.
    """
    T = keys.shape[0]
    logits = torch.einsum("shd,td->sht", q.float(), keys.float()) * q.shape[-1] ** -0.5
    scores = torch.einsum("sh,sht->st", weights, F.relu(logits))
    causal = torch.arange(T, device=q.device)[None, :] > positions[:, None]
    return scores.masked_fill(causal, float("-inf"))


def topk_indices(scores, k: int):
    """Top-min(k, T) positions per row of scores [S, T]; -1 where the score is -inf (not a valid token)."""
    values, idx = scores.topk(min(k, scores.shape[-1]), dim=-1)
    return idx.masked_fill(values == float("-inf"), -1)


def sparse_mla(q_lat, q_pe, latent, indices, kv_lora_rank: int, scale: float):
    """Absorbed-form sparse MLA over the latent rows each query selected.

    q_lat [S, H, L] (q_nope through W_UK), q_pe [S, H, R], latent [T, L+R] = [c | k_pe],
    indices [S, K] (int64, -1 = none) -> (o [S, H, L] (the softmax-weighted sum of c), lse [S, H] (the log-sum-exp
    of the scaled scores; -inf and o 0 for a row with no valid index)), fp32.
    latent may be in the FP8 form (uint8 rows, kv_rows.quantize_latent): rows are dequantised.
    The result depends only on the selected rows' values in index order, not on where they sit in latent.
    """
    S, H = q_lat.shape[:2]
    K = indices.shape[1]
    out = torch.empty(S, H, kv_lora_rank, dtype=torch.float32, device=latent.device)
    lse = torch.empty(S, H, dtype=torch.float32, device=latent.device)
    chunk = max(1, SCORE_BUDGET // (K * max(H, latent.shape[1])))
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        idx = indices[s0:s1]
        rows = latent[idx.clamp(min=0)]  # [s, K, L+R]
        rows = dequantize_latent(rows.flatten(0, 1), kv_lora_rank).view(s1 - s0, K, -1) if latent.dtype == torch.uint8 \
            else rows.float()
        c, k_pe = rows[..., :kv_lora_rank], rows[..., kv_lora_rank:]
        scores = (torch.einsum("shl,skl->shk", q_lat[s0:s1].float(), c)
                  + torch.einsum("shr,skr->shk", q_pe[s0:s1].float(), k_pe))
        scores = (scores * scale).masked_fill((idx < 0)[:, None, :], float("-inf"))
        lse[s0:s1] = scores.logsumexp(dim=-1)
        probs = scores.softmax(dim=-1).masked_fill_(lse[s0:s1, :, None] == float("-inf"), 0.0)  # no row: o 0
        out[s0:s1] = torch.einsum("shk,skl->shl", probs, c)
    return out, lse


def merge_attention(o, lse, o2, lse2):
    """o, lse (as sparse_mla returns) become the attention over both row sets, given o2, lse2 over the others:
    each part weighted by its share of the summed exponentials. In place; o2 is overwritten."""
    total = torch.logaddexp(lse, lse2)
    safe = total.masked_fill(total == float("-inf"), 0.0)  # no row in either: both weights 0, o stays 0
    o.mul_((lse - safe).exp_()[..., None]).add_(o2.mul_((lse2 - safe).exp_()[..., None]))
    lse.copy_(total)


class Attention(nn.Module):
    """MLA with a latent-only cache; DSA selects the rows each query attends to."""

    def __init__(self, config: ModelConfig, layer: int, indexer: type = Indexer):
        """indexer: the class of a full layer's indexer (GLM-5.3-Flash's family passes its pooled one)."""
        super().__init__()
        self.layer = layer
        self.n_heads = config.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.interleaved = config.rope_interleave
        self.scale = config.softmax_scale
        self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)
        self.q_b_proj = Linear(config.q_lora_rank, self.n_heads * (self.nope + self.rope_dim))
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, self.kv_lora_rank + self.rope_dim)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.n_heads * (self.nope + self.v_dim))
        self.o_proj = Linear(self.n_heads * self.v_dim, config.hidden_size)
        self.indexer = indexer(config) if config.indexer_types[layer] == "full" else None
        self.latent_layout: LatentLayout | None = None  # its operator sets it
        # the projections of x in SAME_INPUT's order at once (a list of their outputs), where their operator can
        # (Operator.fuse; set by the loader)
        self.fused_inputs = None

    SAME_INPUT = ("q_a_proj", "kv_a_proj_with_mqa", "indexer.wk")  # the projections that read the layer's input x

    def input_projections(self, x):
        """(q_a_proj(x), kv_a_proj_with_mqa(x), the indexer's wk(x) or None where it is left to the indexer)."""
        if self.fused_inputs is None:
            return self.q_a_proj(x), self.kv_a_proj_with_mqa(x), None
        q_a, kv_a, *wk = self.fused_inputs(x)
        return q_a, kv_a, wk[0] if wk else None

    def rope(self, t, cos, sin):
        """The query's or key's rope part t [S, (H,) rope_dim] rotated (plain torch here)."""
        return apply_rope(t, cos, sin, self.interleaved)

    def attend(self, q_lat, q_pe, latent, indices, span=None, into=None):
        """Sparse MLA over the selected latent rows -> (o [S, H, kv_lora_rank], lse [S, H]) fp32 (plain torch
        here). span [S, 2] int32, if given: the run of each row of indices that holds its valid ones (a kernel may
        read only that). into: (o, lse) over other rows (an earlier key slab's), merged with these in place and
        returned."""
        part = sparse_mla(q_lat, q_pe, latent, indices, self.kv_lora_rank, self.scale)
        if into is None:
            return part
        merge_attention(*into, *part)
        return into

    def forward(self, x, cos, sin, cache, positions, end: int, shared_indices):
        """x [S, hidden] at positions [S] (int64, on x's device), end >= positions[-1] + 1 (Indexer.forward)
        -> (out [S, hidden], the selected indices [S, K] for the shared layers above)."""
        with span("attention", x.device):
            return self._forward(x, cos, sin, cache, positions, end, shared_indices)

    def _forward(self, x, cos, sin, cache, positions, end, shared_indices):
        S = x.shape[0]
        q_a, kv_a, k = self.input_projections(x)
        qr = self.q_a_layernorm(q_a)
        w = self.kv_b_weight(x)
        beside = S <= BESIDE_ROWS
        # a decode step's query (q_b_proj, rope, W_UK) on a GPU's side stream, beside the cache's write, the indexer
        # and the tiered fetch (each a chain of small kernels); a full layer's latent row is written there too (that
        # stream has slack while the indexer selects)
        with Beside(x.device, on=beside) as query:
            q_lat, q_pe = self.query(qr, cos, sin, w)
            if self.indexer is not None:
                self.write_latent(kv_a, cos, sin, cache, positions)
        if self.indexer is None:
            self.write_latent(kv_a, cos, sin, cache, positions)
            indices = shared_indices
        else:
            with span("indexer", x.device):  # inside "attention": `glm5 bench` shows it as a part of it
                keys = cache.index_keys[self.layer]
                # the indexer's key and head weights on a second side stream, beside its query (wq_b and its rope)
                with Beside(x.device, on=beside, stream=1) as writes:
                    weights = self.indexer.write(x, cos, sin, keys, positions, k)
                q = self.indexer.query(qr, cos, sin)
                writes.join()
                indices = self.indexer.selected(q, keys, weights, positions, end)
        # the query, and a full layer's latent row, before the fetch reads and updates the cache's tables (a shared
        # layer's fetch ran earlier: IndexShare's prefetch)
        query.join()
        o_lse = None  # a key slab of the cache after the first merges into the earlier ones' attention
        for latent, rows, runs in cache.row_slabs(self.layer, indices.to(x.device), positions, end):
            o_lse = self.attend(q_lat, q_pe, latent, rows, runs, into=o_lse)
        out = self.absorb_output(o_lse[0], w, x.dtype)
        return self.o_proj(out.reshape(S, -1)), indices

    def write_latent(self, kv_a, cos, sin, cache, positions):
        """The cache rows [kv_a_layernorm(c) | k_pe roped] of kv_a [S, kv_lora_rank + rope_dim] (kv_a_proj_with_mqa's
        output) written at positions [S]."""
        c, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.rope_dim:
            k_pe = self.rope(k_pe, cos, sin)
        cache.write_latent(self.layer, positions, torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1))

    def query_parts(self, qr):
        """q_b_proj(qr) for qr [S, q_lora_rank], split per head into (q_nope [S, H, nope], q_pe [S, H, rope_dim])
        (views)."""
        q = self.q_b_proj(qr).view(qr.shape[0], self.n_heads, self.nope + self.rope_dim)
        return q.split([self.nope, self.rope_dim], dim=-1)

    def query(self, qr, cos, sin, w):
        """The absorbed query: (q_lat [S, H, kv_lora_rank] fp32, q_nope through W_UK; q_pe roped)."""
        q_nope, q_pe = self.query_parts(qr)
        if self.rope_dim:  # GLM-5.3-Flash's has none
            q_pe = self.rope(q_pe, cos, sin)
        return self.absorb_query(q_nope, w), q_pe

    def kv_b_weight(self, x):
        """kv_b_proj's W in the form absorb_query and absorb_output take, once a forward: here dense, as
        [H, nope + v_head_dim, kv_lora_rank] (per head: W_UK's rows, then W_UV's)."""
        return self.kv_b_proj.dense_weight().to(x.device).view(self.n_heads, self.nope + self.v_dim, self.kv_lora_rank)

    def absorb_query(self, q_nope, w):
        """q_nope [S, H, nope] through W_UK -> q_lat [S, H, kv_lora_rank] fp32."""
        return torch.einsum("shd,hdl->shl", q_nope.float(), w[:, : self.nope].float())

    def absorb_output(self, o, w, dtype):
        """o [S, H, kv_lora_rank] fp32 through W_UV (in fp32) -> [S, H, v_head_dim] in dtype (o_proj's input)."""
        return torch.einsum("shl,hvl->shv", o, w[:, self.nope :].float()).to(dtype)
