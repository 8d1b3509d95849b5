"""Shared fixtures: tiny checkpoints written by transformers itself, and by `glm5 make-tiny`."""

import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # transformers' Glm5Next calls fla-core's kernels where fla-core is installed (it is our dependency), which
    # need a GPU: on the CPU it is told fla-core is absent, so its own plain-torch KDA is the one compared against
    sys.modules.setdefault("fla", None)


def _lighter_interpreter():
    """Triton's interpreter spends ~40% of a tiny model's forward on two checks that cannot matter here: every int32
    add and multiply is redone in int64 to look for overflow (the tiny models' offsets are far from 2^31, and the
    real sizes' overflows never reach the interpreter), and every call of a @triton.jit helper inside a kernel patches
    triton.language anew (inspect.getmembers over the package), though the kernel's launch patched it already.
    Off: the first; the second done only where a helper's module sees a part of the language not yet patched."""
    import dataclasses

    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    patch = interpreter._patch_lang

    def patch_unless_patched(fn):
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        return patch(fn) if any(tl.core.is_builtin(lang.load) for lang in langs) else interpreter._LangPatchScope()

    interpreter._patch_lang = patch_unless_patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _lighter_interpreter()

if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers share the cores: torch's threads divided among them (more
    # threads than cores wait on one another in every parallel region)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

# Small dims of the real architectures. index_topk (8) is below the test prompts' lengths, so the
# indexer really selects; 16 indexer heads keep exact-zero score ties (all ReLUs zero) improbable.
COMMON = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32,
    q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=32, index_topk=8, index_head_dim=32,
    index_n_heads=16, first_k_dense_replace=1, max_position_embeddings=512, initializer_range=0.1,
    routed_scaling_factor=2.5, eos_token_id=[2, 3], pad_token_id=0,
)


# GLM-5.3-Flash (glm5_next) at small dims: KDA layers and NoPE DSA layers, hyper-connections of 4 streams.
NEXT = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
    num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48,
    qk_rope_head_dim=0, qk_nope_head_dim=32, qk_head_dim=32, v_head_dim=32, index_topk=8, index_head_dim=32,
    index_n_heads=16, linear_num_heads=4, linear_head_dim=16, max_position_embeddings=512, initializer_range=0.1,
    routed_scaling_factor=2.5, swiglu_limit=0.5, eos_token_id=[2, 3], pad_token_id=0,
)
NEXT_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                   projection_intermediate_size=64)
# 4 layers: 3 KDA, 1 DSA; 8 layers: a full DSA layer with an IndexShare layer above it, and one more
NEXT_LAYERS = {4: (["linear_attention"] * 3 + ["deepseek_sparse_attention"], ["full"] * 4),
               8: (["linear_attention", "linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
                    "linear_attention", "linear_attention", "linear_attention", "deepseek_sparse_attention"],
                   ["full", "full", "full", "shared", "full", "full", "full", "full"])}


def build_hf_next(layers: int = 4, kpool: int = 2, seed: int = 0):
    """A randomly initialised transformers Glm5NextForConditionalGeneration (fp32), its text model at NEXT dims."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    layer_types, indexer_types = NEXT_LAYERS[layers]
    text = dict(NEXT, num_hidden_layers=layers, layer_types=layer_types, indexer_types=indexer_types,
                mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), index_kpool=kpool)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=NEXT_VISION))
    _randomize_norms_and_bias(model)
    with torch.no_grad():  # transformers initialises these to constants: make them matter
        for name, p in model.named_parameters():
            if name.endswith(("index_kpool_compress_ape", "hc.base", "forget_gate.A_log")):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("index_kpool_compress_gate"):
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
            elif name.endswith("hc.scale"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model.eval()


def _randomize_norms_and_bias(model):
    """Non-trivial RMSNorm / LayerNorm weights, LayerNorm biases and router correction biases."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("k_norm.bias"):
                p.copy_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))


