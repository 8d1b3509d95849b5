"""Does the placement fit the GPU it claims to? A GLM-5-shaped checkpoint cut to a few layers, run with the process
capped at --cap GiB of GPU memory (torch.cuda.set_per_process_memory_fraction): one prefill of --context tokens,
decode from CUDA graphs, a second turn; the peak of GPU memory beside the planner's figure for the same checkpoint,
context and placement, and the planner's figure for the full model (--full) at that context.

    PYTHONPATH=.:bench python3 bench/bench_fit.py --dir /tmp/g52 [--preset glm-5.2 --layers 3 --fp8]
        [--rules glm5] [--context 1048576] [--cap 24] [--new-tokens 16] [--full glm-5.2] [--json FILE]
"""

import argparse
import json
import time
from pathlib import Path

import torch

from glm5_offload.benchmark import generate_split, random_prompt
from glm5_offload.config import load_config
from glm5_offload.loader import load_model
from glm5_offload.model import build_model
from glm5_offload.planner import make_plan
from glm5_offload.rules import load_rules, place
from glm5_offload.runtime.engine import Engine
from glm5_offload.tiny import make_tiny

GiB = 2**30


def cuda_plan(model_dir, rules, tokens: int, cap: int, prefill_chunk: int):
    config = load_config(model_dir)
    plan = make_plan(config, place(build_model(config), rules), tokens, {"cuda": cap, "cpu": None},
                     prefill_chunk=prefill_chunk)
    return next(d for d in plan.devices if d.device == "cuda"), plan


def run(args) -> dict:
    path = Path(args.dir)
    if not (path / "config.json").exists():
        make_tiny(path, preset=args.preset, layers=args.layers, fp8=args.fp8)
    rules = load_rules(args.rules)
    cap = args.cap * GiB
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    margin = 3 * args.new_tokens + 64  # the replies and the second turn's new tokens
    max_seq_len = min(args.context + margin, load_config(path).max_position_embeddings)
    args.context = max_seq_len - margin
    cut, _ = cuda_plan(path, rules, max_seq_len, cap, args.prefill_chunk)
    full, full_plan = cuda_plan(args.full, rules, args.context, cap, 2048)  # the engine's default chunk
    t0 = time.perf_counter()
    model = load_model(path, rules=rules, max_seq_len=max_seq_len, budgets={"cuda": cap})
    load_s = time.perf_counter() - t0
    engine = Engine(model, max_seq_len=max_seq_len, prefill_chunk=args.prefill_chunk)
    engine.stop_ids = set()
    prompt = random_prompt(engine, args.context, seed=0)
    torch.cuda.reset_peak_memory_stats()
    first = engine.generate(prompt, args.new_tokens)
    print(f"prefill {first.prefill_seconds:.1f} s, peak {torch.cuda.max_memory_allocated() / GiB:.2f} GiB", flush=True)
    # the second turn's replayed steps: ms per token
    second, split, _ = generate_split(engine, first.prompt_ids + first.output_ids + prompt[:32], args.new_tokens)
    return {
        "checkpoint": str(path), "layers": model.config.num_hidden_layers, "rules": rules.path, "context": args.context,
        "cap_bytes": cap, "load_s": load_s, "cuda_graphs": engine.graphs is not None,
        "prefill_s": first.prefill_seconds, "prefill_tok_s": first.prefill_tokens_per_s,
        "decode_tok_s": first.decode_tokens_per_s, "second_turn_prefilled": second.prefilled_tokens,
        "second_turn_decode_tok_s": second.decode_tokens_per_s, "graph_split_ms_per_token": split,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(), "planned_gpu_bytes": cut.total,
        "full_model": args.full, "full_planned_gpu_bytes": full.total, "full_fits": full_plan.fits,
        "full_parts": {k: getattr(full, k)
                       for k in ("weights", "latent_kv", "indexer_keys", "activations", "workspace")},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--preset", default="glm-5.2")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--rules", default="glm5")
    parser.add_argument("--context", type=int, default=1 << 20)
    parser.add_argument("--cap", type=float, default=24, help="GiB of GPU memory the process may use")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--full", default="glm-5.2", help="the full model (a preset) to plan at --context")
    parser.add_argument("--json")
    args = parser.parse_args()
    r = run(args)
    print(f"{r['layers']}-layer {args.preset} ({r['checkpoint']}), {Path(r['rules']).name}, {r['context']} tokens, "
          f"capped at {args.cap} GiB: load {r['load_s']:.0f} s, prefill {r['prefill_s']:.1f} s "
          f"({r['prefill_tok_s']:.0f} tok/s), decode {r['decode_tok_s']:.1f} tok/s (graphs: {r['cuda_graphs']}), "
          f"second turn {r['second_turn_prefilled']} tokens prefilled, "
          f"decode {r['second_turn_decode_tok_s']:.1f} tok/s")
    print(f"peak GPU memory {r['peak_gpu_bytes'] / GiB:.2f} GiB, planner {r['planned_gpu_bytes'] / GiB:.2f} GiB; "
          f"full {args.full} at {r['context']}: {r['full_planned_gpu_bytes'] / GiB:.2f} GiB "
          f"({'fits' if r['full_fits'] else 'does NOT fit'} {args.cap} GiB); decode split ms/token "
          f"{r['graph_split_ms_per_token']}")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
