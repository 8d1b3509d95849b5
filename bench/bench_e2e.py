"""End to end on a GLM-5-shaped checkpoint, and the projection of its per-layer figures to the full models.

    PYTHONPATH=.:bench python3 bench/bench_e2e.py --dir /tmp/g5 [--preset glm-5 --layers 2[,3] --indexshare --fp8]
        [--discard] [--rules glm5 --gpu-ring 256 --sampled-topk --decode-gpu-experts 3] [--contexts 4096,131072]
        [--new-tokens 16]
        [--prefill-chunk 16384] [--peer all,offload] [--prefill-only | --filled] [--repeats 1] [--json FILE]

Writes the checkpoint with make-tiny unless --dir holds one (with several cuts, the largest; the others are cut from
it: cut_from, and each cut's converted experts are linked into the next cuts' expert caches: link_experts); at each
context, a fresh engine and `glm5 bench`'s
measurement (benchmark.run_benchmark), or with --filled only decode, after a context of random cache rows
(bench_context.fill, as if prefilled: a 1M context's decode without its 1M prefill), --repeats times (the median
load's figures kept: median_trial), each load in a process of its own as a user's (in_own_process); with --peer,
transformers on the same checkpoint (bench_peer.py) and our decode speed-up per layer over it; each load also measures
the host's read bandwidth in its process right after its decode (the bound of that load: it has ranged 101-137 GB/s
from one process to the next on one H200 machine), and the projection to GLM-5 and GLM-5.2 takes its bound from
the median of the loads' reads at each context: with two layer counts, the cost of one more MoE layer times the
targets' MoE layers plus the fixed rest, the layer's cost in parts (step_parts: its CPU experts' time in the step, the
median over every load, whose speed varies from one to the next on the H200 machine's host; the rest from the
checkpoints' difference) and, beside it, the difference of the median loads (marginal_layer) with each run's CPU
experts timed alone in its own process (benchmark.experts_alone); with --indexshare, a third cut whose last layer is
an IndexShare shared layer (it reuses the selection below it: no indexer) measured against the smaller one gives the
step taken for the targets' shared MoE layers (GLM-5.2's 57 of 75; the cuts' layers are otherwise all "full"); with
one layer count, the whole measured step per MoE layer (which also charges it the dense layer, embedding and head:
conservative); next to the host-bandwidth bound (the active experts' bytes per token in the placement's format / read
bandwidth); and the first checkpoint's last-context prefill, from its synchronised split, per layer kind
(benchmark.prefill_projection)."""

import argparse
import dataclasses
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import bench_peer
import torch
from bench_context import fill
from safetensors import safe_open
from safetensors.torch import save_file

from glm5_offload.benchmark import (bus_read_gb_s, experts_alone, experts_huge_pages, experts_replayed, format_table,
                                    generate_split, gpu_experts, moe_layer_line, prefill_projection, prefill_split,
                                    random_prompt, recorded_experts, replayed_seconds, run_benchmark)
from glm5_offload.checkpoint import INDEX_FILE, check_shard
from glm5_offload.cli import show_engine_log
from glm5_offload.config import json_object, load_config, parse_config
from glm5_offload.errors import Glm5Error
from glm5_offload.formats.int_groups import nbytes
from glm5_offload.kernels.host_read import read_bandwidth_gb_s
from glm5_offload.loader import load_model
from glm5_offload.ops.experts_numba import NumbaExperts, expert_store
from glm5_offload.rules import RuleFile, load_rules
from glm5_offload.runtime.engine import Engine
from glm5_offload.tiny import layer_of, make_tiny, shaped_config
from glm5_offload.util import cache_dir

TARGETS = ("glm-5", "glm-5.2")


def expert_format(model) -> tuple[str, int] | None:
    """The CPU experts' (format, group size), or None when the routed experts are not experts.numba."""
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if isinstance(experts, NumbaExperts):
            return experts.fmt, experts.group
    return None


