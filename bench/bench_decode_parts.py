"""A decode step's small GPU pieces on GLM-5's shapes, each kernel beside its reference path and the HBM copy
bandwidth measured in the same run: the router (router.triton against Router.forward) and absorbed MLA's two
products with kv_b_proj in FP8 (kernels/mla_absorb.py against the dequantise-and-einsum reference).

Per call in a stream, as bench_linear.py's decode figures: one CUDA graph runs the call on many copies of the weights
so none is in L2 when read again. "of HBM": the weights' bytes read per call over the copy bandwidth.

    PYTHONPATH=.:bench python3 bench/bench_decode_parts.py [--json FILE]
"""

import argparse
import json
from types import SimpleNamespace

import torch

from glm5_offload.formats import fp8_blocks
from glm5_offload.kernels import mla_absorb, router_triton
from glm5_offload.kernels.linear_triton import fp8_dequantize
from glm5_offload.model import Router

import ceilings

HIDDEN, EXPERTS, HEADS, NOPE, V, L = 6144, 256, 64, 192, 256, 512  # GLM-5
COPIES = 64


def routers(rows: int) -> dict:
    config = SimpleNamespace(n_routed_experts=EXPERTS, hidden_size=HIDDEN, num_experts_per_tok=8, n_group=1,
                             topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
    made = []
    for _ in range(COPIES):
        router = Router(config)
        router.weight.data = torch.randn(EXPERTS, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN**-0.5
        router.e_score_correction_bias.data = torch.randn(EXPERTS, device="cuda") * 0.05
        made.append(router)
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    want, got = made[0](x), router_triton.route(x, made[0].weight, made[0].e_score_correction_bias, 8, 1, 1, True, 2.5)
    same = torch.equal(want[0], got[0])
    calls = {"reference": [lambda r=r: r(x) for r in made],
             "triton": [lambda r=r: router_triton.route(x, r.weight, r.e_score_correction_bias, 8, 1, 1, True, 2.5)
                        for r in made]}
    return {"bytes": EXPERTS * HIDDEN * 2, "same_ids": same, **{k: ceilings.stream_ms(v) for k, v in calls.items()}}


def absorbs(rows: int) -> dict:
    made = [fp8_blocks.quantize(torch.randn(HEADS * (NOPE + V), L, device="cuda") * 0.05) for _ in range(COPIES)]
    q = torch.randn(rows, HEADS, NOPE, device="cuda", dtype=torch.bfloat16)
    o = torch.randn(rows, HEADS, L, device="cuda")

    def reference(w8, s8):  # Attention.kv_b_weight, absorb_query and absorb_output: one dequantisation, two einsums
        w = fp8_dequantize(w8, s8).view(HEADS, NOPE + V, L)
        return (torch.einsum("shd,hdl->shl", q.float(), w[:, :NOPE].float()),
                torch.einsum("shl,hvl->shv", o, w[:, NOPE:].float()))

    def kernels(w8, s8):
        return (mla_absorb.absorb_query(q, w8, s8, torch.bfloat16, NOPE + V),
                mla_absorb.absorb_output(o, w8, s8, torch.bfloat16, NOPE, NOPE + V))

    want, got = reference(*made[0]), kernels(*made[0])
    err = max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want))
    calls = {"reference": [lambda m=m: reference(*m) for m in made],
             "triton": [lambda m=m: kernels(*m) for m in made],
             "triton query": [lambda m=m: mla_absorb.absorb_query(q, *m, torch.bfloat16, NOPE + V) for m in made],
             "triton output": [lambda m=m: mla_absorb.absorb_output(o, *m, torch.bfloat16, NOPE, NOPE + V)
                               for m in made]}
    return {"bytes": fp8_blocks.nbytes((HEADS * (NOPE + V), L)), "rel_err": err,
            **{k: ceilings.stream_ms(v) for k, v in calls.items()}}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    hbm = ceilings.hbm_copy_gb_s()
    results = {"hbm_copy_gb_s": hbm, "router": {}, "absorb": {}}
    print(f"HBM copy {hbm:.0f} GB/s")
    for rows in (1, 4):
        for name, figures in (("router", routers(rows)), ("absorb", absorbs(rows))):
            results[name][rows] = figures
            ref = figures["reference"]
            parts = ", ".join(f"{k} {ms * 1e3:.1f} us ({ref / ms:.2f}x ref, {figures['bytes'] / ms / 1e6 / hbm:.0%} "
                              "of HBM)" for k, ms in figures.items() if k not in ("bytes", "same_ids", "rel_err"))
            check = f"same ids {figures['same_ids']}" if "same_ids" in figures else f"rel err {figures['rel_err']:.1e}"
            print(f"{name:<6} rows {rows}: {parts}; {check}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
