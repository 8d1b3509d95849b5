"""A decode step's small GPU pieces on GLM-5's shapes, each kernel beside its reference path and the HBM copy
bandwidth measured in the same run: the router (router.triton against Router.forward), absorbed MLA's two
products with kv_b_proj in FP8 (kernels/mla_absorb.py against the dequantise-and-einsum reference), the indexer's
top-2048 of one row (topk_triton's one-program select and its passes over many programs, against torch.topk), and
the tiered latent cache's write and fetch (kernels/hot_rows.py against TieredLatent's torch path).

Per call in a stream, as bench_linear.py's decode figures: one CUDA graph runs the call on many copies of the weights
so none is in L2 when read again. "of HBM": the weights' bytes read per call over the copy bandwidth.

    PYTHONPATH=.:bench python3 bench/bench_decode_parts.py [--json FILE] [--sweep]

--sweep: instead, absorbed MLA's two kernels for one query row over their block shapes and warps, each beside the
defaults and checked against the reference.
"""

import argparse
import json
from types import SimpleNamespace

import torch

from glm5_offload.formats import fp8_blocks
from glm5_offload.kernels import mla_absorb, router_triton, topk_triton
from glm5_offload.kernels.linear_triton import fp8_dequantize
from glm5_offload.model import Router, topk_indices
from glm5_offload.runtime import tiered_kv

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


def absorb_sweep(hbm: float):
    """absorb_query over (block_c, block_d, num_warps), absorb_output over (block_v, block_l, num_warps), one query
    row: us per call, % of HBM (the product's share of kv_b_proj's bytes), rel err against the reference."""
    made = [fp8_blocks.quantize(torch.randn(HEADS * (NOPE + V), L, device="cuda") * 0.05) for _ in range(COPIES)]
    q = torch.randn(1, HEADS, NOPE, device="cuda", dtype=torch.bfloat16)
    o = torch.randn(1, HEADS, L, device="cuda")
    w = fp8_dequantize(*made[0]).view(HEADS, NOPE + V, L).float()
    want = {"query": torch.einsum("shd,hdl->shl", q.float(), w[:, :NOPE]),
            "output": torch.einsum("shl,hvl->shv", o, w[:, NOPE:])}
    share = {"query": NOPE / (NOPE + V), "output": V / (NOPE + V)}
    shapes = {"query": [{}] + [dict(block_c=c, block_d=d, num_warps=nw) for c in (32, 64, 128) for d in (16, 32, 64)
                               for nw in (2, 4, 8)],
              "output": [{}] + [dict(block_v=v, block_l=bl, num_warps=nw) for v in (8, 16, 32, 64)
                                for bl in (32, 64, 128) for nw in (2, 4, 8)]}
    def call(kind, m, kw):
        if kind == "query":
            return mla_absorb.absorb_query(q, *m, torch.bfloat16, NOPE + V, **kw)
        return mla_absorb.absorb_output(o, *m, torch.bfloat16, NOPE, NOPE + V, **kw)
    for kind, variants in shapes.items():
        rows = []
        for kw in variants:
            try:
                err = ((call(kind, made[0], kw) - want[kind]).norm() / want[kind].norm()).item()
                ms = ceilings.stream_ms([lambda m=m: call(kind, m, kw) for m in made])
            except Exception as e:  # a shape past the registers or shared memory: named, the sweep goes on
                print(f"{kind} {kw}: {type(e).__name__}", flush=True)
                continue
            rows.append((ms, kw, err))
        for ms, kw, err in sorted(rows, key=lambda r: r[0]):
            gb = fp8_blocks.nbytes((HEADS * (NOPE + V), L)) * share[kind] / ms / 1e6
            print(f"absorb_{kind} {kw or 'defaults'}: {ms * 1e3:.1f} us, {gb / hbm:.0%} of HBM, rel err {err:.1e}",
                  flush=True)


TOPK, ROW_BYTES, HOT_BYTES, WINDOW = 2048, 656, 8 << 20, 512  # GLM-5 under rules/glm5.yaml
TIERED_STEPS = 8192  # positions tiered_step's two paths advance through (stream_ms runs its 64 calls 32 times a path)


