"""transformers' own GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM on a checkpoint, as a transformers user
runs it: (a) all on one device, (b) the routed experts offloaded to the host through accelerate's
device_map (each MoE layer's experts move to the GPU when the layer runs). The figures to set beside
`glm5 bench` on the same checkpoint: per-layer decode time and prefill speed.

    PYTHONPATH=.:bench python3 bench/bench_peer.py --model DIR [--context 4096] [--new-tokens 8]
        [--modes all,offload] [--device cuda]
"""

import argparse
import json
import sys
import time

import torch

from glm5_offload.config import load_config


def offload_map(model_dir: str, device: str) -> dict[str, str]:
    """Every module on `device` except each MoE layer's routed experts, which stay on the host."""
    config = load_config(model_dir)
    placement = {"model.embed_tokens": device, "model.norm": device, "model.rotary_emb": device, "lm_head": device}
    for i, kind in enumerate(config.mlp_layer_types):
        for part in ("self_attn", "input_layernorm", "post_attention_layernorm"):
            placement[f"model.layers.{i}.{part}"] = device
        if kind == "moe":
            placement.update({f"model.layers.{i}.mlp.gate": device, f"model.layers.{i}.mlp.shared_experts": device,
                              f"model.layers.{i}.mlp.experts": "cpu"})
        else:
            placement[f"model.layers.{i}.mlp"] = device
    return placement


def sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(model_dir: str, device: str, offload: bool, context: int, new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    if offload:  # accelerate's hooks (the machine needs accelerate installed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                     device_map=offload_map(model_dir, device))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    model.eval()
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    with torch.no_grad():
        model(ids[:, :16])  # warm-up
        sync(device)
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)  # prefill
        sync(device)
        prefill_s = time.perf_counter() - t0
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        steps = []
        for _ in range(new_tokens):  # greedy decode, one token a step, as generate() does
            t0 = time.perf_counter()
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            sync(device)
            steps.append(time.perf_counter() - t0)
        decode_s = sorted(steps)[len(steps) // 2]
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"mode": "offload" if offload else "all on " + device, "context": context, "layers": layers,
            "prefill_tok_s": context / prefill_s, "prefill_ms_per_layer": prefill_s / layers * 1e3,
            "decode_ms_per_token": decode_s * 1e3, "decode_ms_per_layer": decode_s / layers * 1e3}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--modes", default="all,offload", help="all: everything on --device; offload: experts on the host")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    results = [run(args.model, args.device, mode == "offload", args.context, args.new_tokens)
               for mode in args.modes.split(",")]
    print(json.dumps(results, indent=1))
    print("\n| transformers | context | prefill tok/s | prefill ms/layer | decode ms/token | decode ms/layer |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['mode']} | {r['context']} | {r['prefill_tok_s']:.0f} | {r['prefill_ms_per_layer']:.1f} | "
              f"{r['decode_ms_per_token']:.1f} | {r['decode_ms_per_layer']:.2f} |")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
