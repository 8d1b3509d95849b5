"""The tiered latent cache on the H200: a GLM-5-shaped model with GLM-5.2's real attention and indexer dims
cut to two layers (one full, one IndexShare-shared; dense MLPs), every latent row in pinned host memory and a
256 MiB hot buffer per layer, the GPU capped at 24 GiB. Contexts of 4K, 128K and 1M are really prefilled
(chunks of 2048), then decoded token by token.

    PYTHONPATH=.:bench python3 bench/bench_tiered.py [--contexts 4096,131072,1048576] [--kv-dtype fp8]

First, tiered == untiered: greedy logits over a 131072-token prefill and 8 decode steps with a 16 MiB hot
buffer, bit for bit. Then figures (after a warm-up context, so no Triton compilation is timed): decode
time per token per layer, hot-buffer hit rate, bytes fetched from the host per token, the
zero-copy gather's bandwidth next to the pinned host-to-GPU copy bandwidth measured in the same run (and
next to the staged alternative: a CPU gather into pinned memory + one copy), 1M decode speed / 4K, prefill
time per layer, peak GPU memory next to the planner's figure.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from glm5_offload.config import load_config
from glm5_offload.kernels.gather_rows import gather_rows_triton
from glm5_offload.loader import load_model
from glm5_offload.model import build_model
from glm5_offload.planner import make_plan
from glm5_offload.rules import load_rules, place
from glm5_offload.runtime.kv_cache import new_cache
from glm5_offload.tiny import make_tiny

import ceilings

GPU_CAP = 24 << 30


def write_checkpoint(path: Path) -> Path:
    """GLM-5.2's config cut to two dense layers (one full, one sharing its indexer) and a 4096-token
    vocabulary, random bf16 weights."""
    return make_tiny(path, preset="glm-5.2", layers=2,
                     overrides={"first_k_dense_replace": 2, "indexer_types": ["full", "shared"], "vocab_size": 4096})


def rules_file(path: Path, kv_dtype: str, offload: bool = True, hot_budget: str = "256MiB") -> Path:
    path.write_text(f"""
- default: {{device: cuda}}
- match: {{class: Attention}}
  replace:
    op: attention.dsa_triton
    kwargs: {{kv_offload: {str(offload).lower()}, hot_budget: {hot_budget}, window: 1024, kv_dtype: {kv_dtype}}}
- match: {{class: Indexer}}
  replace: {{op: indexer.dsa_triton}}
