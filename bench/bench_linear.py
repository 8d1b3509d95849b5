"""FP8 and int4 GPU linear kernels (kernels/linear_triton.py) on GLM-5's projection shapes, beside torch's bf16
F.linear (the reference operator's path) and the hardware ceilings measured in the same run: decode GEMVs as GB/s of
the weights' bytes and a fraction of the HBM copy bandwidth; prefill GEMMs as TFLOP/s against torch's bf16 matmul.

Decode figures are per call in a stream: one CUDA graph runs the call on enough copies of the weights (>= 1 GiB in
all) that none is in L2 when read again, twice over, as a decode step runs its layers; "alone" is one call replayed
from a graph of its own (the graph's launch included).

    PYTHONPATH=.:bench python3 bench/bench_linear.py [--json FILE] [--sweep]
"""

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from glm5_offload.formats import fp8_blocks, int_groups
from glm5_offload.kernels import experts_triton, linear_triton

import ceilings

# (name, out, in) of GLM-5's GPU projections
SHAPES = [("q_a_proj", 2048, 6144), ("q_b_proj", 16384, 2048), ("kv_a_proj", 576, 6144), ("o_proj", 6144, 16384),
          ("indexer.wq_b", 8192, 2048), ("shared gate/up", 2048, 6144), ("shared down", 6144, 2048),
          ("lm_head", 154880, 6144)]


def weights(n: int, k: int):
    w = torch.randn(n, k, device="cuda") * 0.02
    w8, s8 = fp8_blocks.quantize(w)
    values, s4 = int_groups.quantize(w.cpu(), "int4", 128)
    return w.bfloat16(), (w8, s8), (torch.from_numpy(values).cuda(), torch.from_numpy(s4).cuda())


STREAM_BYTES = 1 << 30


