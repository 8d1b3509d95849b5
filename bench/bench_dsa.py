"""DSA kernels on the GPU at GLM-5's dims, each figure beside the ceiling measured in the same run and
beside the plain-torch reference (glm5_offload/model.py).

    PYTHONPATH=.:bench python3 bench/bench_dsa.py
"""

import json
import sys

import torch

import ceilings
from glm5_offload.kernels import dsa_triton, topk_triton
from glm5_offload.model import indexer_scores, sparse_mla

H_IDX, D_IDX, H, L, R, TOPK = 32, 128, 64, 512, 64, 2048


def indexer_case(S, T):
    q = torch.randn(S, H_IDX, D_IDX, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(T, D_IDX, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(S, H_IDX, device="cuda")
    ms = ceilings.time_ms(lambda: dsa_triton.indexer_scores(q, keys, w, T - S))
    ref_ms = ceilings.time_ms(lambda: indexer_scores(q, keys, w, T - S), warmup=1, iters=3) if S * T <= 2**28 else None
    return ms, ref_ms, T * D_IDX * 2 + S * T * 4, 2 * S * H_IDX * D_IDX * T


def mla_case(S, T):
    q_lat = torch.randn(S, H, L, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(S, H, R, device="cuda", dtype=torch.bfloat16)
    latent = torch.randn(T, L + R, device="cuda", dtype=torch.bfloat16)
    indices = torch.stack([torch.randperm(T, device="cuda")[:TOPK] for _ in range(S)])
    ms = ceilings.time_ms(lambda: dsa_triton.sparse_mla(q_lat, q_pe, latent, indices, L, 0.06))
    ref_ms = ceilings.time_ms(lambda: sparse_mla(q_lat, q_pe, latent, indices, L, 0.06), warmup=1, iters=3)
    return ms, ref_ms, S * TOPK * (L + R) * 2, 2 * S * H * TOPK * (L + R + L)


def decode_sweep(T: int = 131072) -> dict:
    """Decode kernels replayed from CUDA graphs (GPU time alone), over block shapes: the best of each."""
    out = {}
    q = torch.randn(1, H_IDX, D_IDX, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1, H_IDX, device="cuda")
    for T_idx in (131072, 1048576):
        keys = torch.randn(T_idx, D_IDX, device="cuda", dtype=torch.bfloat16)
        k8, scales = dsa_triton.quantize_keys_reference(keys)
        for name, kw, nbytes in (("bf16", {}, T_idx * D_IDX * 2), ("fp8", {"key_scales": scales}, T_idx * (D_IDX + 4))):
            k = keys if name == "bf16" else k8
            timings = {}
            for block_t in (128, 256, 512):
                for warps in (4, 8):
                    ms = ceilings.graph_ms(lambda: dsa_triton.indexer_scores(q, k, w, T_idx - 1, block_t=block_t,
                                                                             num_warps=warps, **kw))
                    timings[f"block_t={block_t},warps={warps}"] = ms * 1e3
            best = min(timings, key=timings.get)
            out[f"indexer_decode_{name}_{T_idx}"] = {"best": best, "us": timings[best],
                                                     "gb_s": (nbytes + T_idx * 4) / timings[best] / 1e3}
    row = torch.randn(1048576, device="cuda")
    out["topk_torch_1m_graph_us"] = ceilings.graph_ms(lambda: row.topk(TOPK)) * 1e3
    for S in (1, 32):
        q_lat = torch.randn(S, H, L, device="cuda", dtype=torch.bfloat16)
        q_pe = torch.randn(S, H, R, device="cuda", dtype=torch.bfloat16)
        latent = torch.randn(T, L + R, device="cuda", dtype=torch.bfloat16)
        from glm5_offload.kv_cache import quantize_latent

        packed = quantize_latent(latent, L)
        indices = torch.stack([torch.randperm(T, device="cuda")[:TOPK] for _ in range(S)])
        for form, lat in (("bf16", latent), ("fp8", packed)):
            timings = {}
            for block_h in (16, 32, 64):
                for block_k in (32, 64):
                    for warps in (4, 8):
                        try:
                            ms = ceilings.graph_ms(lambda: dsa_triton.sparse_mla(
                                q_lat, q_pe, lat, indices, L, 0.06, block_h=block_h, block_k=block_k, num_warps=warps))
                        except Exception as e:  # a shape that does not compile (out of shared memory)
                            print(f"sparse_mla block_h={block_h} block_k={block_k} warps={warps}: {type(e).__name__}")
                            continue
                        timings[f"block_h={block_h},block_k={block_k},warps={warps}"] = ms * 1e3
            best = min(timings, key=timings.get)
            out[f"sparse_mla_decode_{form}_b{S}"] = {"best": best, "us": timings[best],
                                                     "all": dict(sorted(timings.items(), key=lambda kv: kv[1])[:4])}
    return out


def prefill_sweep() -> dict:
    """Prefill kernels (eager: milliseconds each) over block shapes and pipeline stages: TFLOP/s of each."""
    out = {}
    S, T = 2048, 16384
    q = torch.randn(S, H_IDX, D_IDX, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(T, D_IDX, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(S, H_IDX, device="cuda")
    flops = 2 * S * H_IDX * D_IDX * T
    timings = {}
    for block_s in (4, 8):
        for block_t in (64, 128):
            for key_blocks in (1, 4):
                for warps in (4, 8):
                    name = f"block_s={block_s},block_t={block_t},key_blocks={key_blocks},warps={warps}"
                    try:
                        ms = ceilings.time_ms(lambda: dsa_triton.indexer_scores(
                            q, keys, w, T - S, block_s=block_s, block_t=block_t, key_blocks=key_blocks, num_warps=warps))
                    except Exception as e:
                        print(f"indexer {name}: {type(e).__name__}")
                        continue
                    timings[name] = flops / ms / 1e9
    best = max(timings, key=timings.get)
    out["indexer_prefill_tflops"] = {"best": best, "tflops": timings[best],
                                     "top": dict(sorted(timings.items(), key=lambda kv: -kv[1])[:4])}
    T = 131072
    q_lat = torch.randn(S, H, L, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(S, H, R, device="cuda", dtype=torch.bfloat16)
    latent = torch.randn(T, L + R, device="cuda", dtype=torch.bfloat16)
    indices = torch.stack([torch.randperm(T, device="cuda")[:TOPK] for _ in range(S)])
    flops = 2 * S * H * TOPK * (L + R + L)
    timings = {}
    for block_h in (32, 64):
        for block_k in (32, 64):
            for warps in (4, 8):
                for stages in (1, 2):
                    name = f"block_h={block_h},block_k={block_k},warps={warps},stages={stages}"
                    try:
                        ms = ceilings.time_ms(lambda: dsa_triton.sparse_mla(
                            q_lat, q_pe, latent, indices, L, 0.06, block_h=block_h, block_k=block_k,
                            num_warps=warps, num_stages=stages), iters=5)
                    except Exception as e:
                        print(f"sparse_mla {name}: {type(e).__name__}")
                        continue
                    timings[name] = flops / ms / 1e9
    best = max(timings, key=timings.get)
    out["sparse_mla_prefill_tflops"] = {"best": best, "tflops": timings[best],
                                        "top": dict(sorted(timings.items(), key=lambda kv: -kv[1])[:4])}
    return out


def main():
    hbm, mm = ceilings.hbm_copy_gb_s(), ceilings.bf16_matmul_tflops()
    rows = {"hbm_copy_gb_s": hbm, "bf16_matmul_tflops": mm}
    for T in (131072, 1048576):
        ms, ref, nbytes, _ = indexer_case(1, T)
        rows[f"indexer_decode_{T}"] = {"us": ms * 1e3, "gb_s": nbytes / ms / 1e6, "frac_hbm": nbytes / ms / 1e6 / hbm,
                                       "ref_us": ref * 1e3 if ref else None}
    ms, ref, _, flops = indexer_case(2048, 16384)
    rows["indexer_prefill_2048x16384"] = {"ms": ms, "tflops": flops / ms / 1e9, "frac_matmul": flops / ms / 1e9 / mm,
                                          "ref_ms": ref}
    row = torch.randn(1048576, device="cuda")
    rows["topk_torch_1m_us"] = ceilings.time_ms(lambda: row.topk(TOPK)) * 1e3
    rows["topk_triton_1m_us"] = ceilings.time_ms(lambda: topk_triton.topk_indices(row[None], TOPK)) * 1e3
    for S in (1, 32):
        ms, ref, nbytes, flops = mla_case(S, 131072)
        rows[f"sparse_mla_decode_b{S}"] = {"us": ms * 1e3, "ref_us": ref * 1e3, "gb_s": nbytes / ms / 1e6}
    ms, ref, _, flops = mla_case(2048, 131072)
    rows["sparse_mla_prefill_2048"] = {"ms": ms, "tflops": flops / ms / 1e9, "frac_matmul": flops / ms / 1e9 / mm,
                                       "ref_ms": ref}
    per_full = rows["indexer_decode_1048576"]["us"] + rows["topk_torch_1m_us"]
    mla = rows["sparse_mla_decode_b1"]["us"]
    glm5, glm52 = 78 * (per_full + mla), 21 * per_full + 78 * mla
    rows["attention_per_token_1m_us"] = {"glm5_all_full": glm5, "glm52_freq4": glm52, "ratio": glm5 / glm52}
    rows["graphs"] = decode_sweep()
    rows["prefill_sweep"] = prefill_sweep()
    print(json.dumps(rows, indent=1))
    for name, r in rows["prefill_sweep"].items():
        print(f"  {name}: best {r['tflops']:.0f} TFLOP/s ({r['best']})")
    print("\nfrom CUDA graphs (GPU time without Python launch cost), best block shape of a sweep:")
    for name, r in rows["graphs"].items():
        print(f"  {name}: {r if isinstance(r, float) else r['us']:.1f} us" +
              ("" if isinstance(r, float) else f" ({r['best']}" + (f", {r['gb_s']:.0f} GB/s = {r['gb_s'] / hbm:.0%} of HBM copy)" if "gb_s" in r else ")")))
    print("\n| figure | value |\n| --- | --- |")
    print(f"| HBM copy / bf16 matmul | {hbm:.0f} GB/s / {mm:.0f} TFLOP/s |")
    for T in (131072, 1048576):
        r = rows[f"indexer_decode_{T}"]
        ref = f"{r['ref_us']:.0f} us" if r["ref_us"] else "-"
        print(f"| indexer decode, {T} keys | {r['us']:.1f} us, {r['gb_s']:.0f} GB/s = {r['frac_hbm']:.0%} of HBM copy (torch {ref}) |")
    r = rows["indexer_prefill_2048x16384"]
    print(f"| indexer prefill 2048 x 16384 | {r['ms']:.2f} ms, {r['tflops']:.0f} TFLOP/s = {r['frac_matmul']:.0%} of matmul (torch {r['ref_ms']:.1f} ms) |")
    print(f"| top-k 2048 of 1M: Triton radix select / torch.topk | {rows['topk_triton_1m_us']:.0f} us / "
          f"{rows['topk_torch_1m_us']:.0f} us |")
    for S in (1, 32):
        r = rows[f"sparse_mla_decode_b{S}"]
        print(f"| sparse MLA decode, batch {S}, 64 heads, top-2048 | {r['us']:.1f} us (torch {r['ref_us']:.0f} us) |")
    r = rows["sparse_mla_prefill_2048"]
    print(f"| sparse MLA prefill 2048 queries | {r['ms']:.2f} ms, {r['tflops']:.0f} TFLOP/s = {r['frac_matmul']:.0%} of matmul (torch {r['ref_ms']:.0f} ms) |")
    r = rows["attention_per_token_1m_us"]
    print(f"| attention per token at 1M: GLM-5 (78 full) / GLM-5.2 (21 full) | {r['glm5_all_full']:.0f} us / {r['glm52_freq4']:.0f} us = {r['ratio']:.2f}x (claimed FLOP cut 2.9x) |")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
