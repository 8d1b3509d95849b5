"""Soak: hundreds of chat turns of mixed lengths through the engine and through `glm5 serve` with concurrent clients,
bounded in time; every greedy output is then checked against an eager replay (no CUDA graphs) of the same turns in
the same order. Each of the two phases' turns takes a quarter of --seconds, so that with their replays (eager decode
is slower than the graphs') the whole run takes about --seconds after the model has loaded and compiled.

    PYTHONPATH=.:bench python3 bench/soak.py [--model DIR] [--rules glm5] [--seconds 90] [--clients 4] [--json F]

Turns: short prompts, prompts above gpu_tokens (1100-1500 tokens, so their experts stream to the GPU), rewinds (a
prefix of an earlier prompt and new tokens) and extensions (the conversation so far and a new message). Without
--model, a tiny checkpoint of the real architecture with dims the shipped rules' int4 groups divide is written. Exit
status 1 if any turn failed or any replayed output differs.
"""

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from glm5_offload.loader import load_model
from glm5_offload.rules import load_rules, resolve_rules_path
from glm5_offload.runtime.engine import Engine, SamplingParams
from glm5_offload.server import make_server
from glm5_offload.tiny import make_tiny, tiny_config

MAX_SEQ_LEN = 8192
WORDS = "the engine keeps attention on the GPU and the experts on the CPU while the cache grows".split()


def tiny_checkpoint(root: Path) -> Path:
    (root / "config.json").write_text(json.dumps({**tiny_config(), "hidden_size": 256, "moe_intermediate_size": 128,
                                                  "max_position_embeddings": MAX_SEQ_LEN}))
    return make_tiny(root / "ckpt", preset=str(root / "config.json"), layers=4)


class Recorder:
    """Wraps an engine's generate: every call's prompt, token budget and output, in the order they ran."""

    def __init__(self, engine: Engine):
        self.calls = []
        self._generate = engine.generate
        engine.generate = self.generate

    def generate(self, prompt_ids, max_new_tokens, params=SamplingParams(), on_token=None):
        result = self._generate(prompt_ids, max_new_tokens, params, on_token=on_token)
        self.calls.append((list(prompt_ids), max_new_tokens, result.output_ids, result.stop_reason))
        return result


def engine_turns(engine: Engine, rng: random.Random, deadline: float) -> tuple[int, list[str]]:
    """Mixed turns until the deadline; (turns, errors)."""
    vocab, history, prompts, turns, errors = engine.model.config.vocab_size, [], [], 0, []
    while time.monotonic() < deadline:
        kind = rng.choice(["short", "long", "rewind", "extend"])
        if kind == "long" or not prompts:
            prompt = [rng.randrange(12, vocab) for _ in range(rng.randint(1100, 1500))]
        elif kind == "short":
            prompt = [rng.randrange(12, vocab) for _ in range(rng.randint(10, 80))]
        elif kind == "rewind":
            earlier = rng.choice(prompts)
            prompt = earlier[: rng.randint(1, len(earlier))] + [rng.randrange(12, vocab) for _ in range(20)]
        else:
            prompt = history + [rng.randrange(12, vocab) for _ in range(rng.randint(5, 60))]
        if len(prompt) + 32 > MAX_SEQ_LEN:
            history, prompt = [], prompt[-1000:]
        try:
            out = engine.generate(prompt, rng.randint(4, 24)).output_ids
        except Exception as e:  # noqa: BLE001 - a soak counts every failure
            errors.append(f"engine turn {turns} ({kind}, {len(prompt)} tokens): {type(e).__name__}: {e}")
            continue
        prompts.append(prompt)
        history = prompt + out
        turns += 1
    return turns, errors


def client(url: str, rng: random.Random, deadline: float, done: list, errors: list):
    """One client's conversations through the endpoint: plain and streamed turns, some long, until the deadline."""
    messages = []
    while time.monotonic() < deadline:
        words = rng.randint(3, 40) if rng.random() < 0.7 else rng.randint(700, 900)
        messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))})
        stream = rng.random() < 0.5
        body = json.dumps({"model": "soak", "messages": messages, "max_tokens": rng.randint(4, 24), "temperature": 0,
                           "stream": stream, "enable_thinking": rng.random() < 0.5}).encode()
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as r:
                raw = r.read().decode()
        except (urllib.error.URLError, OSError) as e:
            errors.append(f"client turn {len(done)}: {e}")
            messages = []
            continue
        if stream:
            events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
            if events[-1] != "[DONE]":
                errors.append(f"client turn {len(done)}: a stream without [DONE]")
            deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1] if json.loads(e)["choices"]]
            content = "".join(d.get("content") or "" for d in deltas)
        else:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": content})
        done.append(1)
        if len(messages) > 12 or rng.random() < 0.15:
            messages = []


