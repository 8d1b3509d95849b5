"""Where a long prefill chunk's GPU time goes, by torch.profiler: one chunk at the end of a long context (the
rows before it random, as bench_context fills them: no prefill of them), its kernels by GPU time.

    PYTHONPATH=.:bench python3 bench/profile_prefill.py --dir /tmp/g52 [--preset glm-5.2 --layers 2 --fp8]
        [--rules glm5 --gpu-ring 256 --sampled-topk] [--context 1048576] [--chunk 65536] [--rows 30]
"""

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench_context import fill
from bench_e2e import with_kwargs
from glm5_offload.loader import load_model
from glm5_offload.rules import load_rules
from glm5_offload.runtime.engine import Engine
from glm5_offload.tiny import make_tiny


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, help="the checkpoint (written here with make-tiny if absent)")
    parser.add_argument("--preset", default="glm-5.2")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--rules", default="glm5")
    parser.add_argument("--gpu-ring", type=int)
    parser.add_argument("--sampled-topk", action=argparse.BooleanOptionalAction,
                        help="indexer.dsa_triton's sampled_topk in the rules (default: the rule file's)")
    parser.add_argument("--device")
    parser.add_argument("--context", type=int, default=1 << 20)
    parser.add_argument("--chunk", type=int, default=65536)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args(argv)
    if not (Path(args.dir) / "config.json").is_file():
        make_tiny(Path(args.dir), preset=None if args.preset == "tiny" else args.preset, layers=args.layers,
                  fp8=args.fp8)
    rules = load_rules(args.rules)
    if args.gpu_ring:
        rules = with_kwargs(rules, "experts.numba", {"gpu_ring": args.gpu_ring}, "--gpu-ring")
    if args.sampled_topk is not None:
        rules = with_kwargs(rules, "indexer.dsa_triton", {"sampled_topk": args.sampled_topk}, "--sampled-topk")
    model = load_model(args.dir, rules=rules, device=args.device, max_seq_len=args.context)
    engine = Engine(model, max_seq_len=args.context, prefill_chunk=args.chunk)
    before = args.context - args.chunk
    fill(engine, before)
    tokens = torch.randint(0, model.config.vocab_size, (args.chunk,), device=model.device)
    cuda = torch.cuda.is_available() and model.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model(tokens, engine.cache, logits_for="last")  # kernels compiled, buffers allocated
    engine.cache.rewind(before)
    sync()
    t0 = time.perf_counter()
    model(tokens, engine.cache, logits_for="last")
    sync()
    wall = time.perf_counter() - t0
    engine.cache.rewind(before)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        model(tokens, engine.cache, logits_for="last")
        sync()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(events.table(sort_by=key, row_limit=args.rows))
    busy = sum(getattr(e, key) for e in events if getattr(e, key) > 0) / 1e6
    print(f"chunk of {args.chunk} tokens after {before}: wall {wall:.2f} s unprofiled, {'GPU' if cuda else 'CPU'} busy "
          f"{busy:.2f} s profiled, {model.config.num_hidden_layers} layers")


if __name__ == "__main__":
    main()
