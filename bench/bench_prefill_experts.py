"""Where a prefill chunk's routed experts should run: one MoE layer of a real model's dims (--preset; GLM-5's by
default: 256 experts of 2048, 8 per token; random weights) for chunks of growing size, on the CPU cores (numba)
and streamed to the GPU (each active expert's packed weights, dequantised there, bf16 matmuls). The layer is
written to a safetensors file under --folder and read back as the engine reads its expert cache (into memory of its
own; --mapped: memory-mapped, as `in_memory: false`); the GPU path is timed both ways an expert reaches the GPU:
one DMA from the page-locked memory (`pin_experts: true`, the default) and staged through pinned buffers by a host
thread (false), and split (below `split_tokens`, default 1024; here at every size: the lightest experts on the CPU
cores at the same time, in the share their speeds, measured on the chunk's first run, balance). Each mode's figure
is its second run of the chunk. The chunk size where the GPU path wins is the `gpu_tokens` kwarg of experts.numba to
set; it is measured here, not guessed. Against the pinned copy bandwidth measured in the same run.

With --sequence, the next layer's prefetch instead: `--layers` MoE layers in turn on one long chunk, each after
a stand-in for its attention (bf16 matmuls queued on the GPU for --attention-ms), with and without the
prefetch and for each ring depth of --rings. A layer's exposed expert time is its time less the stand-in's;
against the H2D ceiling (the layer's bytes at the pinned copy speed) and the layer alone (no stand-in).

    PYTHONPATH=.:bench python3 bench/bench_prefill_experts.py [--preset glm-5] [--format int4]
        [--chunks 64,256,1024,4096] [--folder /tmp]
    PYTHONPATH=.:bench python3 bench/bench_prefill_experts.py --sequence [--tokens 65536] [--rings 8,256]
        [--attention-ms 0,100,300]
    PYTHONPATH=.:bench python3 bench/bench_prefill_experts.py --stager [--calls 200]

With --stager, attention's time while a layer streams (stager()): the host's share the stream takes.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import bench_experts
import numpy as np
import torch
from safetensors.numpy import save_file
from torch.profiler import ProfilerActivity, profile

from glm5_offload.checkpoint import memory_map, read_into_memory
from glm5_offload.formats.kv_rows import quantize_keys
from glm5_offload.kernels import dsa_triton
from glm5_offload.ops.expert_ring import ExpertRing
from glm5_offload.ops.experts_numba import NumbaExperts, chain_layers, split_speeds

import ceilings

HIDDEN, INTER, EXPERTS, TOP_K = 6144, 2048, 256, 8  # GLM-5's; --preset sets another model's (main)


def stored_layer(args) -> dict[str, np.ndarray]:
    """A random layer in the CPU format, written to a safetensors file and read back as experts_numba's store is."""
    v13, s13, v2, s2 = bench_experts.random_layer(args.format, EXPERTS, args.group)
    path = os.path.join(args.folder, f"bench-prefill-experts-{Path(args.preset).name}-{args.format}-g{args.group}"
                                     ".safetensors")
    save_file({"w13": v13, "s13": s13, "w2": v2, "s2": s2}, path)
    del v13, s13, v2, s2
    return (memory_map if args.mapped else read_into_memory)(Path(path))


