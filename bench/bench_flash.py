"""GLM-5.3-Flash on the GPU machine: KDA against fla-core's own kernel, then a Flash-shaped checkpoint end to end.

    PYTHONPATH=.:bench python3 bench/bench_flash.py --dir /tmp/flash [--contexts 4096,131072] [--layers 2]
        [--kda-only] [--decode-gpu-experts N|auto] [--json FILE]

KDA (real dims: 64 heads x 128, bf16 projections): fla-core's chunk_kda alone (on normalised q, k and decays, as
kda.fla calls it), our whole KDA layer (projections, convolutions, chunk_kda, gated norm, o_proj) and the
plain-torch reference (kda.reference's recurrence) on the same tokens; the decode step (fused_recurrent_kda) beside
the bytes it must read (the state, twice).

End to end: a checkpoint of GLM-5.3-Flash's dims (make-tiny --preset glm-5.3-flash, FP8 projections) with `layers`
layers (one DSA layer last, the rest KDA, all MoE), placed by rules/glm5-flash.yaml; at each context `glm5 bench`'s
measurement (prefill, CUDA-graph decode, its split). The projection to the 45-layer model charges every layer the
measured per-layer decode time (3 of the 45 are dense: conservative), beside the host-bandwidth bound (the active
experts' int4 bytes per token / the host's read bandwidth, measured in the same run); the prefill's, the warm
synchronised prefill of the context per layer (the first prefill also pays Triton's and fla-core's compiles and
autotuning) per layer kind: the DSA layer's attention (the split's attention less the KDA layers', timed above)
times 11, a KDA layer's times 34, the experts per MoE layer times 42, the rest per layer times 45.
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from glm5_offload.benchmark import format_table, run_benchmark
from glm5_offload.config import load_config
from glm5_offload.errors import Glm5Error
from glm5_offload.formats.int_groups import nbytes
from glm5_offload.kernels.host_read import read_bandwidth_gb_s
from glm5_offload.loader import load_model
from glm5_offload.model import KDA, build_model
from glm5_offload.model.kda import KDAState
from glm5_offload.ops.kda_fla import FlaKDA, _fla_kda
from glm5_offload.rules import load_rules
from glm5_offload.runtime.engine import Engine
from glm5_offload.tiny import make_tiny

import ceilings
from bench_e2e import count_or_auto, with_kwargs


def kda_layer(config) -> FlaKDA:
    """One KDA layer of config's dims with random bf16 weights on the GPU (fp32 where the model keeps it)."""
    layer = build_model(config).model.layers[config.kda_layers[0]].self_attn
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, p in list(layer.named_parameters()):
        fp32 = name.endswith(("conv1d.weight", "dt_bias", "A_log"))
        t = torch.randn(p.shape, generator=g, device="cuda") * (p.shape[-1] ** -0.5)
        if name.endswith("o_norm.weight"):
            t = 1 + 0.1 * t
        module_name, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(module_name) if module_name else layer, attr,
                torch.nn.Parameter(t if fp32 else t.to(torch.bfloat16), requires_grad=False))
    layer.__class__ = FlaKDA
    return layer