def copies(n: int, k: int) -> list:
    """Distinct weight sets of one shape, >= STREAM_BYTES of int4 weights in all (at most 64)."""
    count = min(64, -(-STREAM_BYTES // int_groups.nbytes(n * k, "int4", 128)))
    return [weights(n, k) for _ in range(count)]


def weight_bytes(fmt: str, n: int, k: int) -> int:
    return {"bf16": n * k * 2, "fp8": fp8_blocks.nbytes((n, k)), "int4": int_groups.nbytes(n * k, "int4", 128)}[fmt]


def decode_calls(fmt: str, x, sets):
    if fmt == "bf16":
        return [lambda w16=w16: F.linear(x, w16) for w16, _, _ in sets]
    if fmt == "fp8":
        return [lambda w8=w8, s8=s8: linear_triton.fp8_linear(x, w8, s8) for _, (w8, s8), _ in sets]
    return [lambda w4=w4, s4=s4: linear_triton.int4_linear(x, w4, s4, 128) for _, _, (w4, s4) in sets]


def decode(hbm: float, rows: int) -> list[dict]:
    out = []
    for name, n, k in SHAPES:
        sets = copies(n, k)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        figures = {"shape": name, "rows": rows, "copies": len(sets)}
        for fmt in ("bf16", "fp8", "int4"):
            nbytes = weight_bytes(fmt, n, k)
            calls = decode_calls(fmt, x, sets)
            ms, alone = ceilings.stream_ms(calls), ceilings.graph_ms(calls[0])
            figures[fmt] = {"us": ms * 1e3, "gb_s": nbytes / ms / 1e6, "of_hbm": nbytes / ms / 1e6 / hbm,
                            "alone_us": alone * 1e3}
        out.append(figures)
        del sets
    return out


def prefill(tokens: int, bf16_ceiling: float, hbm: float) -> list[dict]:
    out = []
    for name, n, k in [("q_b_proj", 16384, 2048), ("o_proj", 6144, 16384), ("shared gate/up", 2048, 6144)]:
        w16, (w8, s8), (w4, s4) = weights(n, k)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        flops = 2 * tokens * n * k
        figures = {"shape": name, "tokens": tokens}
        runs = [("bf16", lambda: F.linear(x, w16)),
                ("fp8", lambda: linear_triton.fp8_linear(x, w8, s8)),
                ("fp8 widened + torch", lambda: F.linear(x, linear_triton.fp8_dequantize(w8, s8))),
                ("int4 widened + torch", lambda: F.linear(x, experts_triton.dequantize(w4, s4, "int4", 128))),
                ("fp8, bf16 dots", lambda: linear_triton.fp8_linear(x, w8, s8, fp8_dot=False)),
                ("int4", lambda: linear_triton.int4_linear(x, w4, s4, 128))]
        if linear_triton.has_blockwise_fp8_mm(x.device):  # F.scaled_mm with block scales (sm90)
            y = linear_triton.fp8_blockwise_linear(x, w8, s8).float()
            want = linear_triton.linear_reference(x, "fp8", w8, s8, fp8_dot=True).cuda()
            figures["cuBLAS blockwise rel err"] = ((y - want).norm() / want.norm()).item()
            x8, xs = linear_triton.quantize_activations(x)
            runs += [("cuBLAS blockwise", lambda: linear_triton._blockwise_mm(x8, xs, w8, s8, torch.bfloat16)),
                     ("cuBLAS blockwise + quantise", lambda: linear_triton.fp8_blockwise_linear(x, w8, s8))]
            ms = ceilings.time_ms(lambda: linear_triton.quantize_activations(x))  # bf16 read, e4m3 + scales written
            moved = x.numel() * 3 + xs.numel() * 4
            figures["quantise"] = {"us": ms * 1e3, "gb_s": moved / ms / 1e6, "of_hbm": moved / ms / 1e6 / hbm}
        for fmt, fn in runs:
            ms = ceilings.time_ms(fn)
            figures[fmt] = {"ms": ms, "tflops": flops / ms / 1e9, "of_bf16_ceiling": flops / ms / 1e9 / bf16_ceiling}
        out.append(figures)
    return out


def sweep(hbm: float, formats=("fp8", "int4"), prefill_tile: bool = True) -> list[dict]:
    """Decode tiles of the fp8 GEMV and of the int4 one-row GEMV at batch 1 on o_proj and q_b_proj (per call in a
    stream; oversplit: programs per SM over programs_wanted's), and the FP8-dot prefill tile."""
    out = []
    shipped = dict(linear_triton.DECODE_TILE), dict(linear_triton.INT4_GEMV_TILE)
    made = {name: (n, k, copies(n, k)) for name, n, k in [("o_proj", 6144, 16384), ("q_b_proj", 16384, 2048)]}
    # loop_stages (fp8): a long loop's loads issued that many iterations ahead by Triton (cp.async; o_proj's loop
    # is long, q_b_proj's is not)
    grids = {"fp8": (linear_triton.DECODE_TILE,
                     [(b, w, s, 1, {"loop_stages": p}) for b in (32, 64, 128) for w in (4, 8) for s in (2, 4, 8)
                      for p in (None, 3, 4)]),
             "int4": (linear_triton.INT4_GEMV_TILE,
                      [(b, w, s, o, {}) for b in (64, 128) for w in (2, 4, 8) for s in (1, 2) for o in (1, 2)])}
    for fmt in formats:
        tile, grid = grids[fmt]
        for block_n, warps, step, oversplit, more in grid:
            tile.update(block_n=block_n, num_warps=warps, num_stages=2, step=step, oversplit=oversplit, **more)
            row = {"format": fmt, "block_n": block_n, "num_warps": warps, "num_stages": 2, "step": step,
                   "oversplit": oversplit, **more}
            for name, (n, k, sets) in made.items():
                x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
                try:
                    ms = ceilings.stream_ms(decode_calls(fmt, x, sets), iters=5)
                    row[name] = weight_bytes(fmt, n, k) / ms / 1e6 / hbm
                except triton.runtime.errors.OutOfResources:
                    row[name] = float("nan")
            print("sweep", row, flush=True)
            out.append(row)
    linear_triton.DECODE_TILE.update(shipped[0])
    linear_triton.INT4_GEMV_TILE.update(shipped[1])
    del made
    if not prefill_tile:
        return out
    shipped = dict(linear_triton.PREFILL_TILE)
    _, (w8, s8), _ = weights(6144, 16384)
    x = torch.randn(4096, 16384, device="cuda", dtype=torch.bfloat16)
    for block_m in (64, 128):
        for warps in (4, 8):
            for stages in (3, 4):
                linear_triton.PREFILL_TILE.update(block_m=block_m, num_warps=warps, num_stages=stages)
                try:
                    ms = ceilings.time_ms(lambda: linear_triton.fp8_linear(x, w8, s8))
                    tflops = 2 * 4096 * 6144 * 16384 / ms / 1e9
                except triton.runtime.errors.OutOfResources:  # too much shared memory for this tile
                    tflops = float("nan")
                out.append({"prefill block_m": block_m, "num_warps": warps, "num_stages": stages,
                            "o_proj fp8-dot TFLOP/s": tflops})
    linear_triton.PREFILL_TILE.update(shipped)
    return out


def best_tiles(rows: list[dict]) -> dict[str, dict]:
    """Per format swept, the decode tile with the best o_proj + q_b_proj figure."""
    best = {}
    for fmt in sorted({r["format"] for r in rows if "format" in r}):
        ok = [r for r in rows if r.get("format") == fmt and r["o_proj"] == r["o_proj"]]
        top = max(ok, key=lambda r: r["o_proj"] + r["q_b_proj"])
        keys = ("block_n", "num_warps", "num_stages", "step", "oversplit", "loop_stages")
        best[fmt] = {k: top[k] for k in keys if k in top}
    return best


def run(do_sweep: bool = False) -> dict:
    hbm, bf16 = ceilings.hbm_copy_gb_s(), ceilings.bf16_matmul_tflops()
    result = {"hbm_copy_gb_s": hbm, "bf16_matmul_tflops": bf16}
    if do_sweep:  # the tables below then run with the best decode tiles (o_proj + q_b_proj at batch 1)
        result["sweep"] = sweep(hbm)
        best = best_tiles(result["sweep"])
        linear_triton.DECODE_TILE.update(best["fp8"])
        linear_triton.INT4_GEMV_TILE.update(best["int4"])
        print("decode tiles for the tables:", linear_triton.DECODE_TILE, linear_triton.INT4_GEMV_TILE, flush=True)
    result["decode_tile"] = dict(linear_triton.DECODE_TILE)
    result["int4_gemv_tile"] = dict(linear_triton.INT4_GEMV_TILE)
    result["decode"] = decode(hbm, 1) + decode(hbm, 8)
    result["prefill"] = prefill(4096, bf16, hbm)
    return result


def table(r: dict) -> str:
    lines = [f"HBM copy {r['hbm_copy_gb_s']:.0f} GB/s, bf16 matmul {r['bf16_matmul_tflops']:.0f} TFLOP/s; per call in "
             "a stream (alone: one call from its own graph)",
             f"{'decode':<16} {'rows':>4} {'bf16 us':>8} {'of HBM':>7} {'fp8 us':>7} {'alone':>6} {'of HBM':>7} "
             f"{'int4 us':>8} {'alone':>6} {'of HBM':>7}"]
    for d in r["decode"]:
        lines.append(f"{d['shape']:<16} {d['rows']:>4} {d['bf16']['us']:>8.1f} {d['bf16']['of_hbm']:>7.1%} "
                     f"{d['fp8']['us']:>7.1f} {d['fp8']['alone_us']:>6.1f} {d['fp8']['of_hbm']:>7.1%} "
                     f"{d['int4']['us']:>8.1f} {d['int4']['alone_us']:>6.1f} {d['int4']['of_hbm']:>7.1%}")
    runs = ["bf16", "fp8", "fp8, bf16 dots", "fp8 widened + torch", "cuBLAS blockwise", "cuBLAS blockwise + quantise",
            "int4", "int4 widened + torch"]
    lines.append("prefill TFLOP/s: " + " | ".join(runs))
    for p in r["prefill"]:
        figures = [f"{p[k]['tflops']:.0f}" if k in p else "-" for k in runs]
        lines.append(f"{p['shape']:<16} {p['tokens']:>5} " + " | ".join(figures)
                     + (f" (cuBLAS rel err {p['cuBLAS blockwise rel err']:.1e}; the quantise kernel alone "
                        f"{p['quantise']['us']:.1f} us, {p['quantise']['gb_s']:.0f} GB/s = "
                        f"{p['quantise']['of_hbm']:.0%} of the HBM copy)" if "cuBLAS blockwise rel err" in p
                        else " (no cuBLAS blockwise FP8 GEMM here)"))
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--sweep", action="store_true", help="first sweep the tiles (printed as they go)")
    parser.add_argument("--sweep-int4", action="store_true", help="sweep the int4 GEMV's tiles only, then stop")
    args = parser.parse_args()
    if args.sweep_int4:
        print("best int4 GEMV tile:", best_tiles(sweep(ceilings.hbm_copy_gb_s(), ("int4",), False))["int4"])
        raise SystemExit(0)
    result = run(args.sweep)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