def decode_filled(engine: Engine, context: int, new_tokens: int) -> dict:
    """Decode after a context of random cache rows (bench_context.fill: no prefill), twice: the second run's speed and
    graph split, and its CPU experts' calls made again alone. It continues the first (its prompt is the first's with
    its reply: one token prefilled), so the tiered cache's hot rows are those a long decode keeps (a rewind to the
    first run's position would free the LRU slots of tokens within a window of it)."""
    fill(engine, context)
    prompt = engine.cache_ids + [0]  # the cached rows are the prompt's prefix: one token is prefilled
    first = engine.generate(prompt, new_tokens)
    with recorded_experts(engine.model) as calls:
        again, graph_split, layer_step = generate_split(engine, first.prompt_ids + first.output_ids, new_tokens)
    alone = replayed_seconds(calls)
    ms = 1e3 / again.decode_tokens_per_s if again.decode_tokens_per_s else None
    return {"context": context, "filled": True, "new_tokens": new_tokens, "prefilled_tokens": again.prefilled_tokens,
            "decode_ms_per_token": ms, "graph_split_ms_per_token": graph_split, "moe_layer_step": layer_step,
            "experts_replayed_ms_per_token": experts_replayed(calls, alone), "call_by_call": call_by_call(calls, alone)}


def call_by_call(calls: list, alone: list[float]) -> dict | None:
    """Each of a decode's CPU expert calls (recorded_experts: its seconds in the step) against the same call made once
    more alone right after (alone: replayed_seconds): the quartiles of in the step / alone, the share of the step's
    excess over alone that the slowest tenth of the calls carry (near a tenth: every call reads slower in the step;
    near all of it: a few calls held up, the rest as fast as alone), and the median ratio of each MoE layer in turn
    (a step's first MoE layer follows the longest pause of the experts' threads: the head, the sampling, the next
    step's first layers). None without calls."""
    if not calls:
        return None
    ratios = [call[-1] / a for call, a in zip(calls, alone)]
    excess = sorted((call[-1] - a for call, a in zip(calls, alone)), reverse=True)
    total = sum(e for e in excess if e > 0)
    slowest = sum(e for e in excess[: max(1, len(excess) // 10)] if e > 0)
    layers = list(dict.fromkeys(id(layer) for layer, *_ in calls))  # in the order a step calls them
    by_layer = [statistics.median(r for (layer, *_), r in zip(calls, ratios) if id(layer) == key) for key in layers]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"calls": len(calls), "ratio_quartiles": quartiles, "slowest_tenth_share": slowest / total if total else 0.0,
            "median_ratio_by_layer": by_layer}


def bench_context(model_dir: Path, rules, context: int, new_tokens: int, prefill_chunk: int,
                  prefill_only: bool = False, filled: bool = False) -> tuple[dict, tuple | None]:
    max_seq_len = context + 2 * new_tokens + 1  # --filled: a prompt of the context and one token, then a timed run
    # that continues the first (glm5 bench's runs fit too)
    model = load_model(model_dir, rules=rules, max_seq_len=max_seq_len)
    os.sync()  # a checkpoint or expert cache just written is on the disk before anything is timed (its writeback
    # would compete with the experts for the host's cores and memory)
    engine = Engine(model, max_seq_len=max_seq_len, prefill_chunk=prefill_chunk)
    engine.stop_ids = set()  # new_tokens decoded whatever they are (an end-of-text token would cut the timed run short)
    if prefill_only:  # a shorter prefill first compiles the kernels (run_benchmark's split follows a first run)
        engine.generate(random_prompt(engine, min(context, 2 * prefill_chunk), seed=1), 1)
        result = {"context": context, "prefill_split_s": prefill_split(engine, random_prompt(engine, context))}
        print(json.dumps(result), flush=True)
    elif filled:
        result = decode_filled(engine, context, new_tokens)
        result["experts_alone_ms_per_token"] = alone = experts_alone(model)
        split, replayed = result["graph_split_ms_per_token"] or {}, result["experts_replayed_ms_per_token"]
        print(f"decode after {context} filled tokens: {result['decode_ms_per_token']:.2f} ms/token ("
              + ", ".join(f"{k} {v:.3f}" for k, v in split.items()) + ")"
              + ("" if alone is None else f"; the experts alone {alone:.3f} ms")
              + ("" if replayed is None else f", the decode's own calls again alone {replayed:.3f} ms"), flush=True)
        if result["call_by_call"]:
            c = result["call_by_call"]
            print(f"call by call, in the step / alone ({c['calls']} calls): quartiles "
                  + " ".join(f"{r:.2f}x" for r in c["ratio_quartiles"])
                  + f"; the slowest tenth of the calls carry {c['slowest_tenth_share']:.0%} of the excess; "
                  "medians by MoE layer in a step's order " + " ".join(f"{r:.2f}x" for r in c["median_ratio_by_layer"]),
                  flush=True)
        if result["moe_layer_step"]:  # one load's own step / experts (the parts' mix two loads' experts)
            print(moe_layer_line(result["moe_layer_step"]).strip(), flush=True)
    else:
        result = run_benchmark(engine, context, new_tokens)
    fmt = expert_format(model)
    if not prefill_only:  # this load's bound: the host's read right after its decode, in its process (glm5 bench's
        # measures it already where the experts are on the CPU)
        read = (result.get("host_bound") or {}).get("host_read_gb_s") or read_bandwidth_gb_s()
        result["read_gb_s"] = read
        result["gpu_experts"] = gpu = gpu_experts(model)  # read over the GPU's bus beside the cores: the bus's
        result["bus_read_gb_s"] = ((result.get("host_bound") or {}).get("bus_read_gb_s") or bus_read_gb_s(model.device)
                                   if gpu else None)  # read joins the bound
        experts_ms = (result["graph_split_ms_per_token"] or {}).get("experts")
        if fmt and experts_ms:  # (loads' experts have differed by 25% at one read: huge pages named to compare)
            gb_s = nbytes(model.config.active_expert_weights, *fmt) / experts_ms / 1e6
            pages = experts_huge_pages(model)
            huge = f" ({pages[1] / pages[0]:.0%} of their memory in huge pages)" if pages and pages[0] else ""
            bus = (f"; the GPU read {gpu} of a token's {model.config.num_experts_per_tok} over its bus (pinned copy "
                   f"{result['bus_read_gb_s']:.0f} GB/s)") if gpu else ""
            print(f"host read after the decode {read:.0f} GB/s; the experts in the step read {gb_s:.0f} GB/s, "
                  f"{gb_s / read:.0%} of it{huge}{bus}", flush=True)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result, fmt


def cut_from(base: Path, out: Path, config: dict, keep) -> None:
    """A cut written from a larger one instead of generated again (a GLM-5.2 MoE layer takes a minute or more of the
    device's time to generate): the tensors of base that keep(name) accepts, under config. make_tiny seeds each tensor
    by its name, so a cut of fewer layers, or without a shared layer's indexer, holds what make_tiny would write for
    it. A shard whose tensors are all kept is hard-linked (copied across file systems), one with some kept is
    rewritten with them, one with none is left out; tokenizer files are linked."""
    index = json_object(base / INDEX_FILE)
    dropped = {name for name in index["weight_map"] if not keep(name)}
    partly = {index["weight_map"][name] for name in dropped}
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    for f in base.iterdir():
        if f.name in partly:
            _, header = check_shard(f)
            index["metadata"]["total_size"] -= sum(v["data_offsets"][1] - v["data_offsets"][0]
                                                   for k, v in header.items() if k in dropped)
            with safe_open(f, "pt") as shard:
                kept = {k: shard.get_tensor(k) for k in shard.keys() if k not in dropped}
            if kept:
                save_file(kept, str(tmp / f.name), metadata={"format": "pt"})
        elif f.name not in ("config.json", INDEX_FILE):
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copy2(f, tmp / f.name)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in dropped}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, out)