def main(argv=None):
    global HIDDEN, INTER, EXPERTS, TOP_K
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="glm-5", help="the layer's dims: a shipped preset or a config.json")
    parser.add_argument("--format", default="int4", choices=["bf16", "int8", "int4"])
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--activations", default="int8", choices=["fp32", "int8"], help="the CPU kernels' inputs")
    parser.add_argument("--chunks", default="64,256,1024,4096")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--profile", action="store_true",
                        help="also profile the GPU path on the last chunk (torch.profiler: host and GPU time per op)")
    parser.add_argument("--sequence", action="store_true", help="measure the next layer's prefetch (see above)")
    parser.add_argument("--stager", action="store_true", help="attention's time beside the stream (see stager())")
    parser.add_argument("--calls", type=int, default=200, help="with --stager: the indexer stand-in's calls")
    parser.add_argument("--trace", help="with --sequence --profile: the profiled sequence's Chrome trace, written here")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--rings", default="8,256")
    parser.add_argument("--attention-ms", default="0,100,300")
    parser.add_argument("--split-runs", type=int, default=1,
                        help="time the split this many times (its median reported) and print each run's halves")
    parser.add_argument("--folder", default="/tmp", help="where the layer's file is written (and left)")
    parser.add_argument("--mapped", action="store_true", help="memory-map the layer (experts.numba's in_memory: false)")
    args = parser.parse_args(argv)
    EXPERTS = bench_experts.use_preset(args.preset)
    HIDDEN, INTER, TOP_K = bench_experts.HIDDEN, bench_experts.INTER, bench_experts.TOP_K
    arrays = stored_layer(args)
    if args.sequence:
        return sequence(arrays, args)
    if args.stager:
        return stager(arrays, args)
    v13, s13, v2, s2 = (arrays[n] for n in ("w13", "s13", "w2", "s2"))
    act_int8 = args.activations == "int8"
    experts = NumbaExperts(arrays, args.format, args.group, args.threads, act_int8, split_tokens=None)
    modes = {"gpu": experts, "staged": NumbaExperts(arrays, args.format, args.group, args.threads, act_int8, pin=False,
                                                     split_tokens=None),
             "split": NumbaExperts(arrays, args.format, args.group, args.threads, act_int8, split_tokens=1 << 30)}
    layer_bytes = sum(a.nbytes for a in (v13, s13, v2, s2))
    cuda = torch.cuda.is_available()
    h2d = None
    if cuda:
        h2d = ceilings.pinned_h2d_gb_s()
        w13 = torch.from_numpy(v13[0])  # one expert's packed w13 into a pinned buffer, as the GPU path stages it
        pinned = torch.empty(w13.shape, dtype=w13.dtype).pin_memory()

        def host_copy_gb_s():
            pinned.copy_(w13)
            t0 = time.perf_counter()
            for _ in range(10):
                pinned.copy_(w13)
            return 10 * w13.nbytes / (time.perf_counter() - t0) / 1e9

        on_stager = ExpertRing.on(torch.device("cuda", 0), {"w13": v13}, pin=False).stager.submit(host_copy_gb_s).result()
        print(f"host copy of an expert's w13 into pinned memory: {host_copy_gb_s():.1f} GB/s on this thread, "
              f"{on_stager:.1f} GB/s on the expert ring's staging thread", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    chunks = [int(c) for c in args.chunks.split(",")]
    for tokens in chunks:
        x = torch.from_numpy(rng.standard_normal((tokens, HIDDEN), np.float32))
        ids = torch.from_numpy(np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(tokens)]))
        w = torch.from_numpy(rng.random((tokens, TOP_K), np.float32))
        experts.forward(x, ids, w)  # compiled, the maps read
        t0 = time.perf_counter()
        experts.forward(x, ids, w)
        cpu_s = time.perf_counter() - t0
        row = {"tokens": tokens, "active_experts": int(ids.unique().numel()), "cpu_ms": cpu_s * 1e3}
        if cuda:
            xg, idg, wg = x.cuda().bfloat16(), ids.cuda(), w.cuda()
            moved = sum(a[e].nbytes for e in ids.unique().tolist() for a in (v13, s13, v2, s2) if a.ndim == 3)
            for key, layer in modes.items():
                layer.on_device(xg, idg, wg)  # the first: kernels compiled, the maps page-locked, the split measured
                torch.cuda.synchronize()
                if key == "split" and args.split_runs > 1:
                    runs = split_runs(layer, xg, idg, wg, args.split_runs)
                    gpu_s = float(np.median([r["ms"] for r in runs])) / 1e3
                    row["split_runs"] = runs
                else:
                    t0 = time.perf_counter()
                    layer.on_device(xg, idg, wg)
                    torch.cuda.synchronize()
                    gpu_s = time.perf_counter() - t0
                row.update({f"{key}_ms": gpu_s * 1e3, f"{key}_gb_s": moved / gpu_s / 1e9})
            row.update(of_h2d=row["gpu_gb_s"] / h2d)
            if args.profile and tokens == chunks[-1]:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    experts.on_device(xg, idg, wg)
                    torch.cuda.synchronize()
                for key in ("self_cpu_time_total", "self_device_time_total"):
                    print(prof.key_averages().table(sort_by=key, row_limit=15), flush=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    crossover = next((r["tokens"] for r in rows if "gpu_ms" in r and r["gpu_ms"] < r["cpu_ms"]), None)
    print(f"\nlayer: {args.preset} ({EXPERTS} experts of {HIDDEN} x {INTER}, {TOP_K} a token), "
          f"{args.format}/g{args.group}, {layer_bytes / 2**30:.2f} GiB; pinned H2D copy "
          f"{h2d or 0:.1f} GB/s; GPU path faster from {crossover} tokens" if cuda else "\n(no GPU: CPU figures only)")
    print("| chunk tokens | active experts | CPU ms | GPU-streamed ms, page-locked | streamed GB/s (of H2D) | "
          "staged ms (GB/s) | split ms (x the faster alone) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        gpu = (f"{r['gpu_ms']:.1f} | {r['gpu_gb_s']:.1f} ({r['of_h2d']:.0%}) | {r['staged_ms']:.1f} "
               f"({r['staged_gb_s']:.1f}) | {r['split_ms']:.1f} ({r['split_ms'] / min(r['cpu_ms'], r['gpu_ms']):.2f}x)"
               if "gpu_ms" in r else "- | - | - | -")
        print(f"| {r['tokens']} | {r['active_experts']} | {r['cpu_ms']:.1f} | {gpu} |")
    return rows


def split_runs(layer: NumbaExperts, x, ids, w, runs: int) -> list[dict]:
    """The split chunk `runs` times, each run's ms beside its halves as the layer measured them: the CPU's (token,
    expert) pairs and ms, the GPU's streamed experts and ms (CUDA events)."""
    speeds = split_speeds(layer, x.device)
    parts = {}
    cpu_done, update_gpu = speeds.cpu_done, speeds._update_gpu
    speeds.cpu_done = lambda s, pairs: (parts.update(cpu_pairs=pairs, cpu_ms=s * 1e3), cpu_done(s, pairs))
    speeds._update_gpu = lambda s, n: (parts.update(gpu_experts=n, gpu_ms=s * 1e3), update_gpu(s, n))
    out = []
    for _ in range(runs):
        parts.clear()
        t0 = time.perf_counter()
        layer.on_device(x, ids, w)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        speeds.measured()
        out.append({"ms": round(ms, 1), **{k: round(v, 1) for k, v in parts.items()}})
    del speeds.cpu_done, speeds._update_gpu
    return out


def stand_in(ms: float):
    """A closure queuing about `ms` of bf16 matmuls on the current stream (calibrated here), for an attention."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    per = ceilings.time_ms(lambda: torch.mm(a, a, out=c))

    def attention():
        for _ in range(round(ms / per)):
            torch.mm(a, a, out=c)
    return attention


def profile_sequence(layers, attention, x, ids, w, trace: str | None):
    """torch.profiler over the layers in turn (each after its attention stand-in), as timed; its Chrome trace
    shows the compute stream, the copy stream and the calling thread's ops side by side (not the staging
    thread's: the profiler records the thread that started it)."""
    attention()
    layers[-1].on_device(x, ids, w)  # prefetches layers[0], as in the timed runs
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for layer in layers:
            attention()
            layer.on_device(x, ids, w)
        torch.cuda.synchronize()
    print(f"profiled: {(time.perf_counter() - t0) * 1e3 / len(layers):.1f} ms per layer", flush=True)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12), flush=True)
    if trace:
        prof.export_chrome_trace(trace)


