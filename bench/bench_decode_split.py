"""A decode token's routed experts split between the CPU cores and the GPU reading host memory, the case for giving
the GPU a share of decode's experts: one MoE layer of a real model's dims, the last n of the token's top-k on the GPU
(kernels/experts_from_host.py, replayed from a CUDA graph as decode runs it) beside the first top-k - n on the cores,
against n = 0 (the cores alone: today's decode) and the ceilings measured in the same run: the cores' read of host
memory and the GPU's copy of pinned host memory.

    PYTHONPATH=.:bench python3 bench/bench_decode_split.py [--preset glm-5] [--experts 64] [--gpu 0,1,2,3,4]
        [--format int4] [--runs 40] [--tiles 8x4x512,16x4x512,16x8x1024]

Each token routes to fresh random experts of the layer (64 by default: 1.3 GB of GLM-5 int4, far past the caches),
int8 activations as the shipped rules take them. Per n, the median token of `runs`: the cores' part alone, the GPU's
part alone, and both at once (the GPU's graph launched, then the cores' part on this thread, then a wait for the GPU);
the token's experts' bytes over that time, its ratio to n = 0 and to the cores' read ceiling. --tiles times the GPU's
part (3 experts) at each of the kernel's (rows, warps, a row's bytes read at once) per program, alone and beside
the cores' part of the others (whose reads may disturb a tile's more than another's).
"""

import argparse
import os
import time

import numba
import numpy as np
import torch

import bench_experts
import ceilings
from glm5_offload.errors import Glm5Error
from glm5_offload.kernels import experts_from_host, moe_cpu
from glm5_offload.kernels.host_read import read_bandwidth_gb_s
from glm5_offload.ops.expert_ring import page_locked

GROUP = 128


def graphed(layer, fmt, top_k, n) -> experts_from_host.GraphedSlots:
    return experts_from_host.GraphedSlots(experts_from_host.host_matrices(*layer), fmt, GROUP, True, None, top_k, n)


def choice(rng, experts, top_k) -> np.ndarray:
    """A token's top_k distinct experts of `experts`: [1, top_k] int64."""
    return rng.permutation(experts)[:top_k][None].astype(np.int64)