def serve_turns(engine: Engine, tokenizer, clients: int, seed: int, deadline: float) -> tuple[int, list[str]]:
    srv = make_server(engine, tokenizer, "soak", "127.0.0.1", 0, max_new_tokens=24)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1/chat/completions"
    done, errors = [], []
    threads = [threading.Thread(target=client, args=(url, random.Random(seed + i), deadline, done, errors))
               for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    srv.shutdown()
    srv.server_close()
    return len(done), errors


def replay(model, calls: list, prefill_chunk: int) -> list[str]:
    """The same calls, in order, on an eager engine: the outputs that differ."""
    engine = Engine(model, max_seq_len=MAX_SEQ_LEN, prefill_chunk=prefill_chunk, cuda_graphs=False)
    differ = []
    for i, (prompt, max_new, output, stop) in enumerate(calls):
        again = engine.generate(prompt, max_new)
        if again.output_ids != output and stop != "stop":  # a client that left stopped its reply early
            differ.append(f"call {i} ({len(prompt)} prompt tokens): {output} != {again.output_ids}")
    return differ


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="checkpoint directory (default: a tiny one written to a temporary folder)")
    parser.add_argument("--rules", default="glm5")
    parser.add_argument("--gpu-ring", type=int, help="gpu_ring in the rules' experts.numba kwargs (256: a whole layer)")
    parser.add_argument("--seconds", type=float, default=180, help="about the whole run's, turns and replays")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--dtype", default="float32", help="float32 makes graphs and eager comparable bit for bit")
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else tiny_checkpoint(Path(tmp))
        rules_path = resolve_rules_path(args.rules)
        if args.gpu_ring:
            rules_path = Path(tmp) / "rules.yaml"
            rules_path.write_text(resolve_rules_path(args.rules).read_text().replace(
                "gpu_tokens: 1024", f"gpu_tokens: 1024, gpu_ring: {args.gpu_ring}"))
        model = load_model(model_dir, rules=load_rules(rules_path), dtype=getattr(torch, args.dtype),
                           max_seq_len=MAX_SEQ_LEN)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        results, t0 = {}, time.monotonic()
        for phase in ("engine", "serve"):
            engine = Engine(model, max_seq_len=MAX_SEQ_LEN, prefill_chunk=args.prefill_chunk)
            recorder = Recorder(engine)
            deadline = time.monotonic() + args.seconds / 4
            started = time.monotonic()
            if phase == "engine":
                turns, errors = engine_turns(engine, random.Random(args.seed), deadline)
            else:
                turns, errors = serve_turns(engine, tokenizer, args.clients, args.seed, deadline)
            seconds = time.monotonic() - started
            calls = recorder.calls
            differ = replay(model, calls, args.prefill_chunk)
            results[phase] = {"turns": turns, "calls": len(calls), "prompt_tokens": sum(len(c[0]) for c in calls),
                              "new_tokens": sum(len(c[2]) for c in calls), "seconds": seconds,
                              "graphs": engine.graphs is not None, "errors": errors, "replay_differs": differ}
            print(json.dumps({phase: results[phase]})[:2000], flush=True)
    print(f"\nsoak: {model_dir.name if args.model else 'tiny 4-layer checkpoint'}, rules {args.rules}"
          f"{f' (gpu_ring {args.gpu_ring})' if args.gpu_ring else ''}, {args.dtype}, {time.monotonic() - t0:.0f} s")
    print("| phase | turns | prompt tokens | new tokens | seconds | CUDA graphs | errors | replays differing |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for phase, r in results.items():
        print(f"| {phase} | {r['turns']} | {r['prompt_tokens']} | {r['new_tokens']} | {r['seconds']:.0f} | {r['graphs']} | "
              f"{len(r['errors'])} | {len(r['replay_differs'])} of {r['calls']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return all(not r["errors"] and not r["replay_differs"] for r in results.values())


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
