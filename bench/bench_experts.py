"""One MoE layer of a real model's dims (GLM-5's by default) on the CPU: numba kernels per format against the read
bandwidth measured in the same run and against a torch CPU baseline on the same weights.

    PYTHONPATH=. python3 bench/bench_experts.py [--preset glm-5] [--experts 256] [--threads N]
        [--formats bf16,int8,int4] [--prefetch 0,1024,4096] [--sweep ROW_BLOCK=16,32,64] [--tiles 64,512,2048]

--preset takes the layer's dims (hidden, expert intermediate, routed experts, experts per token) from a shipped
preset's config (glm-5: 6144, 2048, 256, 8; glm-5.3-flash: 4096, 2048, 288, 8; deepseek-v3.2: 7168, 2048, 256, 8).

Decode: one token, 8 of the layer's experts (random routing, random weights), weight bytes read per
second = the 8 experts' bytes (values and scales) / time. `+a8` formats quantise the activations to int8
too and take integer dots (their baseline is the same fp32-activation torch code). Prefill: 512 tokens, each with its own 8
experts, in GFLOP/s (2 x 3 x hidden x inter per token and expert). The torch baseline dequantises the
chosen experts with torch ops and multiplies in fp32 (bf16: torch's own bf16 matmul), one expert at a
time, as a plain torch implementation would. Weights are generated in place, never all at once in fp32.

Beside the read bandwidth, one core's compute ceiling: the int4 x int8 row dot over rows that stay in L2 (no DRAM
read), for one token and for four. --prefetch D1,D2,... times int4 + int8-activation decode with moe_cpu's
PREFETCH_AHEAD set to each distance, each in a fresh process with its own numba cache, in alternating rounds;
--sweep NAME=V1,V2,... the same for another of moe_cpu's compiled-in constants: PREFETCH_FAR (the far prefetch's
distance) or ROW_BLOCK (the output rows a thread's work item of the down projection takes, a multiple of 16).
--tiles N1,N2,... times int4 + int8-activation prefill of chunks of N tokens with moe_cpu's tiles (16 rows x up
to 8 tokens a vpdpbusd pass) and without them (row dots), each way in a fresh process.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numba
import numpy as np
from numba import njit
import torch

from glm5_offload.checkpoint import anonymous_memory, huge_pages
from glm5_offload.config import load_config
from glm5_offload.formats import int_groups
from glm5_offload.kernels import moe_cpu
from glm5_offload.kernels.host_read import read_bandwidth_gb_s

HIDDEN, INTER, TOP_K = 6144, 2048, 8  # GLM-5's; use_preset sets another model's


def use_preset(name: str) -> int:
    """Set the layer's dims to a preset's (or a config file's); its routed experts' count."""
    global HIDDEN, INTER, TOP_K
    config = load_config(name)
    HIDDEN, INTER, TOP_K = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    return config.n_routed_experts


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def engine_memory(a: np.ndarray) -> np.ndarray:
    """a copied into memory of the kind the engine reads its experts from (checkpoint.read_into_memory's: a mapping
    of its own, huge pages asked for): a 4 KiB page a TLB entry would slow the read the bench reports."""
    if not a.nbytes:
        return a
    held = np.frombuffer(anonymous_memory(a.nbytes), a.dtype).reshape(a.shape)
    held[...] = a
    return held


def random_layer(fmt: str, experts: int, group: int, seed: int = 0):
    """Random weights straight in the CPU format (never an fp32 copy of the whole layer), held as the engine holds
    its experts (engine_memory)."""
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

    return tuple(engine_memory(a) for a in (values(2 * INTER, HIDDEN), scales(2 * INTER, HIDDEN), values(HIDDEN, INTER),
                                            scales(HIDDEN, INTER)))


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


@njit(nogil=True)
def _row_dots(rows, scales, xq, xs, xsum, reps, four):
    total = np.float32(0.0)
    for _ in range(reps):
        for r in range(rows.shape[0]):
            if four:
                a, b, c, d = moe_cpu._row_dots_u4q((rows[r],), (scales[r],), (xq[0], xq[1], xq[2], xq[3]),
                                                   (xs[0], xs[1], xs[2], xs[3]), (xsum[0], xsum[1], xsum[2], xsum[3]))
                total += a + b + c + d
            else:
                total += moe_cpu._row_dots_u4q((rows[r],), (scales[r],), (xq[0],), (xs[0],), (xsum[0],))[0]
    return total


def row_dot_gb_s(group: int, rng) -> dict:
    """One core, int4 rows x int8 vectors, 32 rows of GLM-5's hidden dim (96 KB: they stay in L2): GB/s of weights
    for one vector and GB/s-equivalent (bytes x vectors) for four. Every array page-aligned, as the engine's experts
    are: with numpy's own alignment one vector's figure moved between processes (28.5-28.9 or 34.4-34.6 GB/s on
    session 60's CPU machine), page-aligned it held at 34.4-35.2 (bench/RESULTS.md)."""
    rows = engine_memory(rng.integers(0, 256, (32, HIDDEN // 2), dtype=np.uint8))
    scales = engine_memory(rng.random((32, HIDDEN // group), np.float32))
    xq, xs = engine_memory(np.empty((4, HIDDEN), np.int8)), engine_memory(np.empty((4, HIDDEN // group), np.float32))
    xsum = engine_memory(np.empty((4, HIDDEN // group), np.int32))
    moe_cpu._quantize_rows(rng.standard_normal((4, HIDDEN), np.float32), group, xq, xs, xsum)
    out = {}
    for four, name in ((False, "one_vector_gb_s"), (True, "four_vectors_gb_s")):
        _row_dots(rows, scales, xq, xs, xsum, 1, four)
        reps = 500
        seconds = _timed(lambda: _row_dots(rows, scales, xq, xs, xsum, reps, four))
        out[name] = rows.nbytes * reps * (4 if four else 1) / seconds / 1e9
    return out


def decode_times(fmt, layer, experts, group, threads, rng, act_int8, runs=60) -> tuple[list[float], int]:
    """Seconds of `runs` one-token decodes, each with fresh experts (so the weights come from DRAM, not cache), and
    the bytes one reads."""
    x = rng.standard_normal((1, HIDDEN), np.float32)
    w = rng.random((1, TOP_K), np.float32)
    run = lambda ids: moe_cpu.moe_forward(fmt, group, *layer, x, ids, w, threads=threads,  # noqa: E731
                                          act_int8=act_int8)
    run(np.arange(TOP_K)[None])  # compile / warm
    times = []
    for _ in range(runs):
        ids = rng.permutation(experts)[:TOP_K][None].astype(np.int64)
        times.append(_timed(lambda: run(ids)))
    return times, sum(expert_bytes(layer, e) for e in range(TOP_K))


def _percentile(values, q):
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


SWEPT = ("PREFETCH_AHEAD", "PREFETCH_FAR", "ROW_BLOCK")  # moe_cpu's constants --sweep may set


def constant_sweep(name, values, experts, group, threads, preset, rounds=2) -> list[dict]:
    """int4 + int8-activation decode with moe_cpu's constant `name` at each value, every one in its own process and
    numba cache (the constant is compiled in), the values taken in turn `rounds` times."""
    code = ("import json, sys; sys.path.insert(0, 'bench'); import numpy as np, bench_experts as b; "
            "from glm5_offload.kernels import moe_cpu; moe_cpu.{name} = {v}; b.use_preset({p!r}); "
            "layer = b.random_layer('int4', {e}, {g}); t, n = b.decode_times('int4', layer, {e}, {g}, {t}, "
            "np.random.default_rng(0), True); print(json.dumps([b._percentile(t, 0.5), n]))")
    results = {v: [] for v in values}
    for _ in range(rounds):
        for v in values:
            with tempfile.TemporaryDirectory() as cache:
                script = code.format(name=name, v=v, e=experts, g=group, t=threads, p=preset)
                proc = subprocess.run([sys.executable, "-c", script],
                                      env={**os.environ, "NUMBA_CACHE_DIR": cache}, capture_output=True, text=True,
                                      check=True)
            seconds, nbytes = json.loads(proc.stdout.strip().splitlines()[-1])
            results[v].append({"decode_ms": seconds * 1e3, "gb_s": nbytes / seconds / 1e9})
            print(f"{name} {v}: {seconds * 1e3:.2f} ms", flush=True)
    return [{"constant": name, "value": v, "runs": r} for v, r in results.items()]


def prefill_seconds(run, experts, tokens, rng) -> float:
    """The faster of two runs of a chunk of `tokens` tokens, each routed to TOP_K random experts, after a warm-up."""
    x = rng.standard_normal((tokens, HIDDEN), np.float32)
    ids = np.stack([rng.permutation(experts)[:TOP_K] for _ in range(tokens)]).astype(np.int64)
    w = rng.random((tokens, TOP_K), np.float32)
    run(x[:4], ids[:4], w[:4])
    return min(_timed(lambda: run(x, ids, w)) for _ in range(2))


def prefill_flops(tokens: int) -> int:
    return tokens * TOP_K * 3 * HIDDEN * INTER * 2


def tile_times(layer, experts, group, threads, chunks) -> list[float]:
    """int4 + int8-activation prefill seconds of each chunk size (for tiles_sweep's processes)."""
    run = lambda x, ids, w: moe_cpu.moe_forward("int4", group, *layer, x, ids, w, threads=threads,  # noqa: E731
                                                act_int8=True)
    rng = np.random.default_rng(2)
    return [prefill_seconds(run, experts, tokens, rng) for tokens in chunks]


def tiles_sweep(chunks, experts, group, threads, preset) -> list[dict]:
    """int4 + int8-activation prefill of each chunk size with tiles and without (moe_cpu.TILES off: row dots), each
    way in its own process and numba cache (the switch is compiled in)."""
    code = ("import json, sys; sys.path.insert(0, 'bench'); import numpy as np, bench_experts as b; "
            "from glm5_offload.kernels import moe_cpu; moe_cpu.TILES = moe_cpu.TILES and {on}; b.use_preset({p!r}); "
            "layer = b.random_layer('int4', {e}, {g}); print(json.dumps([moe_cpu.TILES, "
            "b.tile_times(layer, {e}, {g}, {t}, {chunks})]))")
    rows = []
    for on in (True, False):
        with tempfile.TemporaryDirectory() as cache:
            proc = subprocess.run([sys.executable, "-c", code.format(on=on, e=experts, g=group, t=threads, p=preset,
                                                                     chunks=list(chunks))],
                                  env={**os.environ, "NUMBA_CACHE_DIR": cache}, capture_output=True, text=True,
                                  check=True)
        tiles, seconds = json.loads(proc.stdout.strip().splitlines()[-1])
        for tokens, sec in zip(chunks, seconds):
            rows.append({"tiles": tiles, "tokens": tokens, "ms": sec * 1e3, "gflop_s": prefill_flops(tokens) / sec / 1e9})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_format(fmt, layer, experts, group, threads, read_gb_s, rng, act_int8=False):
    run = lambda x, ids, w: moe_cpu.moe_forward(fmt, group, *layer, x, ids, w, threads=threads,  # noqa: E731
                                                act_int8=act_int8)
    times, decode_bytes = decode_times(fmt, layer, experts, group, threads, rng, act_int8)
    decode_s = _percentile(times, 0.5)
    x = rng.standard_normal((1, HIDDEN), np.float32)
    ids = rng.permutation(experts)[:TOP_K][None].astype(np.int64)
    w = rng.random((1, TOP_K), np.float32)
    check = run(x, ids, w)
    torch.set_num_threads(threads)
    base = torch_baseline(fmt, group, layer, x, ids, w)
    rel = float(np.linalg.norm(check - base) / np.linalg.norm(base))
    torch_s = sorted(_timed(lambda: torch_baseline(fmt, group, layer, x, ids, w)) for _ in range(3))[1]

    prefill_s = prefill_seconds(run, experts, 512, rng)
    return {
        "format": fmt + ("+a8" if act_int8 else ""), "group": group if fmt != "bf16" else None,
        "decode_ms": decode_s * 1e3, "decode_ms_p10": _percentile(times, 0.1) * 1e3,
        "decode_ms_p90": _percentile(times, 0.9) * 1e3, "decode_gb_s": decode_bytes / decode_s / 1e9,
        "decode_frac_of_read_bw": decode_bytes / decode_s / 1e9 / read_gb_s,
        "torch_decode_ms": torch_s * 1e3, "speedup_vs_torch": torch_s / decode_s,
        "prefill_512_gflop_s": prefill_flops(512) / prefill_s / 1e9, "agreement_vs_torch_rel_err": rel,
    }


def _integers(text: str, what: str, example: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {what} separated by commas, e.g. {example}") from None


def distances(text: str) -> list[int]:
    """--prefetch's value: comma-separated byte counts >= 0."""
    values = _integers(text, "byte counts", "0,1024,4096")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: a prefetch distance cannot be negative")
    return values


def chunks(text: str) -> list[int]:
    """--tiles' value: comma-separated token counts > 0."""
    values = _integers(text, "token counts", "64,512,2048")
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: a chunk holds at least one token")
    return values


def sweep(text: str) -> tuple[str, list[int]]:
    """--sweep's value: NAME=V1,V2,... (NAME one of SWEPT; a ROW_BLOCK a positive multiple of the tiles' rows)."""
    name, _, values = text.partition("=")
    if name not in SWEPT:
        raise argparse.ArgumentTypeError(f"{name!r}: one of {', '.join(SWEPT)} (as NAME=V1,V2,...)")
    if name != "ROW_BLOCK":
        return name, distances(values)
    rows = _integers(values, "row counts", "16,32,64")
    if any(v <= 0 or v % moe_cpu.TILE_ROWS for v in rows):
        raise argparse.ArgumentTypeError(f"{text!r}: ROW_BLOCK values must be positive multiples of "
                                         f"{moe_cpu.TILE_ROWS}")
    return name, rows


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="glm-5", help="the layer's dims: a shipped preset or a config.json")
    parser.add_argument("--experts", type=int, help="routed experts in the layer (default: the preset's)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--formats", default="bf16,int8,int4,int8+a8,int4+a8",
                        help="weight formats; +a8: with int8 activations (integer dots)")
    parser.add_argument("--prefetch", type=distances, default=[],
                        help="int4 + int8-activation decode at these prefetch distances (bytes, comma-separated; 0: "
                        "none), each compiled fresh")
    parser.add_argument("--sweep", type=sweep, help="int4 + int8-activation decode with one of moe_cpu's constants "
                        f"({', '.join(SWEPT)}) at each value, NAME=V1,V2,..., each compiled fresh")
    parser.add_argument("--tiles", type=chunks, default=[], help="int4 + int8-activation prefill of chunks of these "
                        "token counts, with tiles and with row dots, each compiled fresh")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    experts = use_preset(args.preset)
    args.experts = args.experts or experts
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(1)
    read = read_bandwidth_gb_s()
    results = {"preset": args.preset, "hidden": HIDDEN, "inter": INTER, "top_k": TOP_K, "cores": os.cpu_count(),
               "threads": args.threads, "experts": args.experts,
               "read_bw_gb_s": read, "formats": []}
    print(f"STREAM-style read bandwidth: {read:.1f} GB/s ({args.threads} threads)", flush=True)
    results["row_dot_one_core"] = row = row_dot_gb_s(args.group, rng)
    print(f"one core's int4 x int8 row dots from L2: {row['one_vector_gb_s']:.1f} GB/s of weights for one token, "
          f"{row['four_vectors_gb_s']:.1f} GB/s-equivalent for four", flush=True)
    sweeps = ([("PREFETCH_AHEAD", args.prefetch)] if args.prefetch else []) + ([args.sweep] if args.sweep else [])
    for name, values in sweeps:
        rows = constant_sweep(name, values, args.experts, args.group, args.threads, args.preset)
        results.setdefault("sweeps", []).extend(rows)
        print(f"\n| {name} | decode ms, each round | GB/s | of read BW |\n| --- | --- | --- | --- |")
        for p in rows:
            gb_s = sorted(r["gb_s"] for r in p["runs"])
            times = ", ".join(f"{r['decode_ms']:.2f}" for r in p["runs"])
            print(f"| {p['value']} | {times} | {gb_s[0]:.1f}-{gb_s[-1]:.1f} | {gb_s[-1] / read:.0%} |")
    if args.tiles:
        results["tiles"] = tiles_sweep(args.tiles, args.experts, args.group, args.threads, args.preset)
        print("\n| chunk tokens | tiles ms (GFLOP/s) | row dots ms (GFLOP/s) | tiles / row dots |\n| --- | --- | --- | --- |")
        by = {(r["tiles"], r["tokens"]): r for r in results["tiles"]}
        for n in args.tiles:
            on, off = by.get((True, n)), by[(False, n)]
            if on is None:
                print(f"| {n} | - (no VNNI here) | {off['ms']:.1f} ({off['gflop_s']:.0f}) | - |")
                continue
            print(f"| {n} | {on['ms']:.1f} ({on['gflop_s']:.0f}) | {off['ms']:.1f} ({off['gflop_s']:.0f}) | "
                  f"{off['ms'] / on['ms']:.2f}x |")
    layers = {}
    for spec in args.formats.split(","):
        fmt = spec.removesuffix("+a8")
        if fmt not in layers:
            layers[fmt] = random_layer(fmt, args.experts, args.group)
            pages = huge_pages(list(layers[fmt]))
            if pages:
                print(f"{fmt} layer: {pages[1] / pages[0]:.0%} of its {pages[0] / 2**30:.2f} GiB in huge pages",
                      flush=True)
        r = bench_format(fmt, layers[fmt], args.experts, args.group, args.threads, read, rng, spec.endswith("+a8"))
        results["formats"].append(r)
        print(json.dumps(r), flush=True)
    print("\n| format | decode ms (p10-p90) | GB/s | of read BW | torch ms | x torch | prefill 512 GFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results["formats"]:
        name = r["format"] + (f"/g{r['group']}" if r["group"] else "")
        print(f"| {name} | {r['decode_ms']:.2f} ({r['decode_ms_p10']:.2f}-{r['decode_ms_p90']:.2f}) | {r['decode_gb_s']:.1f} | {r['decode_frac_of_read_bw']:.0%} | "
              f"{r['torch_decode_ms']:.1f} | {r['speedup_vs_torch']:.1f} | {r['prefill_512_gflop_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