def cut_keeps(config: dict):
    """keep(name) for cut_from: the tensors of config's layers (below its num_hidden_layers) but the indexers of its
    IndexShare shared layers, and those outside the layers (embedding, final norm, head)."""
    parsed = parse_config(config, "a cut's config")

    def keep(name: str) -> bool:
        i = layer_of(name)
        if i is None:
            return True
        return i < parsed.num_hidden_layers and not (parsed.indexer_types[i] == "shared" and ".indexer." in name)

    return keep


def write_cuts(folder: Path, preset: str, fp8: bool, cuts: list[tuple[str, int, dict | None]]) -> None:
    """The cuts (folder name, layers, make_tiny's overrides) not yet in folder: the largest (the first listed of
    those) generated by make_tiny, the others cut from it (cut_from), each with the config make_tiny would write.
    A cut already there must hold that config (check_cut)."""
    base_name, base_layers, base_overrides = max(cuts, key=lambda c: c[1])
    base = folder / base_name
    if not (base / "config.json").is_file():
        make_tiny(base, preset=preset, layers=base_layers, fp8=fp8, overrides=base_overrides)
    quantization = json_object(base / "config.json").get("quantization_config")
    for name, layers, overrides in cuts:
        config = shaped_config(preset, layers, overrides)
        if quantization:
            config["quantization_config"] = quantization
        if not (folder / name / "config.json").is_file():
            cut_from(base, folder / name, config, cut_keeps(config))
        check_cut(folder / name, config, fp8)


