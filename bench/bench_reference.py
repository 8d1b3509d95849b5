"""The plain-torch reference path on real GLM-5 dims: one MoE decoder layer, decode and prefill.

These are the figures the Triton and numba paths are measured against. Weights are random bf16
(normal, 1/sqrt(fan_in)); the latent and indexer-key caches hold random rows for the whole context.
"""

from importlib import resources

import torch

from glm5_offload.config import load_config
from glm5_offload.model import DecoderLayer, LatentLayout, Pass, run_steps
from glm5_offload.model.rope import cos_sin, inv_freq_and_scaling
from glm5_offload.runtime.kv_cache import KVCache

from ceilings import time_ms

LAYER = 3  # the first MoE layer; full (owns an indexer) in GLM-5


def glm5_config():
    return load_config(resources.files("glm5_offload") / "presets" / "glm-5.json")


def random_layer(config, device="cuda", dtype=torch.bfloat16):
    """Decoder layer LAYER of config with random weights, made in place on device."""
    with torch.device("meta"):
        layer = DecoderLayer(config, LAYER).to(dtype)
    layer.mlp.gate.float()
    if layer.self_attn.indexer is not None:
        layer.self_attn.indexer.weights_proj.float()
    layer = layer.to_empty(device=device)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
            else:
                p.zero_()
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.01)
    return layer


def layer_weight_bytes(config, layer) -> tuple[int, int]:
    """Bytes a decode token reads: all non-expert weights, and the active experts (top-k + shared)."""
    expert = sum(p.numel() * p.element_size() for p in layer.mlp.experts[0].parameters())
    other = sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if ".experts." not in n)
    return other, expert * config.num_experts_per_tok


def bench_layer(context: int, prefill_chunk: int = 512):
    config = glm5_config()
    layer = random_layer(config)
    device, dtype = torch.device("cuda"), torch.bfloat16
    layout = LatentLayout(device, device if layer.self_attn.indexer is not None else None)
    cache = KVCache(config, context + prefill_chunk, [layout] * (LAYER + 1), dtype)  # layers below LAYER unused
    cache.latent[LAYER].normal_()
    cache.index_keys[LAYER].normal_()
    inv_freq, scaling = inv_freq_and_scaling(config)
    results = {}
    for name, n in (("decode", 1), ("prefill", prefill_chunk)):
        x = torch.randn(n, config.hidden_size, device=device, dtype=dtype)
        positions = torch.arange(context, context + n, device=device)
        cos, sin = cos_sin(inv_freq, scaling, positions)

        def run():
            s = Pass(None, positions, context + n, cache)
            s.x, s.cos, s.sin = x, cos, sin
            run_steps(layer.steps(), s)

        with torch.no_grad():
            ms = time_ms(run, warmup=2, iters=10)
        results[name] = ms
    other, experts = layer_weight_bytes(config, layer)
    latent_bytes = min(context, config.index_topk) * config.latent_dim * 2 + context * config.index_head_dim * 2
    return {
        "context": context,
        "decode_ms": results["decode"],
        "prefill_tok_s": prefill_chunk / results["prefill"] * 1e3,
        "decode_bytes": other + experts + latent_bytes,
    }
