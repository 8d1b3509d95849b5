"""Where a prefill chunk's routed experts should run: one MoE layer of GLM-5's real dims (256 experts of
2048, 8 per token, random weights) for chunks of growing size, on the CPU cores (numba) and streamed to
the GPU (each active expert's packed weights through pinned memory, dequantised there, bf16 matmuls).
The chunk size where the GPU path wins is the `gpu_tokens` kwarg of experts.numba to set; it is
measured here, not guessed. Both against the host's read bandwidth and the pinned copy bandwidth
measured in the same run.

    PYTHONPATH=.:bench python3 bench/bench_prefill_experts.py [--format int4] [--chunks 64,256,1024,4096]
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import bench_experts
import ceilings
from glm5_offload.expert_ring import ExpertRing
from glm5_offload.experts_numba import NumbaExperts

HIDDEN, INTER, EXPERTS, TOP_K = 6144, 2048, 256, 8


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", default="int4", choices=["bf16", "int8", "int4"])
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--chunks", default="64,256,1024,4096")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--profile", action="store_true",
                        help="also profile the GPU path on the last chunk (torch.profiler: host and GPU time per op)")
    args = parser.parse_args(argv)
    v13, s13, v2, s2 = bench_experts.random_layer(args.format, EXPERTS, args.group)
    experts = NumbaExperts({"w13": v13, "s13": s13, "w2": v2, "s2": s2}, args.format, args.group, args.threads)
    layer_bytes = sum(a.nbytes for a in (v13, s13, v2, s2))
    cuda = torch.cuda.is_available()
    h2d = None
    if cuda:
        src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
        dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        h2d = (1 << 30) / ceilings.time_ms(lambda: dst.copy_(src, non_blocking=True)) / 1e6
        w13 = torch.from_numpy(v13[0])  # one expert's packed w13 into a pinned buffer, as the GPU path stages it
        pinned = torch.empty(w13.shape, dtype=w13.dtype).pin_memory()

        def host_copy_gb_s():
            pinned.copy_(w13)
            t0 = time.perf_counter()
            for _ in range(10):
                pinned.copy_(w13)
            return 10 * w13.nbytes / (time.perf_counter() - t0) / 1e9

        on_stager = ExpertRing.on(torch.device("cuda", 0), {"w13": v13}).stager.submit(host_copy_gb_s).result()
        print(f"host copy of an expert's w13 into pinned memory: {host_copy_gb_s():.1f} GB/s on this thread, "
              f"{on_stager:.1f} GB/s on the expert ring's staging thread", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    chunks = [int(c) for c in args.chunks.split(",")]
    for tokens in chunks:
        x = torch.from_numpy(rng.standard_normal((tokens, HIDDEN), np.float32))
        ids = torch.from_numpy(np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(tokens)]))
        w = torch.from_numpy(rng.random((tokens, TOP_K), np.float32))
        experts.forward(x[:2], ids[:2], w[:2])  # compile / warm
        t0 = time.perf_counter()
        experts.forward(x, ids, w)
        cpu_s = time.perf_counter() - t0
        row = {"tokens": tokens, "active_experts": int(ids.unique().numel()), "cpu_ms": cpu_s * 1e3}
        if cuda:
            xg, idg, wg = x.cuda().bfloat16(), ids.cuda(), w.cuda()
            experts.on_device(xg[:2], idg[:2], wg[:2])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            experts.on_device(xg, idg, wg)
            torch.cuda.synchronize()
            gpu_s = time.perf_counter() - t0
            moved = sum(a[e].nbytes for e in ids.unique().tolist() for a in (v13, s13, v2, s2) if a.ndim == 3)
            row.update(gpu_ms=gpu_s * 1e3, streamed_gb_s=moved / gpu_s / 1e9, of_h2d=moved / gpu_s / 1e9 / h2d)
            if args.profile and tokens == chunks[-1]:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    experts.on_device(xg, idg, wg)
                    torch.cuda.synchronize()
                for key in ("self_cpu_time_total", "self_device_time_total"):
                    print(prof.key_averages().table(sort_by=key, row_limit=15), flush=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    crossover = next((r["tokens"] for r in rows if "gpu_ms" in r and r["gpu_ms"] < r["cpu_ms"]), None)
    print(f"\nlayer: {args.format}/g{args.group}, {layer_bytes / 2**30:.2f} GiB; pinned H2D copy "
          f"{h2d or 0:.1f} GB/s; GPU path faster from {crossover} tokens" if cuda else "\n(no GPU: CPU figures only)")
    print("| chunk tokens | active experts | CPU ms | GPU-streamed ms | streamed GB/s (of H2D) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        gpu = (f"{r['gpu_ms']:.1f} | {r['streamed_gb_s']:.1f} ({r['of_h2d']:.0%})" if "gpu_ms" in r else "- | -")
        print(f"| {r['tokens']} | {r['active_experts']} | {r['cpu_ms']:.1f} | {gpu} |")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
