"""The GLM-5 / DeepSeek-V3.2 module tree with its reference operators in plain torch.

Modules are named exactly like the checkpoint's tensors (`model.layers.3.mlp.experts.7.up_proj.weight`)
and are built on the meta device; the loader assigns real tensors. Every forward here is the plain
torch reference for one sequence (no batch dimension): x is [S, hidden] for S new tokens at
positions start .. start+S-1, and the latent KV cache holds everything before them.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kernels.dsa_triton import quantize_keys_reference
from .kv_cache import FP8Keys, KVCache, LatentLayout, dequantize_latent
from .rope import apply_rope, cos_sin, inv_freq_and_scaling
from .timeline import span

# Queries per attention chunk are bounded so that heads x queries x keys scores stay near this many.
_SCORE_BUDGET = 1 << 26


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear without bias or initialisation: every weight comes from the checkpoint."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self):
        pass




class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Dense layers, each routed expert and the shared expert."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inner)
        self.up_proj = Linear(hidden, inner)
        self.down_proj = Linear(inner, hidden)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid router with correction bias and group-limited top-k (checkpoint name `mlp.gate`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.empty(config.n_routed_experts, dtype=torch.float32))
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor

    def forward(self, x):
        """x [T, hidden] -> expert ids [T, top_k] (int64), weights [T, top_k] (fp32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(x.shape[0], self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(x.shape[0], -1)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class Experts(nn.ModuleList):
    """The routed experts, one MLP each (`mlp.experts.E.{gate,up,down}_proj`)."""

    def __init__(self, config: ModelConfig):
        super().__init__(MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.n_routed_experts))

    def begin(self, x, ids, weights):
        """Start the experts (MoE calls begin, then the shared expert, then finish); here: compute now."""
        with span("experts", x.device):
            return self(x, ids, weights)

    def finish(self, pending):
        return pending

    def forward(self, x, ids, weights):
        """x [T, hidden], ids/weights [T, top_k] -> sum_i w_i * expert_i(x)."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slot = torch.where(ids == e)
            y = self[e](x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )

    def forward(self, x):
        ids, weights = self.gate(x)
        pending = self.experts.begin(x, ids, weights)  # CPU experts: their input is on its way to the host
        shared = None if self.shared_experts is None else self.shared_experts(x)  # queued meanwhile
        out = self.experts.finish(pending).to(x.device)
        return out if shared is None else out + shared.to(x.device)


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
            return indexer_scores(q, keys.values[:end].float() * keys.scales[:end, None], weights, positions)
        return indexer_scores(q, keys[:end], weights, positions)

    def write_keys(self, k, cos, sin, keys, positions):
        """Rope the new keys k [S, head_dim] and write them into the cache rows at positions [S] (FP8: values
        and scales)."""
        k = self._rope(k, cos, sin)
        if isinstance(keys, FP8Keys):
            values, scales = quantize_keys_reference(k)
            keys.values.view(torch.uint8).index_copy_(0, positions, values.view(torch.uint8))  # no e4m3 kernel
            keys.scales.index_copy_(0, positions, scales)
        else:
            keys.index_copy_(0, positions, k.to(keys.dtype))

    def query_chunk(self, n_keys: int) -> int:
        """Queries scored per call: the reference holds [queries, heads, keys] logits at once."""
        return max(1, _SCORE_BUDGET // (self.n_heads * n_keys))

    def _rope(self, t, cos, sin):
        rot, rest = t.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rope(rot, cos, sin, self.interleaved), rest], dim=-1)

    def forward(self, x, qr, cos, sin, keys, positions, end: int):
        """x [S, hidden], qr [S, q_lora] of the tokens at positions [S] (int64, on x's device); keys: this
        layer's indexer-key cache rows (a tensor, or FP8Keys); end: scores cover keys 0..end-1 (>= the last
        position + 1; keys past a query's position score -inf).

        Returns the selected token positions [S, min(topk, end)] (int64), -1 where fewer are valid.
        """
        S = x.shape[0]
        q = self._rope(self.wq_b(qr).view(S, self.n_heads, self.head_dim), cos, sin)
        self.write_keys(self.k_norm(self.wk(x)), cos, sin, keys, positions)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
        chunk = self.query_chunk(end)
        return torch.cat([
            topk_indices(self.scores(q[s : s + chunk], keys, weights[s : s + chunk], positions[s : s + chunk], end),
                         self.topk)
            for s in range(0, S, chunk)
        ])


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
    indices [S, K] (int64, -1 = none) -> o [S, H, L] (the softmax-weighted sum of c), fp32.
    latent may be in the FP8 form (uint8 rows, kv_cache.quantize_latent): rows are dequantised.
    The result depends only on the selected rows' values in index order, not on where they sit in latent.
    """
    S, H = q_lat.shape[:2]
    K = indices.shape[1]
    out = torch.empty(S, H, kv_lora_rank, dtype=torch.float32, device=latent.device)
    chunk = max(1, _SCORE_BUDGET // (K * max(H, latent.shape[1])))
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        idx = indices[s0:s1]
        rows = latent[idx.clamp(min=0)]  # [s, K, L+R]
        rows = dequantize_latent(rows.flatten(0, 1), kv_lora_rank).view(s1 - s0, K, -1) if latent.dtype == torch.uint8 \
            else rows.float()
        c, k_pe = rows[..., :kv_lora_rank], rows[..., kv_lora_rank:]
        scores = torch.einsum("shl,skl->shk", q_lat[s0:s1].float(), c) + torch.einsum("shr,skr->shk", q_pe[s0:s1].float(), k_pe)
        scores = (scores * scale).masked_fill((idx < 0)[:, None, :], float("-inf"))
        out[s0:s1] = torch.einsum("shk,skl->shl", scores.softmax(dim=-1), c)
    return out


class Attention(nn.Module):
    """MLA with a latent-only cache; DSA selects the rows each query attends to."""


    def __init__(self, config: ModelConfig, layer: int):
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
        self.indexer = Indexer(config) if config.indexer_types[layer] == "full" else None
        self.latent_layout = LatentLayout()  # the loader sets it from the attention rule's kwargs

    def attend(self, q_lat, q_pe, latent, indices):
        """Sparse MLA over the selected latent rows -> o [S, H, kv_lora_rank] fp32 (plain torch here)."""
        return sparse_mla(q_lat, q_pe, latent, indices, self.kv_lora_rank, self.scale)

    def forward(self, x, cos, sin, cache: KVCache, positions, end: int, shared_indices):
        """x [S, hidden] at positions [S] (int64, on x's device), end >= positions[-1] + 1 (Indexer.forward)
        -> (out [S, hidden], the selected indices [S, K] for the shared layers above)."""
        with span("attention", x.device):
            return self._forward(x, cos, sin, cache, positions, end, shared_indices)

    def _forward(self, x, cos, sin, cache, positions, end, shared_indices):
        S = x.shape[0]
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(qr).view(S, self.n_heads, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin, self.interleaved)
        k_pe = apply_rope(k_pe, cos, sin, self.interleaved)
        cache.write_latent(self.layer, positions, torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1))

        if self.indexer is not None:
            with span("indexer", x.device):  # inside "attention": `glm5 bench` shows it as a part of it
                indices = self.indexer(x, qr, cos, sin, cache.index_keys[self.layer], positions, end)
        else:
            indices = shared_indices
        latent, rows = cache.rows_for(self.layer, indices.to(x.device), positions, end)

        wkv_b = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = wkv_b[:, : self.nope].float(), wkv_b[:, self.nope :].float()
        q_lat = torch.einsum("shd,hdl->shl", q_nope.float(), w_uk)  # [S, H, kv_lora_rank]
        o = self.attend(q_lat, q_pe, latent, rows)
        out = torch.einsum("shl,hvl->shv", o, w_uv).to(x.dtype)  # [S, H, v_head_dim]
        return self.o_proj(out.reshape(S, -1)), indices


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.mlp_layer_types[layer] == "moe"
        self.mlp = MoE(config) if moe else MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, cos, sin, cache, positions, end: int, shared_indices):
        h, indices = self.self_attn(self.input_layernorm(x), cos, sin, cache, positions, end, shared_indices)
        x = x + h.to(x.device)
        return x + self.mlp(self.post_attention_layernorm(x)).to(x.device), indices


class LMHead(Linear):
    """The output projection hidden -> vocab (its own class so a rule can place it by class)."""


class Backbone(nn.Module):
    """Checkpoint prefix `model.`: embeddings, decoder layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)
        with torch.device("cpu"):
            self.inv_freq, self.rope_scaling = inv_freq_and_scaling(config)
        self.shared_after = {}  # full layer -> the shared layers that reuse its indices
        for i, kind in enumerate(config.indexer_types):
            if kind == "full":
                full = i
                self.shared_after[full] = []
            else:
                self.shared_after[full].append(i)

    @property
    def device(self) -> torch.device:
        """Where the residual stream lives: the embedding's device."""
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, max_seq_len: int) -> KVCache:
        """A latent cache with each layer's rows on its attention's device, indexer keys on its indexer's."""
        attention = [layer.self_attn for layer in self.model.layers]
        return KVCache(
            self.config,
            max_seq_len,
            latent_devices=[a.kv_b_proj.weight.device for a in attention],
            index_devices={i: a.indexer.wk.weight.device for i, a in enumerate(attention) if a.indexer is not None},
            dtype=self.dtype,
            layouts=[a.latent_layout for a in attention],
        )

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: KVCache, logits_for: str = "all") -> torch.Tensor:
        """tokens [S] at positions cache.length .. +S-1; appends their rows to the cache.

        Returns logits [S, vocab] (fp32), or [1, vocab] for the last token with logits_for="last".
        """
        S, start = tokens.shape[0], cache.length
        cache.begin_pass(S)
        positions = torch.arange(start, start + S, device=self.device)
        cos, sin = cos_sin(self.inv_freq, self.rope_scaling, positions)
        x = self.model.embed_tokens(tokens)
        indices = None
        for layer in self.model.layers:
            x, indices = layer(x, cos, sin, cache, positions, start + S, indices)
            if layer.self_attn.indexer is not None:  # IndexShare: fetch the shared layers' rows meanwhile
                cache.prefetch(self.shared_after[layer.self_attn.layer], indices, positions)
        cache.length = start + S
        if logits_for == "last":
            x = x[-1:]
        return self.lm_head(self.model.norm(x)).float()


def build_model(config: ModelConfig) -> CausalLM:
    """The module tree on the meta device: shapes and names only, no memory."""
    with torch.device("meta"):
        return CausalLM(config)