def check_cut(cut: Path, config: dict, fp8: bool):
    """A one-line Glm5Error unless the cut's config.json is `config` and has FP8 projections as asked: an earlier
    run's other cut under the same name would be measured as this one."""
    held = json_object(cut / "config.json")
    for key in sorted(config.keys() | held.keys()):
        if held.get(key) != config.get(key):
            raise Glm5Error(f"{cut}: an earlier cut with other settings ({key} {held.get(key)!r}, here "
                            f"{config.get(key)!r}): remove it or pass another --dir")
    if ("quantization_config" in held) != fp8:
        raise Glm5Error(f"{cut}: an earlier cut {'with' if not fp8 else 'without'} FP8 projections, here "
                        f"{'with' if fp8 else 'without'}: remove it or pass another --dir")


def link_experts(model_dir: Path, others: list[Path], fmt: tuple) -> None:
    """model_dir's converted experts entered in the expert stores of the cuts still to be measured (the same
    tensors: cut_from), so their loads read them instead of converting them again."""
    done = expert_store(cache_dir() / "experts", model_dir, *fmt)
    for other in others:
        store, keep = expert_store(cache_dir() / "experts", other, *fmt), cut_keeps(json_object(other / "config.json"))
        for name in done.manifest().get("files", {}):
            if keep(name) and name not in store.manifest().get("files", {}):
                store.link(name, done)


def in_own_process(fn, *args):
    """fn(*args) in a fresh process (spawned: no CUDA context, allocator caches or memory maps of earlier loads; the
    engine's INFO lines on stderr, as `glm5` shows them), as a user's process loads one model. Loads after earlier
    1M-context loads in the same process ran their CPU experts up to 1.5x slower (H200 machine, sessions 29-30); each
    in a process of its own, not."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=show_engine_log) as pool:
        return pool.submit(fn, *args).result()


def trial_ms(result: dict) -> float:
    """A trial's figure to rank it by: decode ms per token, or a prefill-only trial's whole split in ms."""
    if "decode_ms_per_token" in result:
        return result["decode_ms_per_token"]
    return 1e3 * sum(result["prefill_split_s"].values())


def median_trial(trials: list[tuple[dict, tuple | None]]) -> tuple[dict, tuple | None]:
    """The trial (bench_context's result, format) of median figure (the lower middle of an even count): one
    load's figures kept whole, its graph split with its total. Loads of the same checkpoint differ (the CPU experts'
    time has varied 2.0-3.3 ms a token from one to the next): --repeats takes the median of several."""
    return sorted(trials, key=lambda t: trial_ms(t[0]))[(len(trials) - 1) // 2]


def projection(results: list[dict], measured_moe: int, fmt: tuple | None, read_gb_s: list[float],
               layer: list[dict] | None = None, basis: str = "marginal",
               shared: list[dict] | None = None, bus_gb_s: list[float | None] | None = None) -> list[dict]:
    """Decode per token of each target: the fixed part plus its MoE layers times one MoE layer's step where two
    layer counts were measured (`layer`: step_parts' or marginal_layer's rows, named by `basis`; `shared`: the same
    for a MoE layer that is an IndexShare shared layer, which reuses the selection below it, taken for a target's
    shared MoE layers), else the whole measured step per MoE layer (conservative). A step cheaper than its experts'
    bytes at the read bandwidth is the runs' noise, not a speed: that row takes the conservative basis (and says so).
    A context beyond a target's max_position_embeddings has no row. read_gb_s: the host's read (the cores'), per
    context: the bound; bus_gb_s: where the GPU read some of a token's experts over its bus (decode_gpu_experts), its
    pinned copy's speed, per context: then the bytes may come faster than the cores' read, never faster than the two
    reads' sum (the noise's line; `bus_bound_tok_s`)."""
    rows = []
    for target in TARGETS:
        config = load_config(target)
        moe = len(config.moe_layers)
        full = sum(config.indexer_types[i] == "full" for i in config.moe_layers) if shared else moe
        for i, r in enumerate(results):
            if r["context"] > config.max_position_embeddings:  # GLM-5 at 1M: only GLM-5.2 reaches it
                continue
            bound_ms = bus_ms = None
            if fmt is not None:
                bound_ms = bus_ms = nbytes(config.active_expert_weights, *fmt) / read_gb_s[i] / 1e6
                if bus_gb_s and bus_gb_s[i]:
                    bus_ms = bound_ms * read_gb_s[i] / (read_gb_s[i] + bus_gb_s[i])
            ms, name = r["decode_ms_per_token"] * moe / measured_moe, "whole step"
            if layer:
                steps = full * layer[i]["moe_layer_ms"] + ((moe - full) * shared[i]["moe_layer_ms"] if full < moe
                                                           else 0.0)
                if bus_ms is not None and steps < bus_ms:
                    name = f"whole step ({basis} below the bound: noise)"
                else:
                    ms, name = layer[i]["fixed_ms"] + steps, basis + (", IndexShare" if full < moe else "")
            rows.append({"target": target, "context": r["context"], "measured_ms_per_token": r["decode_ms_per_token"],
                         "basis": name, "projected_ms_per_token": ms, "projected_tok_s": 1e3 / ms,
                         "bound_tok_s": None if bound_ms is None else 1e3 / bound_ms,
                         "of_bound": None if bound_ms is None else bound_ms / ms,
                         "bus_bound_tok_s": None if bus_ms == bound_ms else 1e3 / bus_ms})
    return rows


def step_parts(loads: dict[int, list[list[dict]]], moe: dict[int, int]) -> list[dict] | None:
    """One MoE layer's decode step in two parts, steadier than marginal_layer's difference of two loads: its CPU
    experts, the median over every load of both checkpoints of their time in the step per MoE layer (it varies
    15-25% from one load to the next on the H200 machine's host, and a difference of two loads carries that into a
    projection 75 times); and the rest (GPU work the step waits for, host actions), from the difference of the two
    checkpoints' medians of the step less its experts, steady from load to load. loads: per layer count, per
    context, every load's result. None without the graph split (no CPU experts in the step)."""
    (a, la), (b, lb) = sorted(loads.items())
    rows = []
    for xs, ys in zip(la, lb):
        if not all(r["graph_split_ms_per_token"] for r in xs + ys):
            return None
        rest = lambda r: r["decode_ms_per_token"] - r["graph_split_ms_per_token"]["experts"]  # noqa: E731
        experts = statistics.median(r["graph_split_ms_per_token"]["experts"] / moe[n]
                                    for n, runs in ((a, xs), (b, ys)) for r in runs)
        rest_a = statistics.median(map(rest, xs))
        rest_layer = (statistics.median(map(rest, ys)) - rest_a) / (moe[b] - moe[a])
        rows.append({"context": xs[0]["context"], "loads": len(xs) + len(ys), "experts_ms": experts,
                     "rest_ms": rest_layer, "moe_layer_ms": experts + rest_layer,
                     "step_over_experts": (experts + rest_layer) / experts, "fixed_ms": rest_a - moe[a] * rest_layer})
    return rows