""")
    return path


def gather_gb_s(row_bytes: int, n_rows: int = 1 << 20, k: int = 2048) -> tuple[float, float]:
    """2048 random rows of a 1M-row pinned host table into a GPU buffer: zero-copy Triton gather (replayed from a
    CUDA graph), and the staged alternative (indices to the host, CPU gather into pinned memory, one copy)."""
    host = torch.randint(0, 255, (n_rows, row_bytes), dtype=torch.uint8).pin_memory()
    hot = torch.empty(k, row_bytes, dtype=torch.uint8, device="cuda")
    rows = torch.randperm(n_rows, device="cuda")[:k]
    slots = torch.arange(k, device="cuda")
    zero_copy = ceilings.graph_ms(lambda: gather_rows_triton(host, rows, hot, slots))
    staging = torch.empty(k, row_bytes, dtype=torch.uint8).pin_memory()

    def staged():
        torch.index_select(host, 0, rows.cpu(), out=staging)
        hot.copy_(staging, non_blocking=True)

    staged_ms = ceilings.time_ms(staged)
    return k * row_bytes / zero_copy / 1e6, k * row_bytes / staged_ms / 1e6


def run_context(model_dir: Path, rules: Path, context: int, kv_dtype: str, steps: int = 48) -> dict:
    max_seq = context + steps + 1
    placement_rules = load_rules(rules)
    plan = make_plan(load_config(model_dir), place(build_model(load_config(model_dir)), placement_rules, None),
                     max_seq, {"cuda": GPU_CAP, "cpu": None}, kv_dtype="fp8" if kv_dtype == "fp8" else None)
    model = load_model(model_dir, rules=placement_rules, max_seq_len=max_seq, budgets={"cuda": GPU_CAP})
    torch.cuda.reset_peak_memory_stats()
    cache = new_cache(model, max_seq)
    prompt = torch.randint(0, 4096, (context,), generator=torch.Generator().manual_seed(context))
    from tqdm import tqdm

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with tqdm(total=context, desc=f"prefill {context}", unit="tok", mininterval=5) as bar:
        for s in range(0, context, 2048):
            logits = model(prompt[s : s + 2048].cuda(), cache, logits_for="last")
            bar.update(min(2048, context - s))
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    token = logits[-1].argmax().reshape(1)
    model(token, cache, logits_for="last")  # the first decode step fills the hot buffers: not timed
    before = cache.offload_stats()
    step_s = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        token = model(token, cache, logits_for="last")[-1].argmax().reshape(1)
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
    decode_s = sorted(step_s)[steps // 2] * steps  # the median step: the host's hiccups left out
    after = cache.offload_stats()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    layers = model.config.num_hidden_layers
    gpu_plan = next(d for d in plan.devices if d.device == "cuda")
    out = {
        "context": context, "prefill_s": prefill_s, "prefill_tok_s": context / prefill_s,
        "prefill_s_per_layer": prefill_s / layers,
        "decode_ms_per_token": decode_s / steps * 1e3, "decode_ms_per_token_layer": decode_s / steps * 1e3 / layers,
        "hit_rate": hits / max(hits + misses, 1),
        "fetched_bytes_per_token": (after["fetched_bytes"] - before["fetched_bytes"]) / steps,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30, "plan_gpu_gib": gpu_plan.total / 2**30,
    }
    del model, cache
    torch.cuda.empty_cache()
    return out


def equal_to_untiered(model_dir: Path, tmp: Path, kv_dtype: str, context: int = 131072, steps: int = 8) -> bool:
    """Greedy logits of a prefill and `steps` decode steps, tiered (a 16 MiB hot buffer: 14K rows, 9x less than
    the context) against the whole cache on the GPU: bit-identical?"""
    prompt = torch.randint(0, 4096, (context,), generator=torch.Generator().manual_seed(7))
    runs = []
    for offload in (False, True):
        rules = load_rules(rules_file(tmp / f"equal-{offload}.yaml", kv_dtype, offload, "16MiB"))
        model = load_model(model_dir, rules=rules)
        cache = new_cache(model, context + steps)
        for s in range(0, context, 2048):
            logits = model(prompt[s : s + 2048].cuda(), cache, logits_for="last")
        out = [logits]
        for _ in range(steps):
            out.append(model(out[-1][-1].argmax().reshape(1), cache, logits_for="last"))
        runs.append(torch.cat(out).cpu())
        del model, cache
        torch.cuda.empty_cache()
    return torch.equal(*runs)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="4096,131072,1048000")
    parser.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--equality-only", action="store_true", help="only the tiered == untiered check")
    args = parser.parse_args(argv)
    torch.cuda.set_per_process_memory_fraction(GPU_CAP / torch.cuda.get_device_properties(0).total_memory)
    h2d = ceilings.pinned_h2d_gb_s()
    row_bytes = 656 if args.kv_dtype == "fp8" else 1152
    zero_copy, staged = gather_gb_s(row_bytes)
    results = {"pinned_h2d_gb_s": h2d, "row_bytes": row_bytes, "gather_zero_copy_gb_s": zero_copy,
               "gather_staged_gb_s": staged, "contexts": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / "glm5-2layer")
        rules = rules_file(Path(tmp) / "tiered.yaml", args.kv_dtype)
        results["equal_to_untiered_131072"] = equal_to_untiered(model_dir, Path(tmp), args.kv_dtype)
        print(f"tiered (16 MiB hot buffer) == untiered over a 131072-token prefill and 8 decode steps: "
              f"{results['equal_to_untiered_131072']}", flush=True)
        if args.equality_only:
            return results
        run_context(model_dir, rules, 4096, args.kv_dtype)  # warm-up: Triton compiles each kernel's variants once
        for context in map(int, args.contexts.split(",")):
            results["contexts"].append(run_context(model_dir, rules, context, args.kv_dtype))
            print(json.dumps(results["contexts"][-1]), flush=True)
    first, last = results["contexts"][0], results["contexts"][-1]
    results["decode_speed_last_over_first"] = first["decode_ms_per_token"] / last["decode_ms_per_token"]
    print(json.dumps(results, indent=1))
    print(f"\npinned H2D copy {h2d:.1f} GB/s; gather of 2048 rows of {row_bytes} B: zero-copy {zero_copy:.1f} GB/s "
          f"= {zero_copy / h2d:.0%}, staged {staged:.1f} GB/s = {staged / h2d:.0%}")
    print("| context | prefill s/layer | prefill tok/s | decode ms/token/layer | hit rate | fetched/token | "
          "peak GPU | plan GPU |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results["contexts"]:
        print(f"| {r['context']} | {r['prefill_s_per_layer']:.2f} | {r['prefill_tok_s']:.0f} | "
              f"{r['decode_ms_per_token_layer']:.2f} | {r['hit_rate']:.1%} | {r['fetched_bytes_per_token'] / 1e6:.2f} MB | "
              f"{r['peak_gpu_gib']:.2f} GiB | {r['plan_gpu_gib']:.2f} GiB |")
    print(f"decode speed at {last['context']} / at {first['context']}: {results['decode_speed_last_over_first']:.0%}")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
