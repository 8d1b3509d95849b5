"""DSA kernels on the GPU at GLM-5's dims, each figure beside the ceiling measured in the same run and
beside the plain-torch reference (glm5_offload/model/mla.py).

    PYTHONPATH=.:bench python3 bench/bench_dsa.py [--sweep | --mla-prefill-fp8 | --mla-prefill-sweep |
        --mla-prefill-rows | --indexer-call-1m]

Decode kernels take microseconds, less than Python's launch of them: they are timed eagerly and replayed
from a CUDA graph (the GPU's own time; the engine's decode is to run from graphs). --sweep also times
each kernel over block shapes (the defaults in kernels/dsa_triton.py come from such a sweep).
--mla-prefill-fp8 times only sparse MLA prefill over FP8 rows, converted in the kernel or all first;
--indexer-call-1m only one prefill call of the indexer at 1M keys, its scores beside their top-k (torch.topk, the
radix select, topk_sampled and its parts); --mla-prefill-sweep only sparse MLA prefill's block sweep;
--mla-prefill-rows sparse MLA prefill over latents from L2-resident to 1M rows and three kinds of selections.
"""

import json
import sys

import torch
import triton

from glm5_offload.formats.kv_rows import quantize_keys, quantize_latent
from glm5_offload.kernels import dsa_triton, topk_triton
from glm5_offload.model import indexer_scores, sparse_mla

import ceilings

H_IDX, D_IDX, H, L, R, TOPK = 32, 128, 64, 512, 64, 2048