def bench_kda(config, tokens: list[int]) -> list[dict]:
    H, D = config.linear_num_heads, config.linear_head_dim
    layer = kda_layer(config)
    kda = _fla_kda()
    rows = []
    for S in tokens:
        g = torch.Generator(device="cuda").manual_seed(S)
        q, k, v, logits = (torch.randn(S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        beta = torch.rand(S, H, device="cuda", generator=g)
        state = torch.zeros(H, D, D, device="cuda")
        x = torch.randn(S, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
        cache = KDAState(config, torch.device("cuda"), torch.bfloat16)
        nq, nk, nv, decay = layer.prepare(q, k, v, logits)
        fla_s = ceilings.time_ms(lambda: kda.chunk_kda(nq[None], nk[None], nv[None], decay[None], beta[None],
                                                       scale=1.0, initial_state=state[None], output_final_state=True),
                                 iters=5) / 1e3
        layer_s = ceilings.time_ms(lambda: (cache.clear(), layer(x, cache)), iters=5) / 1e3
        row = {"tokens": S, "fla_chunk_kda_ms": fla_s * 1e3, "fla_tok_s": S / fla_s, "kda_layer_ms": layer_s * 1e3,
               "layer_tok_s": S / layer_s, "layer_over_kernel": layer_s / fla_s}
        if S <= 8192:  # the torch reference's [H, 64, 64, D] gate differences per chunk: slow, and quadratic in memory
            ours = layer.recurrence(q, k, v, logits, beta, state)[0]
            ref = KDA.recurrence(layer, q, k, v, logits, beta, state)[0]
            row["fla_vs_reference_rel_err"] = float((ours.float() - ref).norm() / ref.norm())
            row["reference_ms"] = ceilings.time_ms(lambda: KDA.recurrence(layer, q, k, v, logits, beta, state),
                                                   warmup=1, iters=1)
            row["fla_speedup_over_reference"] = row["reference_ms"] / row["fla_chunk_kda_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    one = [t[:1] for t in (q, k, v, logits, beta)]
    step_s = ceilings.time_ms(lambda: layer.recurrence(*one, state), iters=50) / 1e3
    state_bytes = 2 * H * D * D * 4  # read and written once
    rows.append({"decode_step_us": step_s * 1e6, "state_gb_s": state_bytes / step_s / 1e9})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/flash")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--contexts", default="4096,131072")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=16384)
    parser.add_argument("--kda-tokens", default="4096,65536")
    parser.add_argument("--kda-only", action="store_true")
    parser.add_argument("--decode-gpu-experts", type=count_or_auto,
                        help="experts.numba's decode_gpu_experts in the rules (theirs: auto); 0: the cores alone")
    parser.add_argument("--discard", action="store_true", help="delete the checkpoint afterwards")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    target = load_config("glm-5.3-flash")
    results = {"kda": bench_kda(target, [int(t) for t in args.kda_tokens.split(",")])}
    if not args.kda_only:
        path = Path(args.dir)
        if not (path / "config.json").is_file():
            n = args.layers
            t0 = time.time()
            make_tiny(path, preset="glm-5.3-flash", layers=n, fp8=True, overrides={
                "layer_types": ["linear_attention"] * (n - 1) + ["deepseek_sparse_attention"],
                "indexer_types": ["full"] * n, "mlp_layer_types": ["sparse"] * n})
            results["write_s"] = time.time() - t0
        rules = load_rules("glm5-flash")
        if args.decode_gpu_experts is not None:
            rules = with_kwargs(rules, "experts.numba", {"decode_gpu_experts": args.decode_gpu_experts},
                                "--decode-gpu-experts")
        results["contexts"] = []
        for context in (int(c) for c in args.contexts.split(",")):
            max_seq_len = context + 2 * args.new_tokens
            model = load_model(path, rules=rules, max_seq_len=max_seq_len)
            engine = Engine(model, max_seq_len=max_seq_len, prefill_chunk=args.prefill_chunk)
            r = run_benchmark(engine, context, args.new_tokens)
            print(format_table(r), flush=True)
            results["contexts"].append(r)
            del engine, model
            torch.cuda.empty_cache()
        read = read_bandwidth_gb_s()
        active = nbytes(target.active_expert_weights, "int4", 128)
        bound = read * 1e9 / active
        kda_tok_s = [row["layer_tok_s"] for row in results["kda"] if "layer_tok_s" in row][-1]
        n_kda, n_dsa = args.layers - 1, 1
        for r in results["contexts"]:
            per_layer_ms = r["decode_ms_per_token"] / args.layers
            projected = 1e3 / (per_layer_ms * target.num_hidden_layers)
            split = r["prefill_split_s"]
            kda_s = r["context"] / kda_tok_s  # one KDA layer over the context, as measured above
            dsa_s = (split["attention"] - n_kda * kda_s) / n_dsa
            prefill_s = (dsa_s * len(target.full_layers) + kda_s * len(target.kda_layers)
                         + split["experts"] / args.layers * len(target.moe_layers)
                         + (split["other"] + split["dense"] + split["transfers"]) / args.layers
                         * target.num_hidden_layers)  # the dense MLP charged to every layer: conservative
            r["projection"] = {"decode_tok_s": projected, "host_bound_tok_s": bound, "of_bound": projected / bound,
                               "prefill_s_full_model": prefill_s, "dsa_layer_prefill_s": dsa_s,
                               "kda_layer_prefill_s": kda_s}
            print(f"context {r['context']}: projected GLM-5.3-Flash decode {projected:.2f} tok/s, host bound "
                  f"{bound:.2f} tok/s (read {read:.0f} GB/s, {active / 1e9:.2f} GB/token): {projected / bound:.0%}; "
                  f"prefill of the full model {r['projection']['prefill_s_full_model']:.0f} s", flush=True)
        results["host_read_gb_s"], results["hbm_copy_gb_s"] = read, ceilings.hbm_copy_gb_s()
        if args.discard:
            shutil.rmtree(path)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    try:
        main()
    except Glm5Error as e:  # a placement refused (--decode-gpu-experts 8 leaves the cores none), a bad checkpoint
        sys.exit(f"bench_flash: {e}")