def marginal_layer(runs: dict[int, list[dict]], moe: dict[int, int]) -> list[dict]:
    """From two checkpoints that differ by MoE layers (name-seeded: the smaller's tensors are the larger's
    first layers), per context: one MoE layer's decode step time and CPU expert time (from the graph split),
    their ratio (the overlap goal's), and the fixed rest (embedding, dense layer, head, sampling)."""
    (a, ra), (b, rb) = sorted(runs.items())
    rows = []
    for x, y in zip(ra, rb):
        step = (y["decode_ms_per_token"] - x["decode_ms_per_token"]) / (moe[b] - moe[a])
        split_x, split_y = x["graph_split_ms_per_token"], y["graph_split_ms_per_token"]
        experts = None if not split_x else (split_y["experts"] - split_x["experts"]) / (moe[b] - moe[a])
        alone = [alone_ms(r, moe[n]) for r, n in ((x, a), (y, b))]
        rows.append({"context": x["context"], "moe_layer_ms": step,
                     "fixed_ms": x["decode_ms_per_token"] - moe[a] * step, "moe_layer_experts_ms": experts,
                     "step_over_experts": None if not experts else step / experts, "experts_alone_ms_per_layer": alone})
    return rows


def alone_ms(result: dict, moe_layers: int) -> float | None:
    """A run's CPU experts timed alone in its process (benchmark.experts_alone), per MoE layer."""
    ms = result.get("experts_alone_ms_per_token") or (result.get("host_bound") or {}).get("experts_alone_ms_per_token")
    return ms and ms / moe_layers