def indexer_inputs(S, T, fp8=False):
    q = torch.randn(S, H_IDX, D_IDX, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(T, D_IDX, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(S, H_IDX, device="cuda")
    if fp8:
        k8, scales = quantize_keys(keys)
        return q, k8, w, {"key_scales": scales}, T * (D_IDX + 4) + S * T * 4
    return q, keys, w, {}, T * D_IDX * 2 + S * T * 4


def indexer_case(S, T, fp8=False, q_fp8=None):
    """(eager ms, CUDA-graph ms or None, torch ms or None, bytes, flops)."""
    q, keys, w, kw, nbytes = indexer_inputs(S, T, fp8)
    positions = torch.arange(T - S, T, device="cuda")
    run = lambda: dsa_triton.indexer_scores(q, keys, w, positions, q_fp8=q_fp8, **kw)  # noqa: E731
    ms = ceilings.time_ms(run)
    graph = ceilings.graph_ms(run) if S <= 4 else None
    ref_ms = None
    if S * T <= 2**28 and not fp8:
        ref_ms = ceilings.time_ms(lambda: indexer_scores(q, keys, w, positions), warmup=1, iters=3)
    return ms, graph, ref_ms, nbytes, 2 * S * H_IDX * D_IDX * T


def mla_inputs(S, T, fp8=False):
    q_lat = torch.randn(S, H, L, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(S, H, R, device="cuda", dtype=torch.bfloat16)
    latent = torch.randn(T, L + R, device="cuda", dtype=torch.bfloat16)
    if fp8:
        latent = quantize_latent(latent, L)
    indices = torch.stack([torch.randperm(T, device="cuda")[:TOPK] for _ in range(S)])
    return q_lat, q_pe, latent, indices


def mla_case(S, T, fp8=False, convert_fp8=None, reference=True):
    """(eager ms, CUDA-graph ms or None, torch ms or None, flops)."""
    q_lat, q_pe, latent, indices = mla_inputs(S, T, fp8)
    run = lambda: dsa_triton.sparse_mla(q_lat, q_pe, latent, indices, L, 0.06, convert_fp8=convert_fp8)  # noqa: E731
    ms = ceilings.time_ms(run, iters=5 if S > 32 else 20)
    graph = ceilings.graph_ms(run) if S <= 32 else None
    ref_ms = (ceilings.time_ms(lambda: sparse_mla(q_lat, q_pe, latent, indices, L, 0.06), warmup=1, iters=3)
              if reference else None)
    return ms, graph, ref_ms, 2 * S * H * TOPK * (L + R + L)


def mla_prefill_fp8() -> tuple[dict, list]:
    """Sparse MLA prefill over FP8 rows: converted where read (in the kernel) against all rows converted to bf16
    first (sparse_mla's choice for prefill), next to bf16 rows; 2048 queries, 128K and 1M rows."""
    rows, table = {}, []
    for T in (131072, 1048576):
        for name, fp8, convert in (("bf16", False, None), ("fp8_in_kernel", True, False), ("fp8_converted", True, True)):
            ms, _, _, flops = mla_case(2048, T, fp8, convert, reference=False)
            rows[f"sparse_mla_prefill_2048x{T}_{name}"] = {"ms": ms, "tflops": flops / ms / 1e9}
            table.append((f"sparse MLA prefill 2048 queries, {T} rows, {name}", f"{ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOP/s"))
        torch.cuda.empty_cache()
    return rows, table


def decode_sweep() -> dict:
    """Decode kernels replayed from CUDA graphs (GPU time alone) over block shapes: the best of each."""
    out = {}
    for T in (131072, 1048576):
        for fp8 in (False, True):
            q, keys, w, kw, nbytes = indexer_inputs(1, T, fp8)
            timings, last = {}, torch.tensor([T - 1], device="cuda")
            for block_t in (128, 256, 512):
                for warps in (4, 8):
                    timings[f"block_t={block_t},warps={warps}"] = ceilings.graph_ms(
                        lambda: dsa_triton.indexer_scores(q, keys, w, last, block_t=block_t, num_warps=warps, **kw)) * 1e3
            best = min(timings, key=timings.get)
            out[f"indexer_decode_{'fp8' if fp8 else 'bf16'}_{T}"] = {"best": best, "us": timings[best]}
    for S in (1, 32):
        for fp8 in (False, True):
            q_lat, q_pe, latent, indices = mla_inputs(S, 131072, fp8)
            timings = {}
            for block_h in (16, 32, 64):
                for block_k in (32, 64):
                    for warps in (4, 8):
                        try:
                            timings[f"block_h={block_h},block_k={block_k},warps={warps}"] = ceilings.graph_ms(
                                lambda: dsa_triton.sparse_mla(q_lat, q_pe, latent, indices, L, 0.06, block_h=block_h,
                                                              block_k=block_k, num_warps=warps)) * 1e3
                        except triton.runtime.errors.OutOfResources:
                            continue
            best = min(timings, key=timings.get)
            out[f"sparse_mla_decode_{'fp8' if fp8 else 'bf16'}_b{S}"] = {"best": best, "us": timings[best]}
    return out


def prefill_sweep() -> dict:
    """Prefill kernels (eager: milliseconds each) over block shapes and pipeline stages: the best TFLOP/s."""
    out = {}
    S, T = 2048, 16384
    q, keys, w, _, _ = indexer_inputs(S, T)
    positions = torch.arange(T - S, T, device="cuda")
    flops = 2 * S * H_IDX * D_IDX * T
    timings = {}
    for block_s in (4, 8):
        for block_t in (64, 128):
            for key_blocks in (1, 4):
                for warps in (4, 8):
                    ms = ceilings.time_ms(lambda: dsa_triton.indexer_scores(
                        q, keys, w, positions, block_s=block_s, block_t=block_t, key_blocks=key_blocks, num_warps=warps))
                    timings[f"block_s={block_s},block_t={block_t},key_blocks={key_blocks},warps={warps}"] = flops / ms / 1e9
    best = max(timings, key=timings.get)
    out["indexer_prefill"] = {"best": best, "tflops": timings[best]}
    return {**out, **mla_prefill_sweep()}


def mla_prefill_sweep() -> dict:
    """Sparse MLA prefill (2048 queries, 131072 bf16 rows) over block shapes and pipeline stages: the best TFLOP/s."""
    out, S = {}, 2048
    q_lat, q_pe, latent, indices = mla_inputs(S, 131072)
    flops = 2 * S * H * TOPK * (L + R + L)
    timings = {}
    for block_h in (32, 64):
        for block_k in (32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    try:
                        ms = ceilings.time_ms(lambda: dsa_triton.sparse_mla(
                            q_lat, q_pe, latent, indices, L, 0.06, block_h=block_h, block_k=block_k,
                            num_warps=warps, num_stages=stages), iters=5)
                    except triton.runtime.errors.OutOfResources:
                        continue
                    key = f"block_h={block_h},block_k={block_k},warps={warps},stages={stages}"
                    timings[key] = flops / ms / 1e9
                    print(f"{key}: {timings[key]:.0f} TFLOP/s", file=sys.stderr, flush=True)
    best = max(timings, key=timings.get)
    out["sparse_mla_prefill"] = {"best": best, "tflops": timings[best],
                                 "top": sorted(timings.items(), key=lambda kv: -kv[1])[:8]}
    return out


def mla_prefill_rows():
    """Sparse MLA prefill (2048 queries, the shipped tile and 4 warps x 32 heads) over latents of 4096 rows (in L2)
    to 1M, each query's top-2048 random, sorted, or drawn by groups of 64 queries from a shared pool of 8192 rows
    (neighbours selecting alike): how much of the time is the rows' gather."""
    mm = ceilings.bf16_matmul_tflops()
    S = 2048
    flops = 2 * S * H * TOPK * (L + R + L)
    print(f"bf16 matmul {mm:.0f} TFLOP/s\n| rows | indices | 8 warps x 64 heads | 4 warps x 32 heads |\n| --- | --- | --- | --- |")
    q_lat, q_pe, _, _ = mla_inputs(S, TOPK)
    for T in (4096, 16384, 65536, 131072, 1048576):
        latent = torch.randn(T, L + R, device="cuda", dtype=torch.bfloat16)
        indices = torch.stack([torch.randperm(T, device="cuda")[:TOPK] for _ in range(S)])
        cases = {"random": indices, "sorted": indices.sort(1).values}
        if T > 8192:
            pools = torch.stack([torch.randperm(T, device="cuda")[:8192] for _ in range(S // 64)])
            pick = torch.stack([torch.randperm(8192, device="cuda")[:TOPK] for _ in range(S)])
            cases["pooled"] = pools.repeat_interleave(64, 0).gather(1, pick)
        for name, ind in cases.items():
            tflops = [flops / ceilings.time_ms(lambda: dsa_triton.sparse_mla(
                q_lat, q_pe, latent, ind, L, 0.06, block_h=block_h, num_warps=warps), iters=5) / 1e9
                for warps, block_h in ((8, 64), (4, 32))]
            print(f"| {T} | {name} | {tflops[0]:.0f} TFLOP/s | {tflops[1]:.0f} TFLOP/s |", flush=True)


def indexer_prefill_fp8(table: list, mm: float) -> dict:
    """Indexer prefill over FP8 keys: bf16 queries (bf16 dots) against e4m3 queries (FP8 dots), 2048 queries, and
    how many of each row's top-2048 the two agree on."""
    rows = {}
    for T in (16384, 131072):
        for q_fp8 in (False, True):
            ms, _, _, _, flops = indexer_case(2048, T, fp8=True, q_fp8=q_fp8)
            rows[f"indexer_prefill_fp8keys_{'fp8q' if q_fp8 else 'bf16q'}_2048x{T}"] = {"ms": ms,
                                                                                      "tflops": flops / ms / 1e9}
        bf16q, fp8q = (rows[f"indexer_prefill_fp8keys_{n}_2048x{T}"]["tflops"] for n in ("bf16q", "fp8q"))
        table.append((f"indexer prefill 2048 x {T}, FP8 keys", f"bf16 queries {bf16q:.0f} TFLOP/s, FP8 queries "
                      f"{fp8q:.0f} TFLOP/s = {fp8q / bf16q:.2f}x ({fp8q / mm:.0%} of the bf16 matmul)"))
    q, keys, w, kw, _ = indexer_inputs(2048, 131072, fp8=True)
    positions = torch.arange(131072 - 2048, 131072, device="cuda")
    picked = [topk_triton.topk_indices(dsa_triton.indexer_scores(q, keys, w, positions, q_fp8=q_fp8, **kw), TOPK)
              for q_fp8 in (False, True)]
    offsets = torch.arange(2048, device="cuda")[:, None] * 131072  # each row's positions apart from the others'
    overlap = torch.isin(picked[0] + offsets, picked[1] + offsets).float().mean(1)
    rows["indexer_fp8q_topk_overlap"] = {"mean": overlap.mean().item(), "min": overlap.min().item(),
                                         "rows_equal": (overlap == 1).float().mean().item()}
    table.append(("top-2048 of FP8-query scores vs bf16-query scores (2048 rows of 131072)",
                  f"mean overlap {overlap.mean():.4f}, min {overlap.min():.4f}, "
                  f"rows equal {(overlap == 1).float().mean():.1%}"))
    return rows


def indexer_call_1m(table: list) -> dict:
    """One call of a prefill chunk's indexer at 1M keys as the engine makes it (query_chunk: 128 queries, FP8 keys
    and queries; positions spread over the context, so half the keys are causal on average): the scores kernel and
    the top-2048 of its [128, 1M] scores by torch.topk, the radix select and topk_triton.topk_sampled (the
    prefill's select) with its parts, beside a read of the scores (amax: the bandwidth such a pass can reach)."""
    T = 1 << 20
    S = 2 * (1 << 26) // T
    q, keys, w, kw, _ = indexer_inputs(S, T, fp8=True)
    positions = torch.linspace(0, T - 1, S, device="cuda").long()
    scores = dsa_triton.indexer_scores(q, keys, w, positions, **kw)
    rows = {"indexer_call_1m_ms": ceilings.time_ms(lambda: dsa_triton.indexer_scores(q, keys, w, positions, **kw)),
            "indexer_call_1m_torch_topk_ms": ceilings.time_ms(lambda: scores.topk(TOPK)),
            "indexer_call_1m_radix_topk_ms": ceilings.time_ms(lambda: topk_triton.topk_indices(scores, TOPK)),
            "indexer_call_1m_sampled_topk_ms": ceilings.time_ms(lambda: topk_triton.topk_sampled(scores, TOPK)),
            "indexer_call_1m_scores_read_ms": ceilings.time_ms(lambda: scores.amax(1))}
    same = topk_triton.topk_sampled(scores, TOPK).sort(1).values == topk_triton.topk_indices(scores, TOPK).sort(1).values
    rows["indexer_call_1m_sampled_equal_set"] = bool(same.all())
    # topk_sampled's parts: the sample's threshold, the candidates kernel, the candidates' top-k
    thr = topk_triton.sample_threshold(scores[:, :: T // topk_triton.SAMPLE], T, TOPK)
    rows["indexer_call_1m_threshold_ms"] = ceilings.time_ms(
        lambda: topk_triton.sample_threshold(scores[:, :: T // topk_triton.SAMPLE], T, TOPK))
    candidates = lambda: topk_triton.candidates(scores, thr)  # noqa: E731
    rows["indexer_call_1m_candidates_kernel_ms"] = ceilings.time_ms(candidates)
    count, cand = candidates()
    rows["indexer_call_1m_candidates_min_max"] = (count.min().item(), count.max().item())
    rows["indexer_call_1m_candidates_topk_ms"] = ceilings.time_ms(lambda: topk_triton.top_candidates(cand, TOPK))
    table.append((f"indexer prefill call, {S} queries x 1M FP8 keys (causal, spread)",
                  f"scores {rows['indexer_call_1m_ms']:.2f} ms; their top-2048: torch.topk "
                  f"{rows['indexer_call_1m_torch_topk_ms']:.2f} ms, radix select "
                  f"{rows['indexer_call_1m_radix_topk_ms']:.2f} ms, topk_sampled "
                  f"{rows['indexer_call_1m_sampled_topk_ms']:.2f} ms (threshold "
                  f"{rows['indexer_call_1m_threshold_ms']:.2f}, candidates kernel "
                  f"{rows['indexer_call_1m_candidates_kernel_ms']:.2f}, their top-k "
                  f"{rows['indexer_call_1m_candidates_topk_ms']:.2f}; the radix select's set: "
                  f"{rows['indexer_call_1m_sampled_equal_set']}); a read of the scores "
                  f"{rows['indexer_call_1m_scores_read_ms']:.2f} ms"))
    return rows


def topk(table: list, hbm: float) -> dict:
    """Top-2048 of 1M-wide rows (a 2^20 bucket, its last 48,576 positions masked): torch.topk beside the radix
    select (kernels/topk_triton.py), each from a CUDA graph; the radix select also per call in a stream of 8 rows."""
    rows = {}
    scores = torch.randn(16, 1 << 20, device="cuda")
    scores[:, 1_000_000:] = float("-inf")
    one = scores[:1]
    want = set(one.topk(TOPK).indices[0].tolist())
    rows["topk_triton_equal_set"] = set(topk_triton.topk_indices(one, TOPK)[0].tolist()) == want
    rows["topk_torch_1m_us"] = ceilings.graph_ms(lambda: one.topk(TOPK)) * 1e3
    rows["topk_triton_1m_us"] = ceilings.graph_ms(lambda: topk_triton.topk_indices(one, TOPK)) * 1e3
    rows["topk_triton_1m_stream_us"] = ceilings.stream_ms(
        [lambda i=i: topk_triton.topk_indices(scores[i : i + 1], TOPK) for i in range(8)]) * 1e3
    rows["topk_torch_16x1m_us"] = ceilings.graph_ms(lambda: scores.topk(TOPK)) * 1e3
    rows["topk_triton_16x1m_us"] = ceilings.graph_ms(lambda: topk_triton.topk_indices(scores, TOPK)) * 1e3
    read = 6 * 4 * (1 << 20) / hbm / 1e3  # six reads of a row: the four passes, the count, the write
    table.append(("top-k 2048 of one 1M row", f"radix select {rows['topk_triton_1m_us']:.1f} us from a graph, "
                  f"{rows['topk_triton_1m_stream_us']:.1f} us a call in a stream (six reads of the row at the copy "
                  f"bandwidth: {read:.1f} us); torch.topk {rows['topk_torch_1m_us']:.0f} us; same set: "
                  f"{rows['topk_triton_equal_set']}"))
    table.append(("top-k 2048 of 16 1M rows", f"radix select {rows['topk_triton_16x1m_us']:.0f} us, torch.topk "
                  f"{rows['topk_torch_16x1m_us']:.0f} us"))
    return rows


def main(sweep: bool = False):
    hbm, mm = ceilings.hbm_copy_gb_s(), ceilings.bf16_matmul_tflops()
    rows = {"hbm_copy_gb_s": hbm, "bf16_matmul_tflops": mm}
    table = [("HBM copy / bf16 matmul", f"{hbm:.0f} GB/s / {mm:.0f} TFLOP/s")]
    for fp8 in (False, True):
        for T in (131072, 1048576):
            ms, graph, ref, nbytes, _ = indexer_case(1, T, fp8)
            key = f"indexer_decode_{'fp8' if fp8 else 'bf16'}_{T}"
            rows[key] = {"us": ms * 1e3, "graph_us": graph * 1e3, "frac_hbm_graph": nbytes / graph / 1e6 / hbm,
                         "ref_us": ref * 1e3 if ref else None}
            torch_part = f", torch {ref * 1e3:.0f} us" if ref else ""
            table.append((f"indexer decode, {T} {'FP8 (132 B)' if fp8 else 'bf16'} keys",
                          f"{graph * 1e3:.1f} us from a graph = {nbytes / graph / 1e6:.0f} GB/s = "
                          f"{nbytes / graph / 1e6 / hbm:.0%} of HBM copy ({ms * 1e3:.1f} us eager{torch_part})"))
    ms, _, ref, _, flops = indexer_case(2048, 16384)
    rows["indexer_prefill_2048x16384"] = {"ms": ms, "tflops": flops / ms / 1e9, "ref_ms": ref}
    table.append(("indexer prefill 2048 x 16384", f"{ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOP/s = "
                  f"{flops / ms / 1e9 / mm:.0%} of matmul (torch {ref:.1f} ms)"))
    rows.update(indexer_prefill_fp8(table, mm))
    rows.update(topk(table, hbm))
    rows.update(indexer_call_1m(table))
    for fp8 in (False, True):
        for S in (1, 32):
            ms, graph, ref, _ = mla_case(S, 131072, fp8)
            key = f"sparse_mla_decode_{'fp8' if fp8 else 'bf16'}_b{S}"
            rows[key] = {"us": ms * 1e3, "graph_us": graph * 1e3, "ref_us": ref * 1e3}
            table.append((f"sparse MLA decode, batch {S}, {'656 B FP8' if fp8 else 'bf16'} rows",
                          f"{graph * 1e3:.1f} us from a graph ({ms * 1e3:.1f} us eager, torch {ref * 1e3:.0f} us)"))
    ms, _, ref, flops = mla_case(2048, 131072)
    rows["sparse_mla_prefill_2048"] = {"ms": ms, "tflops": flops / ms / 1e9, "ref_ms": ref}
    table.append(("sparse MLA prefill, 2048 queries", f"{ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOP/s = "
                  f"{flops / ms / 1e9 / mm:.0%} of matmul (torch {ref:.0f} ms)"))
    prefill_fp8, prefill_table = mla_prefill_fp8()
    rows.update(prefill_fp8)
    table += prefill_table
    per_full = rows["indexer_decode_fp8_1048576"]["graph_us"] + rows["topk_triton_1m_us"]
    mla = rows["sparse_mla_decode_fp8_b1"]["graph_us"]
    glm5, glm52 = 78 * (per_full + mla), 21 * per_full + 78 * mla
    rows["attention_per_token_1m_us"] = {"glm5_all_full": glm5, "glm52_freq4": glm52, "ratio": glm5 / glm52}
    table.append(("DSA per token at 1M (FP8 keys and rows, graphs): GLM-5 78 full / GLM-5.2 21 full",
                  f"{glm5:.0f} us / {glm52:.0f} us = {glm5 / glm52:.2f}x (claimed FLOP cut 2.9x)"))
    if sweep:
        rows["decode_sweep"], rows["prefill_sweep"] = decode_sweep(), prefill_sweep()
        for name, r in {**rows["decode_sweep"], **rows["prefill_sweep"]}.items():
            figure = f"{r['us']:.1f} us" if "us" in r else f"{r['tflops']:.0f} TFLOP/s"
            table.append((f"sweep: best {name}", f"{figure} ({r['best']})"))
    print(json.dumps(rows, indent=1))
    print("\n| figure | value |\n| --- | --- |")
    for name, value in table:
        print(f"| {name} | {value} |")
    return rows


if __name__ == "__main__":
    if "--indexer-call-1m" in sys.argv:
        table = []
        print(json.dumps(indexer_call_1m(table)))
        for name, value in table:
            print(f"| {name} | {value} |")
        sys.exit(0)
    if "--mla-prefill-sweep" in sys.argv:
        mm = ceilings.bf16_matmul_tflops()
        best = mla_prefill_sweep()["sparse_mla_prefill"]
        print(json.dumps({"bf16_matmul_tflops": mm, **best}))
        print(f"sparse MLA prefill, best: {best['tflops']:.0f} TFLOP/s = {best['tflops'] / mm:.0%} of bf16 matmul "
              f"{mm:.0f} ({best['best']})")
        sys.exit(0)
    if "--mla-prefill-rows" in sys.argv:
        mla_prefill_rows()
        sys.exit(0)
    if "--mla-prefill-fp8" in sys.argv:
        for name, value in mla_prefill_fp8()[1]:
            print(f"| {name} | {value} |")
        sys.exit(0)
    sys.exit(0 if main(sweep="--sweep" in sys.argv) else 1)
