"""`glm5 bench`: a placed model's prefill and decode speed, where a decode step's time goes, peak memory.

Speed comes from plain generation (what a user gets): prefill from a first run, decode from a second over
the same positions (so CUDA graphs, when the engine decodes from them, are captured before the timing).
With CUDA graphs the second run also gives the overlapped step's split, as the host saw it: CPU experts,
waits for the GPU (its work not hidden behind the experts) and the rest (replays, copies, sampling); and a MoE
layer after another's CPU experts against the hand-off before them (the GPU's work between two layers' experts):
that load's own step / experts (how much longer a step is than the experts it waits for).
A third run takes the eager split under a Timeline (after an untimed pass over the same positions), whose
spans synchronise the device at their edges (util.span): attention (indexer and sparse MLA included), the
routed experts, the hidden state's host-GPU transfers around CPU experts, and the rest (dense and shared
MLPs, router, norms, lm_head, sampling, Python).
A last run prefills the context afresh under a Timeline: the same parts for the prefill (the indexer shown
apart, as a part of attention), from which bench_e2e.py projects a whole model's long prefill. That context is then
saved to a temporary file and loaded back into the engine (runtime/saved_context.py): the file's size and the times.
The prefill's split also projects the same context's prefill on the full published models of the measured one's
kind (prefill_projection): a checkpoint cut to a few layers (`glm5 make-tiny --preset`) tells what the whole
model's long prefill costs.
With the routed experts on the CPU, decode is measured against its host-bandwidth bound: the bytes of the experts
one token reads (the planner's figure for the placement) at the host's read bandwidth (kernels/host_read.py), and
the same layers' experts are timed alone in the same process (experts_alone: random routing, each call reading its
experts from memory; on the H200 machine's host the same kernel has run 15-20% apart between processes), and the
calls the first run's decode made are made again alone, with their inputs, right after the timed decode
(experts_replayed): what the step around them adds to the same work.
"""

import resource
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numba
import numpy as np
import torch

from .checkpoint import huge_pages
from .config import load_config
from .kernels.host_read import read_bandwidth_gb_s
from .model import Experts
from .ops.experts_numba import NumbaExperts
from .planner import make_plan
from .runtime.engine import Engine, GenerationResult
from .runtime.saved_context import load_context, save_context
from .util import Timeline

PARTS = ("attention", "experts", "transfers", "dense")  # dense: the dense layers' MLPs
PROJECTED_MODELS = {"glm_moe_dsa": ("glm-5", "glm-5.2"), "deepseek_v32": ("deepseek-v3.2",)}  # presets, by kind
# what a layer's cost depends on: a projection scales a measured layer to a target with all of them equal
LAYER_DIMS = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
              "index_n_heads", "index_head_dim", "index_topk", "moe_intermediate_size", "n_routed_experts",
              "num_experts_per_tok", "intermediate_size")


def parts(timeline: Timeline, seconds: float) -> dict[str, float]:
    """The seconds of each of PARTS in the timeline, and the rest of `seconds` as "other"."""
    split = {name: timeline.seconds.get(name, 0.0) for name in PARTS}
    split["other"] = max(seconds - sum(split.values()), 0.0)
    return split


def random_prompt(engine: Engine, context: int, seed: int = 0) -> list[int]:
    vocab = engine.model.config.vocab_size
    return torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_split(engine: Engine, prompt: list[int]) -> dict[str, float]:
    """The prompt prefilled afresh under a Timeline: seconds of each part, the indexer's apart."""
    engine.reset()
    with Timeline() as timeline:
        fresh = engine.generate(prompt, 1)
    split = parts(timeline, fresh.prefill_seconds)
    split["of which indexer"] = timeline.seconds.get("indexer", 0.0)
    return split


