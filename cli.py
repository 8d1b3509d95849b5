"""The `glm5` command (installed as glm5_offload.cli)."""

import argparse
import errno
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from glm5_offload.errors import Glm5Error

DEFAULT_BANNER = (
    "glm5: no --model given: using the embedded tiny GLM-5-architecture checkpoint at {path}. "
    "Its weights are random, so its text is noise; pass --model DIR for a real model."
)


def _model_dir(arg: str | None) -> tuple[Path, bool]:
    """The --model directory, or the embedded default (created on first use); True if it is the default."""
    if arg is not None:
        path = Path(arg)
        if not path.is_dir():
            raise Glm5Error(f"{path}: no such model directory")
        return path, False
    from glm5_offload.tiny import ensure_default_model

    path = ensure_default_model()
    print(DEFAULT_BANNER.format(path=path), file=sys.stderr)
    return path, True


def _tokenizer(model_dir: Path, required: bool):
    """The model directory's own tokenizer through transformers, or None when absent and not required."""
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        if required:
            raise Glm5Error(f"{model_dir}: no tokenizer.json or tokenizer_config.json (give --prompt-ids instead)")
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise Glm5Error(f"{model_dir}: cannot load its tokenizer ({e})") from None


def _prompt_ids(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        return []  # refused as an empty prompt
    if "" in parts:  # `1,,2` lost an id somewhere: not read as 1,2
        raise Glm5Error(f"--prompt-ids: {text!r} has an empty entry (entry {parts.index('') + 1})")
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise Glm5Error(f"--prompt-ids: {text!r} is not a comma-separated list of integers") from None


def cmd_make_tiny(args):
    from glm5_offload.tiny import make_tiny

    if args.layers is not None and not args.preset:
        raise Glm5Error("--layers needs --preset (each tiny --arch has its own layers)")
    layers = 4 if args.layers is None else args.layers
    path = make_tiny(args.dir, arch=args.arch, fp8=args.fp8, seed=args.seed, preset=args.preset, layers=layers,
                     overwrite=args.overwrite)
    what = f"{args.preset}-shaped, {layers} layers" if args.preset else f"tiny {args.arch}"
    print(f"wrote a {what}{' FP8' if args.fp8 else ''} checkpoint (seed {args.seed}) to {path}")


def _rules(args, run: bool, model_type: str):
    """(rule file, device) from --rules and --device: without --rules, the model family's default placement
    (rules/glm5.yaml, or glm5-flash.yaml for GLM-5.3-Flash; said on stderr, with why); to run it (run), on the CPU
    where this machine has no GPU and no --device says otherwise."""
    import torch

    from glm5_offload.rules import DEFAULT_RULES, load_rules

    if args.rules:
        return load_rules(args.rules), args.device
    device = args.device or (None if torch.cuda.is_available() or not run else "cpu")
    where = (" on the CPU: this machine has no GPU, so the GPU operators run their references (--device cpu)"
             if device == "cpu" and args.device is None else "")
    default = DEFAULT_RULES[model_type]
    print(f"glm5: no --rules given: the default placement {default} for {model_type} (routed experts int4 on the CPU, "
          f"the rest on the GPU in FP8, the tiered FP8 cache){where}", file=sys.stderr)
    return load_rules(default), device


def _engine(args, tokenizer_required: bool, chat: bool = False, max_seq_len_from: str = "--max-seq-len",
            check_prompt=None):
    """The model (placed by --rules, checked by the planner), its engine and tokenizer, from the shared flags. Every
    flag is checked before a model is read (or the default one written), the config before the tokenizer or any
    weight is read; chat: the tokenizer must have a chat template (chat, serve). max_seq_len_from: what set
    args.max_seq_len, named where the model refuses it. check_prompt(config, tokenizer, max_seq_len): generate's
    prompt checked before any weight is read (a big model's load takes minutes)."""
    import torch

    from glm5_offload.chat import apply_template
    from glm5_offload.config import load_config
    from glm5_offload.loader import load_model
    from glm5_offload.runtime.engine import Engine, SamplingParams
    from glm5_offload.util import parse_size

    for flag, value in (("--cpu-threads", args.cpu_threads), ("--max-seq-len", args.max_seq_len),
                        ("--prefill-chunk", args.prefill_chunk), ("--max-new-tokens", args.max_new_tokens)):
        if value is not None and value < 1:
            raise Glm5Error(f"{flag} must be >= 1, got {value}")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    params.check()
    budgets = {"cuda": parse_size(args.gpu_mem, "--gpu-mem") if args.gpu_mem else None,
               "cpu": parse_size(args.host_mem, "--host-mem") if args.host_mem else None}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if args.cpu_threads is not None and args.cpu_threads > cores:  # torch would start that many threads on fewer
        raise Glm5Error(f"--cpu-threads {args.cpu_threads} is more than the {cores} cores this process may use")
    model_dir, is_default = _model_dir(args.model)  # (the default one is written on first use)
    config = load_config(model_dir)
    rules, device = _rules(args, run=True, model_type=config.model_type)
    if args.cpu_threads is not None:
        import numba

        torch.set_num_threads(args.cpu_threads)
        numba.set_num_threads(min(args.cpu_threads, numba.config.NUMBA_NUM_THREADS))
    max_seq_len = args.max_seq_len or config.max_position_embeddings
    config.check_positions(max_seq_len, max_seq_len_from)  # before the tokenizer (load_model checks it too)
    tokenizer = _tokenizer(model_dir, required=tokenizer_required)
    if chat and tokenizer.chat_template is None:
        raise Glm5Error(f"{model_dir}: its tokenizer has no chat template (chat_template in tokenizer_config.json, or "
                        "chat_template.jinja), which chat and serve need; generate --prompt takes raw text")
    if chat:  # a template that cannot render a first turn, said before the weights load
        try:
            apply_template(tokenizer, [{"role": "user", "content": "Hello"}], add_generation_prompt=True)
        except Glm5Error as e:
            raise Glm5Error(f"{model_dir}: {e}") from None
    if check_prompt is not None:
        check_prompt(config, tokenizer, max_seq_len)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = load_model(model_dir, device=device, dtype=dtype, rules=rules, max_seq_len=max_seq_len,
                       budgets=budgets, kv_dtype=args.kv_dtype)
    engine = Engine(model, max_seq_len=max_seq_len, prefill_chunk=args.prefill_chunk, cuda_graphs=not args.eager)
    if args.ignore_eos:
        engine.stop_ids = set()
    return engine, tokenizer, params, model_dir, is_default


def _check_context_files(save: str | None, load: str | None):
    """Before anything loads: --save-context must name a file in a writable folder, --load-context a file."""
    from glm5_offload.util import check_writable

    if save is not None:
        path = Path(save)
        if path.is_dir():
            raise Glm5Error(f"--save-context {save}: a folder, not a file")
        if not path.parent.is_dir():
            raise Glm5Error(f"--save-context {save}: the folder {path.parent} does not exist")
        check_writable(path.parent, f"--save-context {save}: cannot write in {path.parent}")
    if load is not None and not Path(load).is_file():
        raise Glm5Error(f"--load-context {load}: not a file (missing, or a folder)")


MAX_PROMPT_BYTES = 64 << 20


def _prompt_text(args) -> str | None:
    """--prompt's text, or --prompt-file's (- for standard input; a long document does not fit a command line, whose
    arguments Linux caps at 128 KiB each), checked as UTF-8 before any weight is read; None with --prompt-ids."""
    if args.prompt is not None:
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise Glm5Error("--prompt is not valid UTF-8") from None
        return args.prompt
    if args.prompt_file is None:
        return None
    try:
        if args.prompt_file == "-":
            data = sys.stdin.buffer.read(MAX_PROMPT_BYTES + 1)
        else:
            with open(args.prompt_file, "rb") as f:
                data = f.read(MAX_PROMPT_BYTES + 1)
    except OSError as e:
        raise Glm5Error(f"--prompt-file {args.prompt_file}: cannot read it ({e.strerror})") from None
    if len(data) > MAX_PROMPT_BYTES:  # (/dev/zero, a disk image: read whole, they would take all memory)
        raise Glm5Error(f"--prompt-file {args.prompt_file}: more than {MAX_PROMPT_BYTES >> 20} MiB, beyond any "
                        "model's context (a million tokens of text are about 4 MiB)")
    try:
        return data.decode("utf-8-sig")  # a byte-order mark, as some editors write, is not text
    except UnicodeDecodeError as e:
        raise Glm5Error(f"--prompt-file {args.prompt_file}: not UTF-8 text (byte {e.start})") from None


def cmd_generate(args):
    from glm5_offload.runtime.engine import check_prompt

    text = _prompt_text(args)
    _check_context_files(args.save_context, args.load_context)
    prompt_ids = None if text is not None else _prompt_ids(args.prompt_ids)

    def tokens(config, tokenizer, max_seq_len):  # the prompt's ids and their checks, before the weights
        nonlocal prompt_ids
        if prompt_ids is None:
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        check_prompt(prompt_ids, args.max_new_tokens, config.vocab_size, max_seq_len)

    engine, tokenizer, params, model_dir, is_default = _engine(args, tokenizer_required=text is not None,
                                                               check_prompt=tokens)
    if args.load_context:
        from glm5_offload.runtime.saved_context import load_context

        t0 = time.perf_counter()
        n = load_context(engine, args.load_context)
        print(f"glm5: resumed {n} tokens from {args.load_context} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    stream = None
    if tokenizer is not None and not args.json:
        from glm5_offload.chat import ReplyStream

        stream = ReplyStream(tokenizer, engine.stop_ids, False, lambda piece, _: print(piece, end="", flush=True))
    result = engine.generate(prompt_ids, args.max_new_tokens, params, on_token=stream)
    if stream is not None:
        stream.flush()
        print()
    if args.save_context:
        from glm5_offload.runtime.saved_context import save_context

        t0 = time.perf_counter()
        n = save_context(engine, args.save_context)
        print(f"glm5: saved {n} tokens to {args.save_context} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    text = None
    if tokenizer is not None:
        ids = result.output_ids[:-1] if result.stop_reason == "eos" else result.output_ids
        text = tokenizer.decode(ids)
    if args.json:
        print(json.dumps({
            "model": str(model_dir),
            "random_weights": is_default,
            "prompt_ids": result.prompt_ids,
            "output_ids": result.output_ids,
            "text": text,
            "stop_reason": result.stop_reason,
            "cached_tokens": result.reused_tokens,
            "prefill_tokens_per_s": round(result.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(result.decode_tokens_per_s, 2),
        }))
        return
    if stream is None:
        print(",".join(map(str, result.output_ids)))
    print(f"glm5: {len(result.prompt_ids)} prompt tokens at {result.prefill_tokens_per_s:.1f} tok/s, "
          f"{len(result.output_ids)} new tokens at {result.decode_tokens_per_s:.1f} tok/s, stop: {result.stop_reason}",
          file=sys.stderr)


def cmd_bench(args):
    from glm5_offload.benchmark import format_table, run_benchmark

    if args.context < 1:
        raise Glm5Error(f"--context must be >= 1, got {args.context}")
    if args.new_tokens < 2:  # the first new token comes from the prefill's logits: decode is timed from the second
        raise Glm5Error(f"--new-tokens must be >= 2 (the first new token comes from the prefill; decode is timed "
                        f"from the second), got {args.new_tokens}")
    source = "--max-seq-len"
    if args.max_seq_len is None:
        args.max_seq_len = args.context + 2 * args.new_tokens  # the split's run extends the first one
        source = f"--context {args.context} + 2 x --new-tokens {args.new_tokens} ="
    engine, _, _, _, _ = _engine(args, tokenizer_required=False, max_seq_len_from=source)
    result = run_benchmark(engine, args.context, args.new_tokens, seed=args.seed or 0)
    print(format_table(result))
    if args.json:
        print(json.dumps(result))


def cmd_chat(args):
    from glm5_offload.chat import Conversation, run_chat

    engine, tokenizer, params, model_dir, is_default = _engine(args, tokenizer_required=True, chat=True)
    conversation = Conversation(engine, tokenizer, params, max_new_tokens=args.max_new_tokens, system=args.system,
                                thinking=not args.no_think, reasoning_effort=args.reasoning_effort)
    banner = (f"glm5 chat: {model_dir}" + (" (the embedded tiny model: random weights, its replies are noise)"
                                            if is_default else "")
              + f" · max context {engine.max_seq_len} · thinking {'off' if args.no_think else args.reasoning_effort}")
    run_chat(conversation, banner, show_thinking=not args.hide_think)


def cmd_serve(args):
    from glm5_offload.server import serve

    if not 0 <= args.port <= 65535:
        raise Glm5Error(f"--port must be 0-65535, got {args.port}")
    engine, tokenizer, params, model_dir, is_default = _engine(args, tokenizer_required=True, chat=True)
    serve(engine, tokenizer, model_dir.name, args.host, args.port, max_new_tokens=args.max_new_tokens,
          defaults=params, random_weights=is_default, context_dir=args.context_dir)


def _placement(args, config):
    import torch

    from glm5_offload.model import build_model
    from glm5_offload.rules import place

    rules, device = _rules(args, run=False, model_type=config.model_type)
    dtype = getattr(torch, args.dtype) if args.dtype else getattr(torch, config.dtype)
    return place(build_model(config), rules, device), dtype


def cmd_rules_show(args):
    from glm5_offload.config import load_config

    config = load_config(args.model)
    placement, dtype = _placement(args, config)
    source = placement.rules.path if placement.rules else f"no rule file (all on {placement.default_device})"
    print(f"placement of {config.path} ({config.model_type}, {config.num_hidden_layers} layers) by {source}\n")
    print(placement.table(dtype))


def cmd_rules_operators(args):
    from glm5_offload.ops import REGISTRY

    name = max(len(op.name) for op in REGISTRY.values())
    module = max(len(op.replaces.__name__) for op in REGISTRY.values())
    for op in REGISTRY.values():
        kwargs = f"; kwargs: {', '.join(op.kwargs)}" if op.kwargs else ""
        print(f"{op.name:<{name}}  replaces {op.replaces.__name__:<{module}}  on {'/'.join(op.devices):<9} "
              f"{op.summary}{kwargs}")


def cmd_plan(args):
    from glm5_offload.config import load_config
    from glm5_offload.planner import detected_budgets, make_plan
    from glm5_offload.util import parse_size

    # the flags checked before the model's module tree is built (seconds for a full-size model)
    budgets = detected_budgets()
    if args.gpu_mem:
        budgets["cuda"] = parse_size(args.gpu_mem, "--gpu-mem")
    if args.host_mem:
        budgets["cpu"] = parse_size(args.host_mem, "--host-mem")
    if args.max_seq_len <= 0:
        raise Glm5Error(f"--max-seq-len must be > 0, got {args.max_seq_len}")
    config = load_config(args.model)
    config.check_positions(args.max_seq_len, "--max-seq-len")
    placement, dtype = _placement(args, config)
    plan = make_plan(config, placement, args.max_seq_len, budgets, kv_dtype=args.kv_dtype,
                     expert_format=args.expert_format, dtype=dtype)
    print(plan.table())
    if args.json:
        print(json.dumps({
            "fits": plan.fits, "largest_context": plan.largest_context, "max_seq_len": plan.max_seq_len,
            "active_expert_bytes_per_token": plan.active_expert_bytes,
            "devices": {d.device: {"weights": d.weights, "latent_kv": d.latent_kv, "indexer_keys": d.indexer_keys,
                                   "activations": d.activations, "workspace": d.workspace, "total": d.total,
                                   "budget": d.budget} for d in plan.devices}}))
    return 0 if plan.fits else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm5", description="GLM-5 / DeepSeek-V3.2 on one workstation")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write a small random checkpoint of the real architecture")
    p.add_argument("dir")
    p.add_argument("--arch", choices=["glm_moe_dsa", "deepseek_v32", "glm5_next"], default="glm_moe_dsa")
    p.add_argument("--fp8", action="store_true", help="store projections as FP8 e4m3 with 128x128 block scales")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", help="real dims of this config (glm-5, glm-5.2, deepseek-v3.2, or a config.json), "
                                    "cut to --layers layers, with the tiny vocabulary")
    p.add_argument("--layers", type=int, default=None, help="with --preset: decoder layers (the first dense; default 4)")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it holds only checkpoint files")
    p.set_defaults(func=cmd_make_tiny)

    def engine_args(p, temperature: float, top_p: float, max_new_tokens: int):
        p.add_argument("--model", help="checkpoint directory (default: the embedded tiny model, random weights)")
        p.add_argument("--rules", help="rule file placing the modules: a path or a shipped name (glm5, glm5-reference, "
                            "glm5-cpu, glm5-gpu; default glm5)")
        p.add_argument("--device", default=None,
                       help="run what the rules put on a GPU here: cpu, cuda or cuda:N (cpu: the whole placement on "
                            "the CPU, through the operators' references where needed; default: the rule file's, or "
                            "cpu without a GPU and without --rules)")
        p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                       help="compute dtype (default: the checkpoint's)")
        p.add_argument("--max-seq-len", type=int, default=None, help="context limit (default: the model's)")
        p.add_argument("--gpu-mem", help="memory the engine may use on each GPU, e.g. 24GiB (default: all)")
        p.add_argument("--host-mem", help="host memory the engine may use, e.g. 256GiB (default: what is available)")
        p.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per forward pass (default 2048)")
        p.add_argument("--kv-dtype", choices=["fp8"], default=None,
                       help="keep every layer's latent rows in the 656-byte FP8 form (default: the attention rules')")
        p.add_argument("--cpu-threads", type=int, default=None, help="CPU threads for torch and the numba experts")
        p.add_argument("--eager", action="store_true",
                       help="decode without CUDA graphs (by default a placement with CPU experts decodes from them)")
        p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
        p.add_argument("--temperature", type=float, default=temperature, help="0 is greedy")
        p.add_argument("--top-p", type=float, default=top_p)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-turn tokens")

    p = sub.add_parser("generate", help="complete a prompt")
    engine_args(p, temperature=0.0, top_p=1.0, max_new_tokens=32)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text, tokenized by the model's own tokenizer")
    prompt.add_argument("--prompt-file", metavar="FILE", help="prompt text from a UTF-8 file (- reads standard input): "
                        "a long document, beyond what a command line takes")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    p.add_argument("--save-context", metavar="FILE",
                   help="after the run, write the context (its tokens and every layer's cached rows) to FILE")
    p.add_argument("--load-context", metavar="FILE",
                   help="resume a context saved by --save-context: the prompt's longest common prefix with it is not "
                        "prefilled again (the JSON's cached_tokens)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="prefill and decode speed, a decode step's time split, peak memory")
    engine_args(p, temperature=0.0, top_p=1.0, max_new_tokens=32)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens (random ids) before decoding")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens decoded for the speed, and again for the split")
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("chat", help="chat in the terminal, the model's own chat template, streamed replies")
    engine_args(p, temperature=1.0, top_p=0.95, max_new_tokens=2048)
    p.add_argument("--system", help="system prompt")
    p.add_argument("--reasoning-effort", choices=["max", "high"], default="max")
    p.add_argument("--no-think", action="store_true", help="turn thinking off")
    p.add_argument("--hide-think", action="store_true", help="do not show the thinking text (shown dimmed otherwise)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible endpoint: /v1/chat/completions, /v1/models, /health")
    engine_args(p, temperature=1.0, top_p=0.95, max_new_tokens=2048)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--context-dir", metavar="DIR",
                   help="keep the context on disk here across restarts (written after a request that prefilled "
                        "1024 tokens or more, and at exit; resumed at start)")
    p.set_defaults(func=cmd_serve)

    def placement_args(p):
        p.add_argument("--model", required=True, help="model directory, config.json, or preset (glm-5, glm-5.2, ...)")
        p.add_argument("--rules", help="rule file: a path or a shipped name (default glm5)")
        p.add_argument("--device", default=None, help="run what the rules put on a GPU here: cpu, cuda or cuda:N")
        p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)

    rules = sub.add_parser("rules", help="inspect rule files").add_subparsers(dest="rules_command", required=True)
    p = rules.add_parser("show", help="the placement a rule file gives a model: operator, device, format, bytes")
    placement_args(p)
    p.set_defaults(func=cmd_rules_show)
    p = rules.add_parser("operators",
                         help="the operators a rule can name: what each replaces, where it runs, its kwargs")
    p.set_defaults(func=cmd_rules_operators)

    p = sub.add_parser("plan", help="bytes per device for a placement and a context; does it fit?")
    placement_args(p)
    p.add_argument("--max-seq-len", type=int, required=True)
    p.add_argument("--gpu-mem", help="memory of each GPU, e.g. 24GiB (default: detected)")
    p.add_argument("--host-mem", help="host memory, e.g. 512GiB (default: detected available)")
    p.add_argument("--kv-dtype", choices=["fp8", "bf16", "fp32"], default=None,
                   help="count every latent row in this form (default: each attention rule's, else --dtype)")
    p.add_argument("--expert-format", choices=["int4", "int8", "bf16"], default=None)
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    p.set_defaults(func=cmd_plan)
    return parser


