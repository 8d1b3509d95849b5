"""FP8 and int4 GPU linear kernels (kernels/linear_triton.py) on GLM-5's projection shapes, beside torch's bf16
F.linear (the reference operator's path) and the hardware ceilings measured in the same run: decode GEMVs as GB/s of
the weights' bytes and a fraction of the HBM copy bandwidth; prefill GEMMs as TFLOP/s against torch's bf16 matmul.

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


def decode(hbm: float, rows: int) -> list[dict]:
    out = []
    for name, n, k in SHAPES:
        w16, (w8, s8), (w4, s4) = weights(n, k)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        figures = {"shape": name, "rows": rows}
        for fmt, fn, nbytes in [("bf16", lambda: F.linear(x, w16), n * k * 2),
                                ("fp8", lambda: linear_triton.fp8_linear(x, w8, s8), fp8_blocks.nbytes((n, k))),
                                ("int4", lambda: linear_triton.int4_linear(x, w4, s4, 128),
                                 int_groups.nbytes(n * k, "int4", 128))]:
            ms = ceilings.graph_ms(fn)
            figures[fmt] = {"us": ms * 1e3, "gb_s": nbytes / ms / 1e6, "of_hbm": nbytes / ms / 1e6 / hbm}
        out.append(figures)
    return out


def prefill(tokens: int, bf16_ceiling: float) -> list[dict]:
    out = []
    for name, n, k in [("q_b_proj", 16384, 2048), ("o_proj", 6144, 16384), ("shared gate/up", 2048, 6144)]:
        w16, (w8, s8), (w4, s4) = weights(n, k)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        flops = 2 * tokens * n * k
        figures = {"shape": name, "tokens": tokens}
        for fmt, fn in [("bf16", lambda: F.linear(x, w16)),
                        ("fp8", lambda: linear_triton.fp8_linear(x, w8, s8)),
                        ("fp8 widened + torch", lambda: F.linear(x, linear_triton.fp8_dequantize(w8, s8))),
                        ("int4 widened + torch",
                         lambda: F.linear(x, experts_triton.dequantize(w4, s4, "int4", 128))),
                        ("fp8, bf16 dots", lambda: linear_triton.fp8_linear(x, w8, s8, fp8_dot=False)),
                        ("int4", lambda: linear_triton.int4_linear(x, w4, s4, 128))]:
            ms = ceilings.time_ms(fn)
            figures[fmt] = {"ms": ms, "tflops": flops / ms / 1e9, "of_bf16_ceiling": flops / ms / 1e9 / bf16_ceiling}
        out.append(figures)
    return out


def sweep(hbm: float) -> list[dict]:
    """Decode tiles for the fp8 and int4 GEMV at batch 1 on o_proj and q_b_proj."""
    out = []
    shipped = dict(linear_triton.DECODE_TILE)
    made = {name: weights(n, k)[1:] for name, n, k in [("o_proj", 6144, 16384), ("q_b_proj", 16384, 2048)]}
    for block_n in (64, 128):
        for warps in (4, 8):
            for stages in (2, 4):
                for step, vector in ((1, False), (2, False), (4, False), (1, True), (2, True)):
                    linear_triton.DECODE_TILE.update(block_n=block_n, num_warps=warps, num_stages=stages, step=step,
                                                     vector=vector)
                    row = {"block_n": block_n, "num_warps": warps, "num_stages": stages, "step": step, "vector": vector}
                    try:
                        for name, n, k in [("o_proj", 6144, 16384), ("q_b_proj", 16384, 2048)]:
                            (w8, s8), (w4, s4) = made[name]
                            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
                            row[f"{name} fp8"] = fp8_blocks.nbytes((n, k)) / ceilings.graph_ms(
                                lambda: linear_triton.fp8_linear(x, w8, s8)) / 1e6 / hbm
                            if step == 1 and not vector:
                                row[f"{name} int4"] = int_groups.nbytes(n * k, "int4", 128) / ceilings.graph_ms(
                                    lambda: linear_triton.int4_linear(x, w4, s4, 128)) / 1e6 / hbm
                    except triton.runtime.errors.OutOfResources:
                        row["out of shared memory"] = True
                    print("sweep", row, flush=True)
                    out.append(row)
    linear_triton.DECODE_TILE.update(shipped)
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


def run(do_sweep: bool = False) -> dict:
    hbm, bf16 = ceilings.hbm_copy_gb_s(), ceilings.bf16_matmul_tflops()
    result = {"hbm_copy_gb_s": hbm, "bf16_matmul_tflops": bf16}
    if do_sweep:  # the tables below then run with the best decode tile (fp8, o_proj + q_b_proj at batch 1)
        result["sweep"] = sweep(hbm)
        best = max((r for r in result["sweep"] if "o_proj fp8" in r), key=lambda r: r["o_proj fp8"] + r["q_b_proj fp8"])
        linear_triton.DECODE_TILE.update({k: best[k] for k in linear_triton.DECODE_TILE})
        print("decode tile for the tables:", linear_triton.DECODE_TILE, flush=True)
    result["decode_tile"] = dict(linear_triton.DECODE_TILE)
    result["decode"] = decode(hbm, 1) + decode(hbm, 8)
    result["prefill"] = prefill(4096, bf16)
    return result


def table(r: dict) -> str:
    lines = [f"HBM copy {r['hbm_copy_gb_s']:.0f} GB/s, bf16 matmul {r['bf16_matmul_tflops']:.0f} TFLOP/s",
             f"{'decode':<16} {'rows':>4} {'bf16 us':>8} {'fp8 us':>8} {'fp8 GB/s':>9} {'of HBM':>7} {'int4 us':>8} "
             f"{'int4 GB/s':>9} {'of HBM':>7}"]
    for d in r["decode"]:
        lines.append(f"{d['shape']:<16} {d['rows']:>4} {d['bf16']['us']:>8.1f} {d['fp8']['us']:>8.1f} "
                     f"{d['fp8']['gb_s']:>9.0f} {d['fp8']['of_hbm']:>7.1%} {d['int4']['us']:>8.1f} "
                     f"{d['int4']['gb_s']:>9.0f} {d['int4']['of_hbm']:>7.1%}")
    lines.append(f"{'prefill':<16} {'tok':>5} {'bf16 TF':>8} {'fp8dot TF':>10} {'x bf16':>7} {'fp8 bf16dot':>12} "
                 f"{'fp8 widen+mm':>13} {'int4 TF':>8} {'int4 widen+mm':>14}")
    for p in r["prefill"]:
        lines.append(f"{p['shape']:<16} {p['tokens']:>5} {p['bf16']['tflops']:>8.0f} {p['fp8']['tflops']:>10.0f} "
                     f"{p['fp8']['tflops'] / p['bf16']['tflops']:>7.2f} {p['fp8, bf16 dots']['tflops']:>12.0f} "
                     f"{p['fp8 widened + torch']['tflops']:>13.0f} {p['int4']['tflops']:>8.0f} "
                     f"{p['int4 widened + torch']['tflops']:>14.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--sweep", action="store_true", help="first sweep the tiles (printed as they go)")
    args = parser.parse_args()
    result = run(args.sweep)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