def token(rng, experts, top_k) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A decode token: its input [1, H] fp32, experts and weights [1, top_k]."""
    x = rng.standard_normal((1, bench_experts.HIDDEN), np.float32)
    return x, choice(rng, experts, top_k), rng.random((1, top_k), np.float32)


def cores_part(layer, fmt, x, ids, w, slots):
    """The cores' experts of a token's first `slots` slots."""
    first = (np.ascontiguousarray(a[:, :slots]) for a in (ids, w))
    return moe_cpu.moe_forward(fmt, GROUP, *layer, x, *first, act_int8=True)


def token_times(layer, fmt, n, experts, top_k, runs, rng) -> dict:
    """Median seconds per token of the cores' part, the GPU's part and both at once; the split's sum against the
    cores' alone over all top_k slots (relative error, the first token)."""
    gpu = graphed(layer, fmt, top_k, n) if n else None
    cores = lambda x, ids, w: cores_part(layer, fmt, x, ids, w, top_k - n)  # noqa: E731

    times = {"cores": [], "gpu": [], "both": []}
    error = None
    for i in range(runs + 1):  # the first compiles or warms: left out
        x, ids, w = token(rng, experts, top_k)
        if gpu:
            gpu.choose(x, ids, w)
        t0 = time.perf_counter()
        if gpu:
            gpu.replay()
        part = cores(x, ids, w)
        torch.cuda.synchronize()
        both = time.perf_counter() - t0
        if error is None and gpu:
            whole = moe_cpu.moe_forward(fmt, GROUP, *layer, x, ids, w, act_int8=True)
            got = part + gpu.out.cpu().numpy()
            error = float(np.linalg.norm(got - whole) / np.linalg.norm(whole))
        ids = choice(rng, experts, top_k)  # alone: fresh experts again
        t0 = time.perf_counter()
        cores(x, ids, w)
        alone = time.perf_counter() - t0
        gpu_alone = 0.0
        if gpu:
            gpu.choose(x, choice(rng, experts, top_k), w)
            t0 = time.perf_counter()
            gpu.replay()
            torch.cuda.synchronize()
            gpu_alone = time.perf_counter() - t0
        if i:
            for key, t in (("cores", alone), ("gpu", gpu_alone), ("both", both)):
                times[key].append(t)
    return {**{k: sorted(v)[len(v) // 2] for k, v in times.items()}, "error": error}


def tile_sweep(layer, fmt, experts, top_k, tiles, runs, rng) -> list[tuple]:
    """The GPU's part of 3 slots at each (rows, warps, span bytes) per program, alone and beside the cores' part of
    the others (the reads' mix decode has): median ms alone, its GB/s, median ms of both at once."""
    rows = []
    shipped = experts_from_host.TILE
    try:
        for tile in tiles:
            experts_from_host.TILE = tile
            gpu = graphed(layer, fmt, top_k, 3)
            seconds = {"alone": [], "both": []}
            for _ in range(runs):
                for mode, times in seconds.items():
                    x, ids, w = token(rng, experts, top_k)
                    gpu.choose(x, ids, w)
                    t0 = time.perf_counter()
                    gpu.replay()
                    if mode == "both":
                        cores_part(layer, fmt, x, ids, w, top_k - 3)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
            alone, both = (sorted(t)[len(t) // 2] * 1e3 for t in seconds.values())
            rows.append((tile, alone, 3 * bench_experts.expert_bytes(layer, 0) / alone / 1e6, both))
    finally:
        experts_from_host.TILE = shipped
    return rows


def tiles(text: str) -> list[tuple[int, int, int]]:
    """ROWSxWARPSxSPAN,...: powers of two, a span of 64 bytes or more."""
    bad = argparse.ArgumentTypeError(f"tiles are ROWSxWARPSxSPAN (powers of two; SPAN bytes, at least 64), "
                                     f"comma-separated (8x4x512,16x8x1024), got {text!r}")
    try:
        out = [tuple(int(v) for v in t.split("x")) for t in text.split(",")]
    except ValueError:
        raise bad from None
    if any(len(t) != 3 or min(t) < 1 or any(v & (v - 1) for v in t) or t[2] < 64 for t in out):
        raise bad
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="glm-5", help="the layer's dims: a shipped preset or a config.json")
    parser.add_argument("--experts", type=int, default=64, help="routed experts held (fresh ones each token)")
    parser.add_argument("--format", default="int4", choices=["int8", "int4"])
    parser.add_argument("--gpu", default="0,1,2,3,4", help="the slots of a token the GPU runs, each count in turn")
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--tiles", type=tiles, default=[],
                        help="ROWSxWARPSxSPAN per program of the GPU's kernel to time (span: a row's bytes at once)")
    args = parser.parse_args(argv)
    try:
        bench_experts.use_preset(args.preset)
    except Glm5Error as e:
        parser.error(str(e))
    top_k = bench_experts.TOP_K
    try:
        counts = [int(n) for n in args.gpu.split(",")]
    except ValueError:
        parser.error(f"--gpu takes counts, comma-separated (0,1,2), got {args.gpu!r}")
    if any(not 0 <= n < top_k for n in counts):
        parser.error(f"--gpu counts must be 0 .. {top_k - 1} (the cores keep one), got {args.gpu}")
    if args.experts < top_k or args.runs < 1:
        parser.error(f"--experts must be at least the {top_k} a token routes to and --runs at least 1, got "
                     f"{args.experts} and {args.runs}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_split.py needs a CUDA GPU (the GPU reads the experts from host memory)")
    layer = bench_experts.random_layer(args.format, args.experts, GROUP)
    if not all(page_locked(a) for a in layer if a.size):
        raise SystemExit("the layer's host memory could not be page-locked for the GPU")
    rng = np.random.default_rng(2)
    read, bus = read_bandwidth_gb_s(), ceilings.pinned_h2d_gb_s()
    token_bytes = top_k * bench_experts.expert_bytes(layer, 0)
    print(f"{args.preset} layer, {args.format}/g{GROUP} + int8 activations, {args.experts} experts held, "
          f"{token_bytes / 1e6:.1f} MB a token; cores' read {read:.1f} GB/s ({numba.get_num_threads()} threads of "
          f"{os.cpu_count()} cores), the GPU's pinned copy {bus:.1f} GB/s; {torch.cuda.get_device_name()}", flush=True)
    print("\n| GPU's slots | cores' part ms | GPU's part ms | both ms | GB/s of the token | x of the cores alone | "
          "of the cores' read | of cores + bus | error vs cores alone |\n| --- | --- | --- | --- | --- | --- | --- | "
          "--- | --- |")
    base = None  # n = 0's time, where asked
    for n in counts:
        t = token_times(layer, args.format, n, args.experts, top_k, args.runs, rng)
        both = t["both"] if n else t["cores"]
        base = both if n == 0 else base
        gb_s = token_bytes / both / 1e9
        ratio = f"{base / both:.2f}x" if base else "-"
        error = "-" if t["error"] is None else f"{t['error']:.1e}"
        print(f"| {n} | {t['cores'] * 1e3:.3f} | {t['gpu'] * 1e3:.3f} | {both * 1e3:.3f} | {gb_s:.1f} | {ratio} | "
              f"{gb_s / read:.0%} | {gb_s / (read + bus):.0%} | {error} |", flush=True)
    if args.tiles:
        print(f"\n| rows x warps x span bytes a program | GPU's part (3 experts) alone ms | GB/s | of the pinned copy | "
              f"beside the cores' {top_k - 3}: both ms |\n| --- | --- | --- | --- | --- |")
        for (r, w, span), ms, gb_s, both in tile_sweep(layer, args.format, args.experts, top_k, args.tiles,
                                                       args.runs, rng):
            print(f"| {r} x {w} x {span} | {ms:.3f} | {gb_s:.1f} | {gb_s / bus:.0%} | {both:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
