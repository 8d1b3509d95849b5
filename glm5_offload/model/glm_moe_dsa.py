"""GLM-5 / GLM-5.2 (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`): decoder layers of MLA with DSA and a dense
or MoE MLP, the embedding, the final norm and lm_head, named like the checkpoint and built on the meta device.

The forward is a list of steps on a Pass (steps.py): eagerly in `forward`, replayed from CUDA graphs by
runtime/decode_graphs.py. x is [S, hidden] for S new tokens at positions cache.length .. +S-1; the cache holds
every token before them and takes their rows.
"""

import torch
from torch import nn

from ..config import ModelConfig
from ..util import span
from .blocks import MLP, LMHead, MoE, RMSNorm
from .mla import Attention
from .rope import cos_sin, inv_freq_and_scaling
from .steps import Pass, beside_host, run_steps


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.mlp_layer_types[layer] == "moe"
        self.mlp = MoE(config) if moe else MLP(config.hidden_size, config.intermediate_size)

    def steps(self) -> list:
        """x += attention(norm(x)) (s.indices: its selection, or the full layer's it reused), then x += MLP(norm(x)).
        Each sublayer's output is left pending (s.add) for the next norm to add: one kernel for both (norm.triton)."""

        def attend(s: Pass):
            s.x, h = self.input_layernorm.add_forward(s.x, s.add)
            out, s.indices = self.self_attn(h, s.cos, s.sin, s.cache, s.positions, s.end, s.indices)
            s.add = (out,)

        def enter(s: Pass):
            s.x, h = self.post_attention_layernorm.add_forward(s.x, s.add)
            return h

        def leave(s: Pass, parts: tuple):
            s.add = parts

        def dense(s: Pass):
            with span("dense", s.x.device):
                leave(s, (self.mlp(enter(s)),))

        if not isinstance(self.mlp, MoE):
            return [attend, dense]
        return [attend] + self.mlp.steps(enter, leave)


class Backbone(nn.Module):
    """Checkpoint prefix `model.`: embeddings, decoder layers, final norm."""

    decoder_layer = DecoderLayer

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    backbone = Backbone

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = self.backbone(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)
        with torch.device("cpu"):
            self.inv_freq, self.rope_scaling = inv_freq_and_scaling(config)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}  # inv_freq copied to each device that used it
        self.shared_after: dict[int, list[int]] = {}  # full layer -> the shared layers that reuse its indices
        for i, kind in enumerate(config.indexer_types):
            if kind == "full":
                full = i
                self.shared_after[full] = []
            elif kind == "shared":
                self.shared_after[full].append(i)

    @property
    def device(self) -> torch.device:
        """Where the residual stream lives: where the embedding puts its rows (its table's device, or the out_device
        of a table kept in host memory)."""
        embed = self.model.embed_tokens
        return getattr(embed, "out_device", embed.weight.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def steps(self) -> list:
        """The whole forward as steps on a Pass: the first MoE layer's experts told how long the chunk is (a long
        one streams them to the GPU, under the layers before it), embedding and rope angles, each layer's steps
        (in a full layer with shared layers above it, IndexShare's fetch of their rows, beside the layer's CPU experts),
        the final norm and lm_head."""
        moe = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

        def prepare(s: Pass):
            moe[0].experts.prepare(s.tokens.shape[0], s.tokens.device)

        def embed(s: Pass):
            s.x, s.add = self.model.embed_tokens(s.tokens), ()
            if s.positions.device not in self._inv_freq_on:
                self._inv_freq_on[s.positions.device] = self.inv_freq.to(s.positions.device)
            s.cos, s.sin = cos_sin(self._inv_freq_on[s.positions.device], self.rope_scaling, s.positions)

        def head(s: Pass):
            x, add = (s.x[-1:], tuple(a[-1:] for a in s.add)) if s.last_only else (s.x, s.add)
            s.logits = self.lm_head(self.model.norm.add_forward(x, add)[1]).float()

        steps = [prepare, embed] if moe else [embed]
        for layer in self.model.layers:
            shared = self.shared_after.get(layer.self_attn.layer)
            steps += beside_host(layer.steps(), *self.prefetch(shared)) if shared else layer.steps()
        return steps + [head]

    @staticmethod
    def prefetch(shared_layers: list[int]) -> tuple:
        """Two steps: the shared layers' rows start moving in (tiered cache, on a side stream), overlapped with the
        GPU work queued after it; and the join a CUDA graph's capture needs before its piece ends (eagerly the
        layers in between overlap it too: each shared layer waits for its rows at its own write)."""
        def run(s: Pass):
            s.cache.prefetch(shared_layers, s.indices, s.positions)

        def join(s: Pass):
            s.cache.join_prefetch()
        return run, join

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache, logits_for: str = "all") -> torch.Tensor:
        """tokens [S] at positions cache.length .. +S-1; appends their rows to the cache.

        Returns logits [S, vocab] (fp32), or [1, vocab] for the last token with logits_for="last".
        """
        S, start = tokens.shape[0], cache.length
        cache.begin_pass(S)
        positions = torch.arange(start, start + S, device=self.device)
        s = Pass(tokens.to(self.device), positions, start + S, cache, last_only=logits_for == "last")
        run_steps(self.steps(), s)
        cache.length = start + S
        return s.logits