def sequence(arrays: dict, args) -> list[dict]:
    """Layers in turn on one chunk (see the module's docstring): the same random weights, a layer object each,
    so each layer's experts move again as they would from their own memory."""
    layer_bytes = sum(a.nbytes for a in arrays.values())
    h2d = ceilings.pinned_h2d_gb_s()
    ceiling_ms = layer_bytes / h2d / 1e6
    x = torch.randn(args.tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(args.tokens, EXPERTS, device="cuda").argsort(dim=1)[:, :TOP_K].contiguous()
    w = torch.rand(args.tokens, TOP_K, device="cuda")
    rows = []
    for depth in (int(r) for r in args.rings.split(",")):
        for attention_ms in (float(a) for a in args.attention_ms.split(",")):
            attention = stand_in(attention_ms) if attention_ms else (lambda: None)
            for prefetch in (False, True):
                layers = [NumbaExperts(arrays, args.format, args.group, None, gpu_tokens=1, gpu_ring=depth, split_tokens=None)
                          for _ in range(args.layers)]
                if prefetch:
                    chain_layers(layers)
                attention()
                layers[-1].on_device(x, ids, w)  # warm: kernels, the ring's buffers
                layers[0].prepare(args.tokens if prefetch else 0, x.device)  # as a chunk's forward starts
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for layer in layers:
                    attention()
                    layer.on_device(x, ids, w)
                torch.cuda.synchronize()
                per_layer = (time.perf_counter() - t0) * 1e3 / args.layers
                ring = ExpertRing.on(x.device, layers[0]._packed(), depth)
                layers[0].prepare(args.tokens if prefetch else 0, x.device)  # the next chunk's first layer
                attention()  # untimed: what of the next layer is staged and on the GPU once its attention is done
                torch.cuda.current_stream().synchronize()
                ready = [f for *_, f in ring.queue]
                staged = sum(f.done() for f in ready)
                arrived = sum(f.done() and f.result().query() for f in ready)
                layers[0].on_device(x, ids, w)
                row = {"ring": depth, "attention_ms": attention_ms, "prefetch": prefetch, "layer_ms": per_layer,
                       "exposed_experts_ms": per_layer - attention_ms, "h2d_ceiling_ms": ceiling_ms,
                       "queued_at_attention_end": len(ready), "staged": staged, "arrived": arrived}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.profile and prefetch:
                    profile_sequence(layers, attention, x, ids, w, args.trace)
                for *_, arrival in ring.queue:  # the last prefetch
                    arrival.result()
    print(f"\n{args.layers} layers of {args.format}/g{args.group} ({layer_bytes / 2**30:.2f} GiB each) in turn on "
          f"{args.tokens} tokens; pinned H2D {h2d:.1f} GB/s, so {ceiling_ms:.0f} ms per layer at best without overlap")
    print("| ring | attention stand-in ms | exposed experts ms, no prefetch | with prefetch | prefetch gain | "
          "with prefetch, of H2D ceiling |")
    print("| --- | --- | --- | --- | --- | --- |")
    for off, on in zip(rows[::2], rows[1::2]):
        print(f"| {on['ring']} | {on['attention_ms']:.0f} | {off['exposed_experts_ms']:.1f} | "
              f"{on['exposed_experts_ms']:.1f} | {off['exposed_experts_ms'] - on['exposed_experts_ms']:.1f} ms | "
              f"{on['exposed_experts_ms'] / ceiling_ms:.2f}x |")
    return rows


def stager(arrays: dict, args) -> list[dict]:
    """The host's share the GPU stream of a layer's experts takes while attention runs (issue 20): a 1M prefill's
    indexer stand-in (--calls calls of 128 queries x 2^18 FP8 keys, each its scores kernel, the queries' FP8
    quantisation and a top-2048: many launches, ~0.9 ms of GPU each on the H200) timed alone and while the whole
    layer streams into a ring that holds it, either as DMAs from the page-locked experts (queued by this thread
    first, the default) or copied through pinned buffers by the ring's staging thread (`pin_experts: false`)."""
    device = torch.device("cuda", 0)
    keys, scales = quantize_keys(torch.randn(1 << 18, 128, device=device))
    q = torch.randn(128, 32, 128, device=device, dtype=torch.bfloat16)
    w, pos = torch.randn(128, 32, device=device), torch.arange((1 << 18) - 128, 1 << 18, device=device)
    x = torch.randn(64, HIDDEN, device=device, dtype=torch.bfloat16)
    ids = torch.rand(64, EXPERTS, device=device).argsort(dim=1)[:, :TOP_K].contiguous()
    gates = torch.rand(64, TOP_K, device=device)

    def attention():
        for _ in range(args.calls):
            dsa_triton.indexer_scores(q, keys, w, pos, key_scales=scales).topk(2048, dim=-1)

    attention()
    rows = []
    for mode in ("alone", "page-locked DMAs", "staging thread", "alone", "page-locked DMAs", "staging thread"):
        layer = NumbaExperts(arrays, args.format, args.group, None, gpu_tokens=1, gpu_ring=EXPERTS,
                             pin=mode != "staging thread", split_tokens=None)
        layer.on_device(x, ids, gates)  # the ring's buffers allocated, the page-locking done
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if mode != "alone":
            layer.prefetch(device)
        queued = time.perf_counter() - t0
        attention()
        torch.cuda.current_stream().synchronize()
        attention_ms = (time.perf_counter() - t0 - queued) * 1e3
        ring = ExpertRing.on(device, layer._packed(), EXPERTS, layer.pin)
        staged = sum(f.done() for *_, f in ring.queue)
        layer.on_device(x, ids, gates)  # takes what was prefetched
        torch.cuda.synchronize()
        streamed_ms = (time.perf_counter() - t0) * 1e3
        row = {"mode": mode, "attention_ms": attention_ms, "queued_ms": queued * 1e3,
               "staged_by_attention_end": staged, "attention_and_layer_ms": streamed_ms}
        rows.append(row)
        print(json.dumps(row), flush=True)
    alone = min(r["attention_ms"] for r in rows if r["mode"] == "alone")
    print(f"\nindexer stand-in, {args.calls} calls (128 x 2^18 FP8 keys, top-2048) with a {args.preset} layer "
          f"({EXPERTS} experts) streaming into a ring that holds it; {torch.get_num_threads()} torch threads")
    print("| mode | attention ms | x alone | experts queued before it (ms) | staged by its end | then the layer, ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['attention_ms']:.1f} | {r['attention_ms'] / alone:.2f} | {r['queued_ms']:.1f} | "
              f"{r['staged_by_attention_end'] if r['mode'] != 'alone' else '-'} | {r['attention_and_layer_ms']:.1f} |")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
