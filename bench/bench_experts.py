"""One MoE layer of GLM-5's real dims on the CPU: numba kernels per format against the read bandwidth
measured in the same run and against a torch CPU baseline on the same weights.

    PYTHONPATH=. python3 bench/bench_experts.py [--experts 256] [--threads N] [--formats bf16,int8,int4]

Decode: one token, 8 of the layer's experts (random routing, random weights), weight bytes read per
second = the 8 experts' bytes (values and scales) / time. `+a8` formats quantise the activations to int8
too and take integer dots (their baseline is the same fp32-activation torch code). Prefill: 512 tokens, each with its own 8
experts, in GFLOP/s (2 x 3 x hidden x inter per token and expert). The torch baseline dequantises the
chosen experts with torch ops and multiplies in fp32 (bf16: torch's own bf16 matmul), one expert at a
time, as a plain torch implementation would. Weights are generated in place, never all at once in fp32.
"""

import argparse
import json
import os
import sys
import time

import numba
import numpy as np
import torch

from glm5_offload.formats import int_groups
from glm5_offload.kernels import moe_cpu
from glm5_offload.kernels.host_read import read_bandwidth_gb_s

HIDDEN, INTER, TOP_K = 6144, 2048, 8


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def random_layer(fmt: str, experts: int, group: int, seed: int = 0):
    """Random weights straight in the CPU format (never an fp32 copy of the whole layer)."""
    rng = np.random.default_rng(seed)

    def values(rows, cols):
        if fmt == "bf16":  # bf16 bit patterns of N(0, 1/sqrt(cols)): build per expert through torch
            return np.stack([int_groups.quantize(torch.randn(1, rows, cols) * cols**-0.5, "bf16")[0][0]
                             for _ in range(experts)])
        if fmt == "int8":
            return rng.integers(-127, 128, size=(experts, rows, cols), dtype=np.int8)
        return rng.integers(0, 256, size=(experts, rows, cols // 2), dtype=np.uint8)

    def scales(rows, cols):
        if fmt == "bf16":
            return np.zeros((0,), np.float32)
        return (rng.random((experts, rows, cols // group), np.float32) + 0.5) * (cols**-0.5 / 64)

    return values(2 * INTER, HIDDEN), scales(2 * INTER, HIDDEN), values(HIDDEN, INTER), scales(HIDDEN, INTER)


def expert_bytes(layer, e: int) -> int:
    return sum(a[e].nbytes for a in layer if a.ndim == 3)


def torch_baseline(fmt, group, layer, x, ids, weights):
    """Plain torch on the same weights: per chosen expert, dequantise, then gate/up, SiLU, down."""
    w13, s13, w2, s2 = layer
    out = torch.zeros(x.shape, dtype=torch.float32)
    xt = torch.from_numpy(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            if fmt == "bf16":
                a = torch.from_numpy(w13[e]).view(torch.bfloat16)
                b = torch.from_numpy(w2[e]).view(torch.bfloat16)
                gu = torch.nn.functional.linear(xt[t].bfloat16(), a).float()
                h = torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]
                out[t] += w * torch.nn.functional.linear(h.bfloat16(), b).float()
            else:
                a = int_groups.dequantize(w13[e : e + 1], s13[e : e + 1], fmt, group)[0]
                b = int_groups.dequantize(w2[e : e + 1], s2[e : e + 1], fmt, group)[0]
                gu = a @ xt[t]
                out[t] += w * (b @ (torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]))
    return out.numpy()


def bench_format(fmt, layer, experts, group, threads, read_gb_s, rng, act_int8=False):
    run = lambda x, ids, w: moe_cpu.moe_forward(fmt, group, *layer, x, ids, w, threads=threads,  # noqa: E731
                                                act_int8=act_int8)
    x = rng.standard_normal((1, HIDDEN), np.float32)
    ids = rng.permutation(experts)[:TOP_K][None].astype(np.int64)
    w = rng.random((1, TOP_K), np.float32)
    run(x, ids, w)  # compile / warm
    decode_runs = []
    for i in range(20):  # fresh experts each run, so the weights come from DRAM, not cache
        ids = rng.permutation(experts)[:TOP_K][None].astype(np.int64)
        decode_runs.append((_timed(lambda: run(x, ids, w)), sum(expert_bytes(layer, e) for e in ids[0])))
    decode_s = sorted(t for t, _ in decode_runs)[len(decode_runs) // 2]
    decode_bytes = decode_runs[0][1]
    check = run(x, ids, w)
    torch.set_num_threads(threads)
    base = torch_baseline(fmt, group, layer, x, ids, w)
    rel = float(np.linalg.norm(check - base) / np.linalg.norm(base))
    torch_s = sorted(_timed(lambda: torch_baseline(fmt, group, layer, x, ids, w)) for _ in range(3))[1]

    tokens = 512
    xp = rng.standard_normal((tokens, HIDDEN), np.float32)
    idp = np.stack([rng.permutation(experts)[:TOP_K] for _ in range(tokens)]).astype(np.int64)
    wp = rng.random((tokens, TOP_K), np.float32)
    run(xp[:4], idp[:4], wp[:4])
    prefill_s = min(_timed(lambda: run(xp, idp, wp)) for _ in range(2))
    flops = tokens * TOP_K * 3 * HIDDEN * INTER * 2
    return {
        "format": fmt + ("+a8" if act_int8 else ""), "group": group if fmt != "bf16" else None,
        "decode_ms": decode_s * 1e3, "decode_gb_s": decode_bytes / decode_s / 1e9,
        "decode_frac_of_read_bw": decode_bytes / decode_s / 1e9 / read_gb_s,
        "torch_decode_ms": torch_s * 1e3, "speedup_vs_torch": torch_s / decode_s,
        "prefill_512_gflop_s": flops / prefill_s / 1e9, "agreement_vs_torch_rel_err": rel,
    }


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--formats", default="bf16,int8,int4,int8+a8,int4+a8",
                        help="weight formats; +a8: with int8 activations (integer dots)")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(1)
    read = read_bandwidth_gb_s()
    results = {"cores": os.cpu_count(), "threads": args.threads, "experts": args.experts,
               "read_bw_gb_s": read, "formats": []}
    print(f"STREAM-style read bandwidth: {read:.1f} GB/s ({args.threads} threads)", flush=True)
    layers = {}
    for spec in args.formats.split(","):
        fmt = spec.removesuffix("+a8")
        if fmt not in layers:
            layers[fmt] = random_layer(fmt, args.experts, args.group)
        r = bench_format(fmt, layers[fmt], args.experts, args.group, args.threads, read, rng, spec.endswith("+a8"))
        results["formats"].append(r)
        print(json.dumps(r), flush=True)
    print("\n| format | decode ms | GB/s | of read BW | torch ms | x torch | prefill 512 GFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results["formats"]:
        name = r["format"] + (f"/g{r['group']}" if r["group"] else "")
        print(f"| {name} | {r['decode_ms']:.2f} | {r['decode_gb_s']:.1f} | {r['decode_frac_of_read_bw']:.0%} | "
              f"{r['torch_decode_ms']:.1f} | {r['speedup_vs_torch']:.1f} | {r['prefill_512_gflop_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