def _terminated(signum, frame):
    # the first SIGTERM ends the command; a second (`timeout` forwards the one it got, a repeated kill) is ignored so
    # that it cannot cut the cleanups short (serve saving its context) with a traceback
    signal.signal(signum, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def show_engine_log():
    """The engine's own messages from INFO up on stderr (e.g. decode_gpu_experts: auto's choice); other libraries'
    from WARNING (torch logs cache statistics at INFO as a process exits, which a Ctrl-C during its import would print
    after "interrupted")."""
    logging.basicConfig(level=logging.WARNING, format="glm5: %(message)s", stream=sys.stderr)
    logging.getLogger("glm5_offload").setLevel(logging.INFO)


def main(argv=None) -> int:
    show_engine_log()
    args = build_parser().parse_args(argv)
    # SIGTERM (kill, systemd, docker stop) ends the command as an exit does: its cleanups run (serve keeps its
    # context, make-tiny removes its unfinished folder), where the default action would end the process at once
    signal.signal(signal.SIGTERM, _terminated)
    try:
        if getattr(args, "device", None) is not None:  # every command's --device, before anything is read
            from glm5_offload.rules import check_device

            check_device("--device", args.device)
        return args.func(args) or 0
    except Glm5Error as e:
        plan = getattr(e, "plan", None)
        if plan is not None:
            print(plan.table(), file=sys.stderr)
        print(f"glm5: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nglm5: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader has gone (`glm5 generate ... | head`): stop quietly, as Unix tools do
        _drop_stdout()
        return 128 + signal.SIGPIPE
    except OSError as e:  # a full disk under the output (`> file`) or anything else written
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
            raise
        _drop_stdout()
        print(f"glm5: error: cannot write {e.filename or 'the output'}: {e.strerror}", file=sys.stderr)
        return 2


def _drop_stdout():
    """stdout to /dev/null: the interpreter's flush at exit then finds no broken pipe or full disk to report."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