def prefill_projection(split: dict[str, float], config) -> list[dict]:
    """A prefill's split (prefill_split) scaled per layer kind to the full models of config's kind whose layers
    have its dims (PROJECTED_MODELS, LAYER_DIMS): the indexer per full-indexer layer, the rest of attention and
    the unmarked work per layer, the experts and their transfers per MoE layer, the dense MLP per dense layer.
    [] where no such model exists."""
    full = config.indexer_types.count("full")
    dense = config.num_hidden_layers - len(config.moe_layers)
    if config.model_type not in PROJECTED_MODELS or not full or not config.moe_layers or not dense:
        return []
    dims = lambda c: [getattr(c, name) for name in LAYER_DIMS]  # noqa: E731
    indexer_per_full = split["of which indexer"] / full
    rest_per_layer = (split["attention"] - split["of which indexer"] + split["other"]) / config.num_hidden_layers
    experts_per_moe = (split["experts"] + split["transfers"]) / len(config.moe_layers)
    dense_per_layer = split["dense"] / dense
    rows = []
    for name in PROJECTED_MODELS[config.model_type]:
        t = load_config(name)
        if dims(t) != dims(config):
            continue
        parts = {"indexer": t.indexer_types.count("full") * indexer_per_full,
                 "rest": t.num_hidden_layers * rest_per_layer, "experts": len(t.moe_layers) * experts_per_moe,
                 "dense": (t.num_hidden_layers - len(t.moe_layers)) * dense_per_layer}
        rows.append({"target": name, "parts_s": parts, "projected_prefill_s": sum(parts.values())})
    return rows


def run_benchmark(engine: Engine, context: int, new_tokens: int, seed: int = 0) -> dict:
    """context random prompt tokens, then new_tokens greedy ones: the runs of the module's text."""
    model = engine.model
    prompt = random_prompt(engine, context, seed)
    engine.stop_ids = set()
    engine.reset()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with recorded_experts(model) as calls:
        first = engine.generate(prompt, new_tokens)
    # the same positions: decode speed, graphs warm
    again, graph_split, layer_step = generate_split(engine, prompt, new_tokens)
    replayed = experts_replayed(calls)  # (the same calls as again's: greedy over the same cache)
    for _ in range(2):  # the first pass compiles what eager decode needs and the graphs did not (Triton
        # specialises integer arguments, such as a key count that is not a multiple of 16); the second is kept
        with Timeline() as timeline:
            # what the cache holds (the second run's tokens: re-feeding position context-1 alone may change the
            # greedy tokens of a random model), so all but one token are cached and no new shape compiles here
            third = engine.generate(again.prompt_ids + again.output_ids, new_tokens)
    split = parts(timeline, third.prefill_seconds + third.decode_seconds)  # new_tokens forwards, 1 token each
    prefill = prefill_split(engine, prompt)
    saved = saved_context_seconds(engine)
    bound = host_bound(engine, context, again.decode_tokens_per_s, replayed)
    return {
        "model": str(Path(model.config.path).parent), "context": context, "new_tokens": new_tokens,
        "prefill_tokens_per_s": first.prefill_tokens_per_s,
        "decode_tokens_per_s": again.decode_tokens_per_s,
        "decode_ms_per_token": 1e3 / again.decode_tokens_per_s if again.decode_tokens_per_s else None,
        "cuda_graphs": engine.graphs is not None,
        "graph_split_ms_per_token": graph_split,
        "moe_layer_step": layer_step,
        "split_ms_per_token": {k: v / new_tokens * 1e3 for k, v in split.items()},
        "split_prefilled_tokens": third.prefilled_tokens,
        "prefill_split_s": prefill,
        "prefill_projection": prefill_projection(prefill, model.config),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "saved_context": saved,
        "host_bound": bound,
    }


def generate_split(engine: Engine, prompt: list[int], new_tokens: int) -> tuple[GenerationResult, dict | None,
                                                                                 dict | None]:
    """engine.generate, and where it decodes from CUDA graphs its steps' split per token (ms): the CPU experts, the
    host's wait for the GPU before them, and the rest; and its MoE layers after a step's first (moe_layer_step)."""
    graphs = engine.graphs
    if graphs is not None:
        seconds, steps, later = dict(graphs.seconds), graphs.steps, graphs.later_layers
    result = engine.generate(prompt, new_tokens)
    if graphs is None or graphs.steps == steps:
        return result, None, None
    ms = {k: (graphs.seconds[k] - seconds[k]) / (graphs.steps - steps) * 1e3 for k in graphs.seconds}
    split = {"experts": ms["experts"], "gpu wait": ms["wait"], "other": ms["steps"] - ms["experts"] - ms["wait"]}
    return result, split, moe_layer_step(graphs.seconds, seconds, graphs.later_layers - later)