def count_or_auto(text: str) -> int | str:
    """--decode-gpu-experts' value: a count or auto."""
    if text == "auto":
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"a number of experts or auto, got {text!r}")


def with_kwargs(rules: RuleFile, op: str, kwargs: dict, flag: str) -> RuleFile:
    """The rule file with kwargs set in its rules that name op, checked as a rule file's are (flag: the
    command-line flag that asked, named in the error)."""
    changed = []
    for rule in rules.rules:
        if rule.op is not None and rule.op.name == op:
            try:
                rule = dataclasses.replace(rule, kwargs=rule.op.parse_kwargs({**rule.kwargs, **kwargs}))
            except Glm5Error as e:
                raise SystemExit(f"{flag}: {e}") from None
        changed.append(rule)
    return dataclasses.replace(rules, rules=tuple(changed))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, help="the checkpoint (written here with make-tiny if absent; with "
                                                     "several layer counts, one in DIR/<n>-layers each)")
    parser.add_argument("--preset", default="glm-5")
    parser.add_argument("--layers", default="2", help="layer counts, e.g. 2,3: the projection then takes the "
                                                      "measured cost of one more MoE layer (marginal_layer)")
    parser.add_argument("--fp8", action="store_true", help="write the checkpoint with FP8 projections (half the disk)")
    parser.add_argument("--discard", action="store_true",
                        help="delete each checkpoint and its expert cache once measured (the disk holds one)")
    parser.add_argument("--rules", default="glm5")
    parser.add_argument("--gpu-ring", type=int, help="experts.numba's gpu_ring in every experts rule: experts the "
                                                     "GPU holds at once for long chunks (256: a whole GLM-5 layer)")
    parser.add_argument("--decode-gpu-experts", type=count_or_auto,
                        help="experts.numba's decode_gpu_experts in every experts rule: of a decode token's routed "
                             "experts, how many the GPU runs from host memory beside the cores, or auto (the bound "
                             "printed stays the cores' alone)")
    parser.add_argument("--sampled-topk", action=argparse.BooleanOptionalAction,
                        help="indexer.dsa_triton's sampled_topk in the rules (default: the rule file's)")
    parser.add_argument("--contexts", default="4096,131072")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=16384)
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--prefill-only", action="store_true",
                      help="only the prefill's synchronised split and its projection (no decode runs)")
    only.add_argument("--filled", action="store_true",
                      help="decode only, after a context of random cache rows instead of its prefill (a 1M context "
                           "in seconds): no prefill figures")
    parser.add_argument("--repeats", type=int, default=1,
                        help="loads of each checkpoint at each context, each in a process of its own: the median's "
                             "figures are kept (a load's CPU experts vary in speed)")
    parser.add_argument("--indexshare", action="store_true",
                        help="with --layers a,b: also the b-layer cut with its last layer an IndexShare shared layer "
                             "(DIR/<b>-layers-shared), for the step of the targets' shared MoE layers (GLM-5.2's)")
    parser.add_argument("--peer", default="", help="transformers modes beside ours: all, offload (bench_peer.py)")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.new_tokens < 2 and not args.prefill_only:  # the first comes from the prefill: no decode step to time
        parser.error(f"--new-tokens must be >= 2 (decode is timed from the second new token), got {args.new_tokens}")
    counts = [int(n) for n in args.layers.split(",")]
    rules = load_rules(args.rules)
    if args.gpu_ring:
        rules = with_kwargs(rules, "experts.numba", {"gpu_ring": args.gpu_ring}, "--gpu-ring")
    if args.decode_gpu_experts is not None:
        rules = with_kwargs(rules, "experts.numba", {"decode_gpu_experts": args.decode_gpu_experts},
                            "--decode-gpu-experts")
    if args.sampled_topk is not None:
        rules = with_kwargs(rules, "indexer.dsa_triton", {"sampled_topk": args.sampled_topk}, "--sampled-topk")
    checkpoints = [(n, n, None) for n in counts]  # (key, layers, make_tiny's overrides)
    if args.indexshare:
        if len(counts) != 2:
            parser.error("--indexshare needs two layer counts (--layers a,b)")
        if "shared" not in load_config(args.preset).indexer_types:
            parser.error(f"--indexshare: {args.preset} has no IndexShare shared layers")
        shared = {"indexer_types": ["full"] * (counts[1] - 1) + ["shared"]}
        checkpoints.append(("shared", counts[1], shared))
    folder = Path(args.dir).resolve()
    names = {key: f"{n}-layers" + ("-shared" if overrides else "") for key, n, overrides in checkpoints}
    dirs = {key: folder if len(checkpoints) == 1 else folder / names[key] for key, _, _ in checkpoints}
    if len(checkpoints) == 1:  # the checkpoint is --dir itself: a cut of its own in its parent folder
        write_cuts(folder.parent, args.preset, args.fp8, [(folder.name, counts[0], None)])
    else:
        write_cuts(folder, args.preset, args.fp8, [(names[key], n, overrides) for key, n, overrides in checkpoints])
    runs, loads, moe, configs, fmt, peers = {}, {}, {}, {}, None, []
    for at, (key, n, overrides) in enumerate(checkpoints):
        name, model_dir = names[key], dirs[key]
        config = configs[key] = load_config(model_dir)
        runs[key], loads[key], moe[key] = [], [], len(config.moe_layers)
        for context in map(int, args.contexts.split(",")):
            trials = []
            for _ in range(args.repeats):
                trials.append(in_own_process(bench_context, model_dir, rules, context, args.new_tokens,
                                             args.prefill_chunk, args.prefill_only, args.filled))
                if not (args.prefill_only or args.filled):
                    print(format_table(trials[-1][0]), flush=True)
            result, fmt = median_trial(trials)
            if args.repeats > 1:
                print(f"{name}, context {context}: the median of {args.repeats} loads, "
                      f"{trial_ms(result):.2f} ms{'' if args.prefill_only else '/token'} (of "
                      + ", ".join(f"{trial_ms(t):.2f}" for t, _ in trials) + ")", flush=True)
            runs[key].append(result)
            loads[key].append([t for t, _ in trials])
        for mode in filter(None, args.peer.split(",") if key == counts[0] and not (args.prefill_only or args.filled)
                           else []):
            device = "cuda" if torch.cuda.is_available() else "cpu"
            peer = bench_peer.run(str(model_dir), device, mode == "offload", runs[key][0]["context"], 4)
            ours = runs[key][0]["decode_ms_per_token"] / config.num_hidden_layers
            peer["our_decode_speedup_per_layer"] = peer["decode_ms_per_layer"] / ours
            peers.append(peer)
            print(f"transformers ({peer['mode']}), context {peer['context']}: decode {peer['decode_ms_per_layer']:.2f} "
                  f"ms/layer, ours {ours:.2f}: {peer['our_decode_speedup_per_layer']:.1f}x", flush=True)
        if fmt and at + 1 < len(checkpoints):
            link_experts(model_dir, [dirs[k] for k, _, _ in checkpoints[at + 1 :]], fmt)
        if args.discard:
            if fmt:
                shutil.rmtree(expert_store(cache_dir() / "experts", model_dir, *fmt).folder, ignore_errors=True)
            shutil.rmtree(model_dir)
    results, measured_moe, layers = runs[counts[0]], moe[counts[0]], counts[0]
    pairs = {}  # MoE layer kind -> the two checkpoints it is measured between (the cuts' layers are all "full")
    if len(counts) == 2 and not args.prefill_only:
        pairs["full"] = counts
        if args.indexshare:
            pairs["shared"] = counts[0], "shared"
    marginal = {kind: marginal_layer({0: runs[a], 1: runs[b]}, {0: moe[a], 1: moe[b]})
                for kind, (a, b) in pairs.items()}
    in_parts = {kind: step_parts({0: loads[a], 1: loads[b]}, {0: moe[a], 1: moe[b]})
                for kind, (a, b) in pairs.items()}
    if marginal:
        print("\none more MoE layer, from the checkpoints' difference (decode from CUDA graphs)")
        print("| context | layer | step ms per MoE layer | CPU experts ms | step / experts (goal <= 1.1) | fixed ms | "
              "experts alone ms a layer (each checkpoint's process) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for kind, rows in marginal.items():
            for m in rows:
                experts = "-" if m["moe_layer_experts_ms"] is None else f"{m['moe_layer_experts_ms']:.2f}"
                ratio = "-" if m["step_over_experts"] is None else f"{m['step_over_experts']:.2f}x"
                alone = ", ".join("-" if v is None else f"{v:.2f}" for v in m["experts_alone_ms_per_layer"])
                print(f"| {m['context']} | {kind} | {m['moe_layer_ms']:.2f} | {experts} | {ratio} | "
                      f"{m['fixed_ms']:.2f} | {alone} |")
    if not all(in_parts.values()):  # a load without the graph split (no CPU experts in the step): no parts
        in_parts = {}
    if in_parts:
        print("\none MoE layer's step in parts: its CPU experts (the median over every load of both checkpoints) and "
              "the rest (the checkpoints' difference of the step less its experts)")
        print("| context | layer | loads | CPU experts ms | rest ms | step ms | step / experts (goal <= 1.1) | "
              "fixed ms |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for kind, rows in in_parts.items():
            for p in rows:
                print(f"| {p['context']} | {kind} | {p['loads']} | {p['experts_ms']:.2f} | {p['rest_ms']:.2f} | "
                      f"{p['moe_layer_ms']:.2f} | {p['step_over_experts']:.2f}x | {p['fixed_ms']:.2f} |")
    read_gb_s, rows = [], []
    if not args.prefill_only:  # per context, the median of the reads measured in the loads' processes
        read_gb_s = [statistics.median(r["read_gb_s"] for at_context in loads.values() for r in at_context[i])
                     for i in range(len(results))]
        bus_gb_s = [max((r.get("bus_read_gb_s") or 0.0 for at_context in loads.values() for r in at_context[i]),
                        default=0.0) or None for i in range(len(results))]  # (the fastest: the noise's line)
        first = next(iter(pairs), None)  # the layer kind the fixed part is taken with
        layer, basis = (in_parts, "parts") if in_parts else (marginal, "marginal")
        rows = projection(results, measured_moe, fmt, read_gb_s, layer.get(first), basis, layer.get("shared"),
                          bus_gb_s)
        if in_parts:  # the difference of the median loads beside it
            rows += projection(results, measured_moe, fmt, read_gb_s, marginal[first], "marginal",
                               marginal.get("shared"), bus_gb_s)
        how = (f"fixed part + one MoE layer's step{' in parts' if in_parts else ''} per MoE layer" if first
               else "the whole step per MoE layer")
        bus = any(bus_gb_s)
        print(f"\nprojection: {layers}-layer checkpoint ({measured_moe} MoE), experts {fmt}, host read (the median of "
              f"the loads') {' / '.join(f'{r:.0f}' for r in read_gb_s)} GB/s; {how}"
              + (f"; the GPU's bus (pinned copy) {' / '.join(f'{b or 0:.0f}' for b in bus_gb_s)} GB/s" if bus else ""))
        print("| model | context | measured ms/token | basis | projected ms/token | tok/s | host-BW bound tok/s | "
              "of bound |" + (" bound with the GPU's bus read tok/s | of it |" if bus else ""))
        print("| --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if bus else ""))
        for p in rows:
            bound = "- | -" if p["bound_tok_s"] is None else f"{p['bound_tok_s']:.1f} | {p['of_bound']:.0%}"
            if bus:
                b = p["bus_bound_tok_s"]
                bound += " | - | -" if b is None else f" | {b:.1f} | {p['projected_tok_s'] / b:.0%}"
            print(f"| {p['target']} | {p['context']} | {p['measured_ms_per_token']:.2f} | {p['basis']} | "
                  f"{p['projected_ms_per_token']:.0f} | {p['projected_tok_s']:.2f} | {bound} |")
    prefill_rows = [] if args.filled else prefill_projection(results[-1]["prefill_split_s"], configs[counts[0]])
    if prefill_rows:
        print(f"\nprefill projection from the {results[-1]['context']}-token prefill's split (chunks of "
              f"{args.prefill_chunk})")
        print("| model | context | indexer s | rest of attention and other s | experts s | dense MLPs s | "
              "projected prefill |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for p in prefill_rows:
            parts = p["parts_s"]
            print(f"| {p['target']} | {results[-1]['context']} | {parts['indexer']:.0f} | {parts['rest']:.0f} | "
                  f"{parts['experts']:.0f} | {parts['dense']:.0f} | {p['projected_prefill_s']:.0f} s "
                  f"({p['projected_prefill_s'] / 60:.1f} min) |")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "loads": loads, "peers": peers, "read_gb_s": read_gb_s,
                                               "marginal_layer": marginal, "step_parts": in_parts, "projection": rows,
                                               "prefill_projection": prefill_rows}, indent=1))
    return results


if __name__ == "__main__":
    try:
        sys.exit(0 if main() else 1)
    except Glm5Error as e:  # a bad preset, config or placement, here or in a load's own process: one line
        sys.exit(f"bench_e2e: {e}")