def topk_row(T: int) -> dict:
    """The indexer's top-2048 of one row of T scores (64 rows, one a call)."""
    rows = [torch.randn(1, T, device="cuda") for _ in range(COPIES)]
    same = torch.equal(topk_triton.topk_indices(rows[0], TOPK).sort().values, topk_indices(rows[0], TOPK).sort().values)
    kernel = [lambda r=r: topk_triton.topk_indices(r, TOPK) for r in rows]

    def with_width(width: int) -> float:  # (the calls are captured into the graph while the width is set)
        shipped, topk_triton.ROW_PROGRAM_WIDTH = topk_triton.ROW_PROGRAM_WIDTH, width
        try:
            return ceilings.stream_ms(kernel)
        finally:
            topk_triton.ROW_PROGRAM_WIDTH = shipped

    return {"same": same, "reference": ceilings.stream_ms([lambda r=r: topk_indices(r, TOPK) for r in rows]),
            "one program": with_width(T), "passes": with_width(0)}


def tiered_step(context: int) -> dict:
    """One layer's tiered cache (FP8 rows, 8 MiB hot, window 512) in decode from `context` tokens on: a step writes
    its row, fetches 2048 selections at distances back from its position (random, one set of distances per copy)
    and moves to the next position (the two small kernels that compute the selections and the next position are
    timed with it). At 4K nothing misses (each step's write moves the row about to leave the window into a never-used
    LRU slot; before, that row missed, ~1 a step) and the LRU part never fills; from 16K it is full and every miss
    evicts; at 1M nearly every selection misses and its row crosses PCIe."""
    g = torch.Generator().manual_seed(context)
    tier = tiered_kv.TieredLatent(context + TIERED_STEPS, ROW_BYTES, torch.uint8, torch.device("cuda"),
                                  HOT_BYTES // ROW_BYTES, WINDOW)
    tier.host[:context] = torch.randint(0, 256, (context, ROW_BYTES), dtype=torch.uint8, generator=g)
    tier.reset(context)
    position, row = torch.tensor([context], device="cuda"), torch.randint(0, 256, (1, ROW_BYTES), device="cuda",
                                                                         dtype=torch.uint8)
    distances = [torch.randperm(context - 1, generator=g)[:TOPK].add(1)[None].cuda() for _ in range(COPIES)]

    def step(distance):
        tier.write(position, row)
        tier.fetch(position - distance, position)
        position.add_(1)

    result, shipped = {}, tiered_kv.one_token_kernels
    try:
        for name, kernels in (("reference", False), ("kernels", True)):
            tiered_kv.one_token_kernels = lambda device, use=kernels: use
            hits, misses = int(tier.hits), int(tier.misses)
            result[name] = ceilings.stream_ms([lambda d=d: step(d) for d in distances])
    finally:
        tiered_kv.one_token_kernels = shipped
    assert int(position) <= context + TIERED_STEPS, "the steps ran past the cache"
    result["misses_per_step"] = (int(tier.misses) - misses) / (int(tier.hits) - hits + int(tier.misses) - misses) * TOPK
    return result


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--sweep", action="store_true", help="absorbed MLA's kernels over their block shapes")
    args = parser.parse_args(argv)
    hbm = ceilings.hbm_copy_gb_s()
    if args.sweep:
        print(f"HBM copy {hbm:.0f} GB/s")
        return absorb_sweep(hbm)
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
    results["topk_row"], results["tiered_step"] = {}, {}
    for T in (4096, 16384, 32768, 65536, 131072):
        f = results["topk_row"][T] = topk_row(T)
        print(f"top-{TOPK} of a row of {T}: torch.topk {f['reference'] * 1e3:.1f} us, passes {f['passes'] * 1e3:.1f} "
              f"us, one program {f['one program'] * 1e3:.1f} us ({f['reference'] / f['one program']:.2f}x torch); "
              f"same set {f['same']}", flush=True)
    for context in (4096, 16384, 1 << 20):
        f = results["tiered_step"][context] = tiered_step(context)
        print(f"tiered cache at {context} tokens, a decode step's write and fetch: torch {f['reference'] * 1e3:.1f} "
              f"us, kernels {f['kernels'] * 1e3:.1f} us ({f['reference'] / f['kernels']:.2f}x); "
              f"{f['misses_per_step']:.0f} misses a step", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