def moe_layer_step(seconds: dict, before: dict, layers: int) -> dict | None:
    """A MoE layer after another (DecodeGraphs.seconds' later figures, since `before`, over `layers` such layers):
    its CPU experts and the hand-off before them (ms a layer: the host's time from the last layer's experts to these,
    the GPU's work in between), and step / experts, one load's own (no other load's experts in it); None where no
    step had two MoE layers with CPU experts."""
    if not layers:
        return None
    experts = (seconds["later experts"] - before["later experts"]) / layers * 1e3
    hand_off = (seconds["hand-offs"] - before["hand-offs"]) / layers * 1e3
    return {"layers": layers, "experts_ms": experts, "hand_off_ms": hand_off,
            "step_over_experts": (experts + hand_off) / experts if experts > 0 else None}


def experts_alone(model, calls: int = 16, seed: int = 0) -> float | None:
    """Milliseconds a decode token's CPU experts take alone: each NumbaExperts layer's kernel on one random token
    routed to top-k random experts, the layers taken in turn `calls` times (so each call reads its experts from
    memory, not from the cache the previous one left), the median call of each layer summed; None without them."""
    layers = [m for m in model.modules() if isinstance(m, NumbaExperts)]
    if not layers:
        return None
    rng = np.random.default_rng(seed)
    top_k, hidden = model.config.num_experts_per_tok, layers[0].w2.shape[1]
    times = [[] for _ in layers]
    for _ in range(calls + 1):  # the first round compiles or warms: left out
        for layer, seconds in zip(layers, times):
            x = rng.standard_normal((1, hidden), np.float32)
            ids = rng.permutation(layer.w13.shape[0])[:top_k][None].astype(np.int64)
            weights = rng.random((1, top_k), np.float32)
            t0 = time.perf_counter()
            layer._compute(x, ids, weights)
            seconds.append(time.perf_counter() - t0)
    return sum(sorted(t[1:])[len(t[1:]) // 2] for t in times) * 1e3


@contextmanager
def recorded_experts(model):
    """Within: every one-token call of the model's NumbaExperts layers (decode's) is appended, with copies of its
    inputs and the seconds it took, to the list this yields as (layer, x, ids, weights, seconds); the calls
    themselves run as always. A call with the inputs of its layer's last one is not: a new bucket's first decode
    step runs its host work twice (the warm-up before its capture, then the replay; decode_graphs.py), as no other
    step does."""
    calls, layers, last = [], [m for m in model.modules() if isinstance(m, NumbaExperts)], {}
    for layer in layers:
        def compute(x, ids, weights, layer=layer, compute=layer._compute):
            before = last.get(id(layer))
            twin = before is not None and all(np.array_equal(a, b) for a, b in zip(before, (x, ids, weights)))
            if x.shape[0] != 1 or twin:
                return compute(x, ids, weights)
            last[id(layer)] = x.copy(), ids.copy(), weights.copy()
            t0 = time.perf_counter()
            out = compute(x, ids, weights)
            calls.append((layer, *last[id(layer)], time.perf_counter() - t0))
            return out
        layer._compute = compute  # (an instance attribute over the method)
    try:
        yield calls
    finally:
        for layer in layers:
            del layer._compute


def replayed_seconds(calls: list) -> list[float]:
    """The seconds each of a decode's calls (recorded_experts) takes when made again, alone, in their order and with
    their inputs."""
    seconds = []
    for layer, x, ids, weights, _ in calls:
        t0 = time.perf_counter()
        layer._compute(x, ids, weights)
        seconds.append(time.perf_counter() - t0)
    return seconds


def experts_replayed(calls: list, seconds: list[float] | None = None) -> float | None:
    """Milliseconds a decode token's CPU experts take when a decode's calls are made again alone (replayed_seconds,
    or `seconds`, what it gave already); None without calls."""
    if not calls:
        return None
    tokens = len(calls) / len({id(layer) for layer, *_ in calls})
    return sum(replayed_seconds(calls) if seconds is None else seconds) / tokens * 1e3


def experts_huge_pages(model) -> tuple[int, int] | None:
    """(bytes mapped, bytes in transparent huge pages) of the memory holding the model's CPU experts
    (checkpoint.huge_pages)."""
    return huge_pages([getattr(m, name) for m in model.modules() if isinstance(m, NumbaExperts)
                       for name in ("w13", "s13", "w2", "s2")])


def bus_read_gb_s(device: torch.device, n_bytes: int = 1 << 26, copies: int = 10) -> float:
    """The GPU's read of page-locked host memory over its bus: GB/s of the median of `copies` copies of n_bytes into
    device by the copy engine, timed with CUDA events (64 MiB by default, ~1 ms a copy: glm5 bench takes it beside a
    loaded model, on a GPU its plan may have filled)."""
    src = torch.empty(n_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    ms = []
    for i in range(copies + 1):  # the first warms the path: left out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        if i:
            ms.append(start.elapsed_time(end))
    return n_bytes / float(np.median(ms)) / 1e6


def host_bound(engine: Engine, context: int, decode_tok_s: float, replayed_ms: float | None = None) -> dict | None:
    """The routed experts' bytes per decode token, the host's read bandwidth, the tok/s they bound decode at and the
    measured decode's fraction of it, numba's threads and threading layer (workqueue: half OpenMP's speed), the
    experts timed alone (experts_alone; replayed_ms: experts_replayed's), how many of a token's experts the GPU
    reads instead (decode_gpu_experts, where its layers' experts are page-locked) with its bus's read and the bound
    of both reads together (no faster can the bytes come), and
    the bytes of the memory holding the CPU experts in huge pages (a 4 KiB page a TLB entry slows their read:
    checkpoint.read_into_memory asks for 2 MiB ones); None where the experts are not all on the CPU."""
    model = engine.model
    plan = make_plan(model.config, model.placement, context, {}, dtype=model.dtype)
    on_cpu = [s.device == "cpu" for s in model.placement.slots.values() if s.op.replaces is Experts]
    if not on_cpu or not all(on_cpu) or not plan.active_expert_bytes:
        return None
    read = read_bandwidth_gb_s(1 << 30, repeats=3)
    bound = read * 1e9 / plan.active_expert_bytes
    alone_ms = experts_alone(model)
    pages = experts_huge_pages(model)
    gpu = gpu_experts(model)
    bus = bus_read_gb_s(model.device) if gpu else None
    both = bus and (read + bus) * 1e9 / plan.active_expert_bytes  # the bound with the bus's read beside the cores'
    return {"expert_bytes_per_token": plan.active_expert_bytes, "host_read_gb_s": read, "bound_tok_s": bound,
            "experts_threads": numba.get_num_threads(), "threading_layer": numba.threading_layer(),
            "of_bound": decode_tok_s / bound, "experts_mapped_bytes": pages and pages[0],
            "experts_huge_page_bytes": pages and pages[1], "experts_alone_ms_per_token": alone_ms,
            "experts_alone_of_read": alone_ms and plan.active_expert_bytes / (alone_ms / 1e3) / (read * 1e9),
            "experts_replayed_ms_per_token": replayed_ms,
            "experts_per_token": model.config.num_experts_per_tok, "gpu_experts": gpu, "bus_read_gb_s": bus,
            "bus_bound_tok_s": both, "of_bus_bound": both and decode_tok_s / both}


def gpu_experts(model) -> int:
    """How many of a decode token's experts the GPU reads from host memory over its bus (decode_gpu_experts, where
    its layers' experts are page-locked; auto's count once linked); 0: the cores read them all."""
    return max((m.decode_gpu_experts for m in model.modules() if isinstance(m, NumbaExperts)
                and m.gpu_matrices is not None), default=0)


def saved_context_seconds(engine: Engine) -> dict:
    """The engine's context saved to a temporary file and loaded back in place: tokens, bytes, seconds."""
    with tempfile.TemporaryDirectory(prefix="glm5-bench-") as folder:
        path = Path(folder) / "context.safetensors"
        t0 = time.perf_counter()
        tokens = save_context(engine, path)
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        load_context(engine, path)
        return {"tokens": tokens, "bytes": path.stat().st_size, "save_s": save_s,
                "load_s": time.perf_counter() - t0}


def moe_layer_line(layer: dict) -> str:
    ratio = layer["step_over_experts"]
    return (f"  a MoE layer after another: its CPU experts {layer['experts_ms']:.3f} ms, the hand-off before them (the "
            f"GPU's work since the last layer's) {layer['hand_off_ms']:.3f} ms: step / experts "
            + ("-" if ratio is None else f"{ratio:.2f}x"))


def format_table(r: dict) -> str:
    split = r["split_ms_per_token"]
    total = sum(split.values()) or 1.0
    gib = lambda n: "-" if n is None else f"{n / 2**30:.2f} GiB"  # noqa: E731
    mode = "CUDA graphs" if r["cuda_graphs"] else "eager"
    lines = [
        f"glm5 bench: {r['model']}, context {r['context']}, {r['new_tokens']} new tokens",
        f"  prefill  {r['prefill_tokens_per_s']:10.1f} tok/s",
        f"  decode   {r['decode_tokens_per_s']:10.1f} tok/s ({r['decode_ms_per_token'] or 0:.2f} ms/token, {mode})",
    ]
    if r["graph_split_ms_per_token"]:
        lines.append("  decode step from CUDA graphs, per token (host time; the GPU works during the experts):")
        lines += [f"    {name:<10} {ms:9.3f} ms" for name, ms in r["graph_split_ms_per_token"].items()]
    if r["moe_layer_step"]:
        lines.append(moe_layer_line(r["moe_layer_step"]))
    lines.append("  decode step, eager, per token (a synchronised run: parts do not overlap here):")
    lines += [f"    {name:<10} {ms:9.3f} ms  {ms / total:6.1%}" for name, ms in split.items()]
    lines.append("  prefill of the whole context, synchronised run, seconds:")
    lines += [f"    {name:<16} {s:9.3f} s" for name, s in r["prefill_split_s"].items()]
    if r["prefill_projection"]:
        lines.append(f"  the same {r['context']}-token prefill projected to the full models (indexer per full layer, "
                     "the rest per layer, experts per MoE layer, the dense MLP per dense layer):")
        lines += [f"    {p['target']:<16} {p['projected_prefill_s']:9.1f} s = {p['projected_prefill_s'] / 60:.1f} min "
                  f"(indexer {p['parts_s']['indexer']:.1f} s, rest {p['parts_s']['rest']:.1f} s, experts "
                  f"{p['parts_s']['experts']:.1f} s, dense MLPs {p['parts_s']['dense']:.1f} s)"
                  for p in r["prefill_projection"]]
    bound = r["host_bound"]
    if bound:
        lines.append(f"  host-bandwidth bound: {bound['expert_bytes_per_token'] / 1e6:.1f} MB of routed experts a token "
                     f"at {bound['host_read_gb_s']:.1f} GB/s read = {bound['bound_tok_s']:.1f} tok/s; decode is "
                     f"{bound['of_bound']:.1%} of it; the experts on {bound['experts_threads']} threads (numba's "
                     f"{bound['threading_layer']} layer)")
        if bound.get("gpu_experts"):
            both = bound.get("bus_bound_tok_s")
            lines.append(f"  of each token's {bound['experts_per_token']} experts the GPU read {bound['gpu_experts']} "
                         "over its bus (decode_gpu_experts): the bound above is the cores' read alone"
                         + (f"; with the bus's {bound['bus_read_gb_s']:.1f} GB/s (a pinned copy) beside it {both:.1f} "
                            f"tok/s, decode {bound['of_bus_bound']:.1%} of it" if both else ""))
        if bound["experts_alone_ms_per_token"]:
            step = (r["graph_split_ms_per_token"] or r["split_ms_per_token"])["experts"]
            replayed = bound["experts_replayed_ms_per_token"]
            lines.append(f"  the CPU experts alone (random routing, this process): "
                         f"{bound['experts_alone_ms_per_token']:.3f} ms a token, {bound['experts_alone_of_read']:.0%} "
                         f"of the read; the decode's own calls again alone "
                         + ("-" if replayed is None else f"{replayed:.3f} ms") + f"; in the decode step {step:.3f} ms")
        if bound["experts_mapped_bytes"]:
            lines.append(f"  the CPU experts' memory: {gib(bound['experts_mapped_bytes'])} mapped, "
                         f"{bound['experts_huge_page_bytes'] / bound['experts_mapped_bytes']:.0%} in huge pages")
    saved = r["saved_context"]
    lines.append(f"  context of {saved['tokens']} tokens saved ({saved['bytes'] / 1e6:.1f} MB) in "
                 f"{saved['save_s']:.2f} s, loaded in {saved['load_s']:.2f} s")
    lines.append(f"  peak memory: GPU {gib(r['peak_gpu_bytes'])}, host {gib(r['peak_host_bytes'])}")
    return "\n".join(lines)