def build_hf_model(arch: str, seed: int = 0, **overrides):
    """A randomly initialised transformers model of arch at COMMON dims (fp32)."""
    torch.manual_seed(seed)
    if arch == "glm_moe_dsa":
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

        config = GlmMoeDsaConfig(**{**COMMON, "index_topk_pattern": "FSSSF", **overrides},
                                 rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
        model = GlmMoeDsaForCausalLM(config)
    else:
        from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

        config = DeepseekV32Config(**{**COMMON, **overrides}, n_group=4, topk_group=2, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
        model = DeepseekV32ForCausalLM(config)
    _randomize_norms_and_bias(model)
    return model.eval()


@pytest.fixture(scope="session")
def hf_next(tmp_path_factory):
    """layers, kpool -> (directory written by save_pretrained, the transformers Glm5NextForConditionalGeneration)."""
    made = {}

    def make(layers: int = 4, kpool: int = 2):
        if (layers, kpool) not in made:
            model = build_hf_next(layers, kpool)
            path = tmp_path_factory.mktemp(f"hf-next-{layers}-{kpool}")
            model.save_pretrained(path, max_shard_size="200KB")
            made[layers, kpool] = path, model
        return made[layers, kpool]

    return make


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """arch, dtype -> (directory written by save_pretrained, the transformers model)."""
    made = {}

    def make(arch: str, dtype: torch.dtype = torch.float32):
        if (arch, dtype) not in made:
            model = build_hf_model(arch).to(dtype)
            path = tmp_path_factory.mktemp(f"hf-{arch}-{str(dtype).split('.')[-1]}")
            model.save_pretrained(path, max_shard_size="200KB")
            made[arch, dtype] = path, model
        return made[arch, dtype]

    return make


@pytest.fixture(scope="session")
def trained_checkpoint():
    """(directory, data): a tiny glm_moe_dsa (every input dim a multiple of 32) that transformers trained for 250
    steps on the four sequences `data` [4, 80] until its greedy continuation of each follows it, saved in bf16
    (tests/data/trained-glm-moe-dsa, written by tests/make_trained_checkpoint.py). A random model's logits are nearly
    tied, so any rounding flips its greedy tokens; a trained one's say what a format costs."""
    path = Path(__file__).parent / "data" / "trained-glm-moe-dsa"
    return path, torch.tensor(json.loads((path / "data.json").read_text()))


def bf16_continuation(path, prompt: list[int], n: int = 64) -> list[int]:
    """The greedy continuation of prompt by the checkpoint at path in bf16 under the reference operators."""
    from glm5_offload.loader import load_model
    from glm5_offload.rules import load_rules
    from glm5_offload.runtime.engine import Engine

    engine = Engine(load_model(path, dtype=torch.bfloat16, rules=load_rules("glm5-cpu")))
    engine.stop_ids = set()
    return engine.generate(prompt, n).output_ids


def greedy_agreement(model, prompt: list[int], tokens: list[int]) -> float:
    """Teacher-forced over `tokens` (a greedy continuation of prompt by another model): how often model's own
    greedy next token is the same."""
    from glm5_offload.runtime.kv_cache import new_cache

    logits = model(torch.tensor(prompt + tokens), new_cache(model, len(prompt) + len(tokens)))
    picked = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    return sum(a == b for a, b in zip(picked, tokens)) / len(tokens)


def greedy_steps(model, cache, logits: torch.Tensor, n: int = 2):
    """n greedy decode steps (a token a pass: the decode paths) after a prompt whose last logits are `logits`: each
    step's logits are finite and the cache grows by one."""
    token, length = logits.argmax(), cache.length
    for step in range(n):
        last = model(token[None], cache, logits_for="last")[0]
        assert torch.isfinite(last).all() and cache.length == length + step + 1
        token = last.argmax()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """arch, fp8 -> a `glm5 make-tiny` checkpoint directory."""
    from glm5_offload.tiny import make_tiny

    made = {}

    def make(arch: str = "glm_moe_dsa", fp8: bool = False):
        if (arch, fp8) not in made:
            made[arch, fp8] = make_tiny(tmp_path_factory.mktemp(f"tiny-{arch}-{fp8}") / "ckpt", arch=arch, fp8=fp8)
        return made[arch, fp8]

    return make


def refused_rule(tmp_path, cls: str, replace: str, message: str):
    """A one-rule file (match the class, replace with `replace`, YAML flow-mapping text) is refused on
    loading with one line naming the file and matching `message`."""
    from glm5_offload.errors import Glm5Error
    from glm5_offload.rules import load_rules

    path = tmp_path / "bad.yaml"
    path.write_text(f"- match: {{class: {cls}}}\n  replace: {{{replace}}}\n")
    with pytest.raises(Glm5Error, match=message) as e:
        load_rules(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def assert_bf16_of(got: torch.Tensor, want: torch.Tensor):
    """got, a Triton kernel's bf16 output, is want (fp32) rounded to bf16: to nearest on a GPU, as torch does;
    Triton 3.6's interpreter rounds toward zero, so there within one bf16 step."""
    got, want = got.cpu(), want.cpu()
    assert got.dtype == torch.bfloat16
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert ((got.float() - want).abs() <= want.abs() * 2**-7).all()
    else:
        assert torch.equal(got, want.bfloat16())


def cli_env(env: dict | None = None) -> dict:
    """The environment of a `glm5` child process: as a machine without a GPU runs it, the GPU operators through
    their references, not Triton's interpreter (the kernels are tested in this process; the interpreter would make
    each command 4x slower). env: variables set on top."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TRITON_INTERPRET": "0", **(env or {})}


def glm5(*args, env=None, check=True, timeout=600):
    """Run `glm5 args...` in a child process; check: assert it exited 0 (its stderr as the message)."""
    proc = subprocess.run([sys.executable, "-m", "glm5_offload.cli", *map(str, args)], capture_output=True, text=True,
                          env=cli_env(env), timeout=timeout)
    assert not check or proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture
def glm5_here(monkeypatch, capsys):
    """`glm5 args...` in this process, as glm5 runs it in a child, for commands that run no model (refusals, plan,
    rules, make-tiny): a child's imports cost 2.4 s on a 2-core machine. A command that gets as far as chatting or
    serving fails the test (instead of waiting for input or a connection)."""
    import glm5_offload.chat
    import glm5_offload.cli
    import glm5_offload.server

    monkeypatch.setattr(signal, "signal", lambda *a: None)  # (main's SIGTERM handler: not in a test worker)
    monkeypatch.setattr(glm5_offload.cli, "show_engine_log", lambda: None)  # (its handler would keep capsys' stream)
    for module, name in ((glm5_offload.chat, "run_chat"), (glm5_offload.server, "serve")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("the command was not refused"))

    def run(*args, check=True):
        capsys.readouterr()
        try:
            code = glm5_offload.cli.main([str(a) for a in args])
        except SystemExit as e:  # argparse's usage error, as a child exits on it
            code = e.code
        except Exception:  # as a child ends on one: its traceback on stderr, exit 1 (the tests look for neither)
            traceback.print_exc()
            code = 1
        out, err = capsys.readouterr()
        assert not check or code == 0, err
        return subprocess.CompletedProcess(args, code, out, err)
    return run


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
