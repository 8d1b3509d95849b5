"""End to end on a GLM-5-shaped checkpoint, and the projection of its per-layer figures to the full models.

    PYTHONPATH=.:bench python3 bench/bench_e2e.py --dir /tmp/g5 [--preset glm-5 --layers 2] [--rules glm5-1m]
        [--contexts 4096,131072] [--new-tokens 16] [--prefill-chunk 16384] [--peer all,offload] [--json FILE]

Writes the checkpoint with make-tiny unless --dir holds one; at each context, a fresh engine and `glm5
bench`'s measurement (benchmark.run_benchmark); with --peer, transformers on the same checkpoint
(bench_peer.py) and our decode speed-up per layer over it; then the host's read bandwidth and the
projection to GLM-5 and GLM-5.2: the measured decode step scaled by their MoE layers (the whole step is
counted per MoE layer, which also charges it the dense layers, embedding and head: conservative), next to
the host-bandwidth bound (the active experts' bytes per token in the placement's format / read bandwidth);
and the last context's prefill, from its synchronised split, per layer kind (prefill_projection).
"""

import argparse
import json
import sys
from pathlib import Path

import bench_experts
import bench_peer
import torch

from glm5_offload.benchmark import format_table, run_benchmark
from glm5_offload.config import load_config
from glm5_offload.engine import Engine
from glm5_offload.experts_numba import NumbaExperts
from glm5_offload.loader import load_model
from glm5_offload.planner import active_expert_weights, expert_bytes
from glm5_offload.rules import load_rules
from glm5_offload.tiny import make_tiny

TARGETS = ("glm-5", "glm-5.2")


def expert_format(model) -> tuple[str, int] | None:
    """The CPU experts' (format, group size), or None when the routed experts are not experts.numba."""
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if isinstance(experts, NumbaExperts):
            return experts.fmt, experts.group
    return None


def bench_context(model_dir: Path, rules, context: int, new_tokens: int, prefill_chunk: int) -> tuple[dict, tuple | None]:
    max_seq_len = context + 2 * new_tokens  # the split's run extends the first one (as `glm5 bench`)
    model = load_model(model_dir, rules=rules, max_seq_len=max_seq_len)
    result = run_benchmark(Engine(model, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk), context, new_tokens)
    fmt = expert_format(model)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result, fmt


def projection(results: list[dict], measured_moe: int, fmt: tuple | None, read_gb_s: float) -> list[dict]:
    rows = []
    for target in TARGETS:
        config = load_config(target)
        moe = len(config.moe_layers)
        bound_ms = None if fmt is None else expert_bytes(active_expert_weights(config), *fmt) / read_gb_s / 1e6
        for r in results:
            ms = r["decode_ms_per_token"] * moe / measured_moe
            rows.append({"target": target, "context": r["context"], "measured_ms_per_token": r["decode_ms_per_token"],
                         "projected_ms_per_token": ms, "projected_tok_s": 1e3 / ms,
                         "bound_tok_s": None if bound_ms is None else 1e3 / bound_ms,
                         "of_bound": None if bound_ms is None else bound_ms / ms})
    return rows


def prefill_projection(result: dict, config) -> list[dict]:
    """The measured context's prefill (its synchronised split) scaled per layer kind to GLM-5 and GLM-5.2: the
    indexer per full layer, the rest of attention and the unmarked work per layer, the experts (and their
    transfers) per MoE layer."""
    split = result["prefill_split_s"]
    indexer_per_full = split["of which indexer"] / config.indexer_types.count("full")
    rest_per_layer = (split["attention"] - split["of which indexer"] + split["other"]) / config.num_hidden_layers
    experts_per_moe = (split["experts"] + split["transfers"]) / len(config.moe_layers)
    rows = []
    for target in TARGETS:
        t = load_config(target)
        parts = {"indexer": t.indexer_types.count("full") * indexer_per_full,
                 "rest": t.num_hidden_layers * rest_per_layer, "experts": len(t.moe_layers) * experts_per_moe}
        rows.append({"target": target, "context": result["context"], "parts_s": parts,
                     "projected_prefill_s": sum(parts.values())})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, help="the checkpoint (written here with make-tiny if absent)")
    parser.add_argument("--preset", default="glm-5")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rules", default="glm5-1m")
    parser.add_argument("--contexts", default="4096,131072")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=16384)
    parser.add_argument("--peer", default="", help="transformers modes beside ours: all, offload (bench_peer.py)")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)
    model_dir = Path(args.dir)
    if not (model_dir / "config.json").is_file():
        make_tiny(model_dir, preset=args.preset, layers=args.layers)
    rules = load_rules(args.rules)
    results, fmt = [], None
    for context in map(int, args.contexts.split(",")):
        result, fmt = bench_context(model_dir, rules, context, args.new_tokens, args.prefill_chunk)
        print(format_table(result), flush=True)
        results.append(result)
    config = load_config(model_dir)
    layers, measured_moe = config.num_hidden_layers, len(config.moe_layers)
    peers = []
    for mode in filter(None, args.peer.split(",")):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        peer = bench_peer.run(str(model_dir), device, mode == "offload", results[0]["context"], 4)
        ours = results[0]["decode_ms_per_token"] / layers
        peer["our_decode_speedup_per_layer"] = peer["decode_ms_per_layer"] / ours
        peers.append(peer)
        print(f"transformers ({peer['mode']}), context {peer['context']}: decode {peer['decode_ms_per_layer']:.2f} "
              f"ms/layer, ours {ours:.2f}: {peer['our_decode_speedup_per_layer']:.1f}x", flush=True)
    read_gb_s = bench_experts.read_bandwidth_gb_s()
    rows = projection(results, measured_moe, fmt, read_gb_s)
    print(f"\nprojection: {layers}-layer checkpoint ({measured_moe} MoE), experts {fmt}, host read {read_gb_s:.0f} GB/s")
    print("| model | context | measured ms/token | projected ms/token | tok/s | host-BW bound tok/s | of bound |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for p in rows:
        bound = "- | -" if p["bound_tok_s"] is None else f"{p['bound_tok_s']:.1f} | {p['of_bound']:.0%}"
        print(f"| {p['target']} | {p['context']} | {p['measured_ms_per_token']:.2f} | {p['projected_ms_per_token']:.0f} | "
              f"{p['projected_tok_s']:.2f} | {bound} |")
    prefill_rows = prefill_projection(results[-1], config)
    print(f"\nprefill projection from the {results[-1]['context']}-token prefill's split (chunks of {args.prefill_chunk})")
    print("| model | context | indexer s | rest of attention and other s | experts s | projected prefill |")
    print("| --- | --- | --- | --- | --- | --- |")
    for p in prefill_rows:
        parts = p["parts_s"]
        print(f"| {p['target']} | {p['context']} | {parts['indexer']:.0f} | {parts['rest']:.0f} | {parts['experts']:.0f} | "
              f"{p['projected_prefill_s']:.0f} s ({p['projected_prefill_s'] / 60:.1f} min) |")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "peers": peers, "read_gb_s": read_gb_s,
                                               "projection": rows, "prefill_projection": prefill_rows}, indent=1))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
