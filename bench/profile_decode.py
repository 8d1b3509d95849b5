"""Where a decode step's wall time goes, by torch.profiler: the ops that take the most host time, the GPU's
busy time per step and the kernel launches per step. Decode is launch-bound when the GPU's busy time is far
below the step's wall time. With CPU experts (decode from CUDA graphs) it also times each MoE layer's hand-offs from
the trace: the GPU's span from the host's signal to the next experts' inputs on the host, its kernels' busy time in
that span, and the host's waking after it (the critical path a step adds to its experts).

    PYTHONPATH=.:bench python3 bench/profile_decode.py --model DIR --rules glm5 [--context 4096] [--steps 8]
        [--filled]

--filled: decode after a context of random cache rows instead of its prefill (bench_context.fill: a 1M context's
step in seconds).
"""

import argparse
import statistics
import time

import torch
from bench_context import fill
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from glm5_offload.benchmark import moe_layer_line, moe_layer_step
from glm5_offload.loader import load_model
from glm5_offload.ops.experts_numba import NumbaExperts
from glm5_offload.rules import load_rules
from glm5_offload.runtime.engine import Engine


TO_HOST = ("_stage_kernel", "Memcpy DtoH (Device -> Pinned)")  # what writes the experts' inputs to the host


def busy_us(events) -> float:
    """The time any of events (device kernels and copies) runs: the union of their intervals."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e.time_range.start):
        start, stop = max(e.time_range.start, end), e.time_range.end
        total, end = total + max(0.0, stop - start), max(end, stop)
    return total


def hand_offs(prof) -> dict[str, list[tuple]]:
    """Each MoE layer of the trace after a host signal (its graph piece starts with the signal's wait kernel): (us
    from the wait's end to the last write of the experts' inputs into pinned memory (TO_HOST), the GPU's busy us and
    its kernels and copies in that span, us until the host returned from its wait for them, the wait's own us (a
    short one: the GPU came to it late, after the host's signal), those kernels and copies, the wait's end), keyed
    by what came before the signal's wait: another MoE layer, or the step's end (head, sampling, the next token's
    dense layers)."""
    events = prof.events()
    gpu = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    woke = sorted(e.time_range.end for e in events if e.name == "cudaEventSynchronize")
    waits = [i for i, e in enumerate(gpu) if e.name == "_wait_kernel"]
    out = {"after a MoE layer": [], "first of a step": []}
    for i, j in zip(waits, waits[1:]):
        inside = gpu[i + 1:j]
        copies = [k for k, e in enumerate(inside) if e.name in TO_HOST]
        if not copies:
            continue
        piece, ready = inside[:copies[-1] + 1], inside[copies[-1]].time_range.end
        host = next((t for t in woke if t >= ready), None)
        after = "first of a step" if any("Pageable" in e.name for e in piece) else "after a MoE layer"
        out[after].append((ready - gpu[i].time_range.end, busy_us(piece), len(piece),
                           None if host is None else host - ready, gpu[i].time_range.end - gpu[i].time_range.start,
                           piece, gpu[i].time_range.end))
    return out


def print_hand_offs(prof):
    print("| MoE layer | layers | signal to inputs on host us | GPU busy us | kernels and copies | gaps us "
          "| host wakes us | the signal's wait us (shortest) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    layers = hand_offs(prof)
    for after, rows in layers.items():
        if rows:
            span, busy, count, wake, wait = (statistics.median([v for v in col if v is not None] or [float("nan")])
                                             for col in list(zip(*rows))[:5])
            print(f"| {after} | {len(rows)} | {span:.1f} | {busy:.1f} | {count:.0f} | {span - busy:.1f} "
                  f"| {wake:.1f} | {wait:.1f} ({min(row[4] for row in rows):.1f}) |")
    for *_, piece, start in layers["after a MoE layer"][-1:]:  # the critical path in detail: which kernels, when
        print("\nthe last MoE layer after another, from the host's signal: us from it, us long, stream, kernel or copy")
        for e in piece:
            print(f"{e.time_range.start - start:7.1f} {e.time_range.end - e.time_range.start:6.1f} {e.thread:>4} "
                  f"{e.name[:90]}")


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
    shares = sorted({m.decode_gpu_experts for m in model.modules() if isinstance(m, NumbaExperts)})
    if shares:  # (auto's pick: what the GPU's piece beside the cores holds)
        print(f"decode_gpu_experts: {', '.join(map(str, shares))} of a decode token's experts on the GPU")
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
    layer = engine.graphs and moe_layer_step(engine.graphs.seconds, dict.fromkeys(engine.graphs.seconds, 0.0),
                                             engine.graphs.later_layers)
    if layer:  # the host's own count over the warm-up steps (replayed, unprofiled), to set beside the trace's
        print("warm-up steps, by the host's clock:" + moe_layer_line(layer)[1:])
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
    print_hand_offs(prof)


if __name__ == "__main__":
    main()
