"""`glm5 bench`: a placed model's prefill and decode speed, where a decode step's time goes, peak memory.

Speed comes from plain generation (what a user gets). The split comes from as many further steps run
under a Timeline, whose spans synchronise the device at their edges (timeline.py): attention (indexer
and sparse MLA included), the routed experts, the hidden state's host-GPU transfers around CPU experts,
and the rest (dense and shared MLPs, router, norms, lm_head, sampling, Python) as "other".
"""

import resource
from pathlib import Path

import torch

from .engine import Engine
from .timeline import Timeline

PARTS = ("attention", "experts", "transfers")


def run_benchmark(engine: Engine, context: int, new_tokens: int, seed: int = 0) -> dict:
    """context random prompt tokens, then new_tokens greedy ones, twice (speed, then the split)."""
    model = engine.model
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(seed))
    engine.stop_ids = set()
    engine.reset()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first = engine.generate(prompt.tolist(), new_tokens)
    with Timeline() as timeline:
        second = engine.generate(first.prompt_ids + first.output_ids, new_tokens)  # all but one token cached
    step_s = (second.prefill_seconds + second.decode_seconds) / new_tokens  # new_tokens forwards, 1 token each
    split = {name: timeline.seconds.get(name, 0.0) / new_tokens for name in PARTS}
    split["other"] = max(step_s - sum(split.values()), 0.0)
    return {
        "model": str(Path(model.config.path).parent), "context": context, "new_tokens": new_tokens,
        "prefill_tokens_per_s": first.prefill_tokens_per_s,
        "decode_tokens_per_s": first.decode_tokens_per_s,
        "decode_ms_per_token": 1e3 / first.decode_tokens_per_s if first.decode_tokens_per_s else None,
        "split_ms_per_token": {k: v * 1e3 for k, v in split.items()},
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
    }


def format_table(r: dict) -> str:
    split = r["split_ms_per_token"]
    total = sum(split.values()) or 1.0
    gib = lambda n: "-" if n is None else f"{n / 2**30:.2f} GiB"  # noqa: E731
    lines = [
        f"glm5 bench: {r['model']}, context {r['context']}, {r['new_tokens']} new tokens",
        f"  prefill  {r['prefill_tokens_per_s']:10.1f} tok/s",
        f"  decode   {r['decode_tokens_per_s']:10.1f} tok/s ({r['decode_ms_per_token'] or 0:.2f} ms/token)",
        "  decode step, per token (a synchronised run: parts do not overlap here):",
    ]
    lines += [f"    {name:<10} {ms:9.3f} ms  {ms / total:6.1%}" for name, ms in split.items()]
    lines.append(f"  peak memory: GPU {gib(r['peak_gpu_bytes'])}, host {gib(r['peak_host_bytes'])}")
    return "\n".join(lines)
