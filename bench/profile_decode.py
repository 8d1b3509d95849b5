"""Where a decode step's wall time goes, by torch.profiler: the ops that take the most host time, the GPU's
busy time per step and the kernel launches per step. Decode is launch-bound when the GPU's busy time is far
below the step's wall time.

    PYTHONPATH=.:bench python3 bench/profile_decode.py --model DIR --rules glm5 [--context 4096] [--steps 8]
        [--filled]

--filled: decode after a context of random cache rows instead of its prefill (bench_context.fill: a 1M context's
step in seconds).
"""

import argparse
import time

import torch
from bench_context import fill
from torch.profiler import ProfilerActivity, profile

from glm5_offload.loader import load_model
from glm5_offload.rules import load_rules
from glm5_offload.runtime.engine import Engine


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rules", default="glm5")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--filled", action="store_true", help="a context of random cache rows, not prefilled")
    args = parser.parse_args(argv)
    max_seq_len = args.context + 4 * args.steps
    model = load_model(args.model, rules=load_rules(args.rules), max_seq_len=max_seq_len)
    engine = Engine(model, max_seq_len=max_seq_len, prefill_chunk=4096)
    engine.stop_ids = set()
    if args.filled:  # the cached rows are the prompt's prefix: one token prefilled, then the warm-up steps
        fill(engine, args.context)
        first = engine.generate(engine.cache_ids + [0], args.steps)
        ids = first.prompt_ids + first.output_ids  # the profiled steps continue them (a rewind frees hot slots)
    else:
        prompt = torch.randint(0, model.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
        first = engine.generate(prompt.tolist(), args.steps)  # prefill, and the warm-up steps
        ids = first.prompt_ids + first.output_ids
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.generate(ids, args.steps + 1)  # steps decode forwards after the one-token "prefill"
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    steps = args.steps + 1
    gpu_us = sum(e.self_device_time_total for e in events if e.self_device_time_total > 0)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows))
    print(f"per forward: wall {wall / steps * 1e3:.2f} ms, GPU busy {gpu_us / steps / 1e3:.2f} ms, "
          f"{launches / steps:.0f} kernel launches, layers {model.config.num_hidden_layers}")


if __name__ == "__main__":
    main()
