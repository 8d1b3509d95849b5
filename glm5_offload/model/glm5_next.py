"""GLM-5.3-Flash (`glm5_next`, the text model): decoder layers of KDA linear attention (kda.py) or MLA with a pooled
DSA indexer and no rope (mla.py, pooled_indexer.py), a dense or MoE MLP with swiglu_limit, and hyper-connections:
the residual stream is hc_mult parallel streams, which each layer mixes before attention and before the MLP.

Names follow transformers' Glm5NextForConditionalGeneration, whose checkpoint holds the text model under
`model.language_model.` (read as `model.`) and the hyper-connection tensors as `hc_attn_fn` ... (read as
`attn_hc.fn` ...): checkpoint.py maps them. x is [S, hc_mult, hidden] between layers.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..util import span
from .blocks import MLP, MoE, RMSNorm, summed
from .glm_moe_dsa import Backbone as DsaBackbone
from .glm_moe_dsa import CausalLM as DsaCausalLM
from .kda import KDA
from .mla import Attention
from .pooled_indexer import PooledIndexer
from .steps import Pass, beside_host


class HyperConnection(nn.Module):
    """Mixes the hc_mult residual streams around one sublayer (mHC): from the streams [S, M, D] it derives
    `pre` (the weights that collapse them into the sublayer's input), `post` (where its output goes back) and
    `comb` (an M x M doubly stochastic matrix, by Sinkhorn iterations, that mixes the streams)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        M = config.hc_mult
        self.fn = nn.Parameter(torch.empty((2 + M) * M, M * config.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + M) * M))
        self.scale = nn.Parameter(torch.empty(3))
        self.mult, self.iters, self.eps, self.norm_eps = M, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps

    def forward(self, streams):
        """streams [S, M, D] -> (post [S, M] fp32, comb [S, M, M] fp32, the sublayer's input [S, D])."""
        M = self.mult
        flat = streams.flatten(1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        pre, post, comb = F.linear(flat, self.fn.float()).split([M, M, M * M], dim=-1)
        base_pre, base_post, base_comb = self.base.float().split([M, M, M * M])
        pre = torch.sigmoid(pre * self.scale[0] + base_pre) + self.eps
        post = 2 * torch.sigmoid(post * self.scale[1] + base_post)
        comb = torch.softmax(comb.view(-1, M, M) * self.scale[2] + base_comb.view(M, M), dim=-1) + self.eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        return post, comb, (pre[..., None] * streams).sum(1).to(streams.dtype)

    def merge(self, streams, out, post, comb):
        """The streams after the sublayer: stream i = post_i * out + sum_j comb[j, i] * streams_j."""
        dtype = streams.dtype
        return post.to(dtype)[..., None] * out.to(dtype)[:, None, :] + comb.to(dtype).transpose(-1, -2) @ streams


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = (KDA(config, layer) if config.attention_type(layer) == "kda"
                          else Attention(config, layer, PooledIndexer))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.mlp_layer_types[layer] == "moe"
        self.mlp = MoE(config) if moe else MLP(config.hidden_size, config.intermediate_size, config.swiglu_limit)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def steps(self) -> list:
        def attend(s: Pass):
            post, comb, h = self.attn_hc(s.x)
            h = self.input_layernorm(h)
            if isinstance(self.self_attn, KDA):
                out, s.indices = self.self_attn(h, s.cache.kda[self.layer]), None
            else:
                out, s.indices = self.self_attn(h, None, None, s.cache, s.positions, s.end, s.indices)
            s.x = self.attn_hc.merge(s.x, out.to(s.x.device), post, comb)

        def enter(s: Pass):
            s.hc_post, s.hc_comb, h = self.ffn_hc(s.x)
            return self.post_attention_layernorm(h)

        def leave(s: Pass, parts: tuple):
            s.x = self.ffn_hc.merge(s.x, summed(parts, s.x), s.hc_post, s.hc_comb)

        def dense(s: Pass):
            with span("dense", s.x.device):
                leave(s, (self.mlp(enter(s)),))

        if isinstance(self.mlp, MoE):
            return [attend] + self.mlp.steps(enter, leave)
        return [attend, dense]


class Backbone(DsaBackbone):
    decoder_layer = DecoderLayer


class CausalLM(DsaCausalLM):
    """The text model: embedding copied into hc_mult streams, the layers, the streams' mean, norm, lm_head."""

    backbone = Backbone

    def steps(self) -> list:
        moe = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]
        mult = self.config.hc_mult

        def prepare(s: Pass):
            moe[0].experts.prepare(s.tokens.shape[0], s.tokens.device)

        def embed(s: Pass):
            s.x = self.model.embed_tokens(s.tokens)[:, None, :].expand(-1, mult, -1).contiguous()

        def head(s: Pass):
            x = s.x[-1:] if s.last_only else s.x
            s.logits = self.lm_head(self.model.norm(x.mean(1))).float()

        steps = [prepare, embed] if moe else [embed]
        for layer in self.model.layers:
            shared = self.shared_after.get(layer.layer)
            steps += beside_host(layer.steps(), *self.prefetch(shared)) if shared else layer.steps()
        return steps + [head]
