"""Every shipped rule file, and the README's recommended kwargs, over what users run (`gpu` marker): a prompt above
gpu_tokens, decode from CUDA graphs, a second turn that rewinds the cache to a shorter prefix, a third that extends
it; greedy outputs equal to the eager engine's (--eager)."""

import json
from pathlib import Path

import pytest
import torch

from glm5_offload.kernels import linear_triton
from glm5_offload.loader import load_model
from glm5_offload.ops import expert_ring, experts_numba
from glm5_offload.rules import load_rules, resolve_rules_path
from glm5_offload.runtime.engine import Engine
from glm5_offload.tiny import make_tiny, tiny_config

pytestmark = pytest.mark.gpu

NEW_TOKENS = 12


@pytest.fixture(autouse=True)
def fixed_split(monkeypatch):
    """A split chunk's share follows speeds timed on the chunks before, so two runs can put different experts on the
    CPU, whose sums round differently (int8 steps of SwiGLU's outputs from sums in another order), enough to flip the
    tiny model's near-tied tokens (call 2 of session 23). Here every run plans from the same untimed speeds: the two
    engines prefill alike, and what differs is decode, from graphs or not."""
    monkeypatch.setattr(experts_numba, "_speeds", {})
    monkeypatch.setattr(experts_numba.SplitSpeeds, "cpu_done", lambda self, seconds, pairs: None)
    monkeypatch.setattr(experts_numba.SplitSpeeds, "_update_gpu", lambda self, seconds, experts: None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny architecture with dims the shipped rules' int4 groups of 128 divide, 4 layers (1 dense, 3 MoE, one
    sharing its indexer), 4096 positions."""
    root = tmp_path_factory.mktemp("sequences")
    (root / "config.json").write_text(json.dumps({**tiny_config(), "hidden_size": 256, "moe_intermediate_size": 128}))
    return make_tiny(root / "ckpt", preset=str(root / "config.json"), layers=4)


@pytest.fixture(scope="module")
def flash_checkpoint(tmp_path_factory):
    """The tiny GLM-5.3-Flash architecture with dims the shipped rules' int4 groups of 128 divide: 8 layers (KDA,
    a DSA layer every 4th), 4096 positions."""
    root = tmp_path_factory.mktemp("sequences-flash")
    config = tiny_config("glm5_next")
    config["text_config"].update(hidden_size=256, moe_intermediate_size=128)
    (root / "config.json").write_text(json.dumps(config))
    return make_tiny(root / "ckpt", preset=str(root / "config.json"), layers=8)


def test_flash_rules_over_three_turns_equal_eager(flash_checkpoint):
    """rules/glm5-flash.yaml: KDA layers (fla-core) cannot rewind, so the second turn restarts and the third
    extends it; CUDA-graph decode gives eager decode's tokens."""
    model = load_model(flash_checkpoint, rules=load_rules("glm5-flash"), dtype=torch.float32, max_seq_len=4096)
    results = {}
    for graphs in (True, False):
        engine = Engine(model, max_seq_len=4096, prefill_chunk=2048, cuda_graphs=graphs)
        engine.stop_ids = set()
        results[graphs] = turns(engine)
        assert (engine.graphs is not None) == graphs
    assert results[True] == results[False]
    assert [len(out) for out in results[True]] == [NEW_TOKENS] * 3


def variant(tmp_path, name: str, old: str, new: str) -> Path:
    """rules/glm5.yaml with `old` (which it must hold) replaced by `new`, as tmp_path/glm5-{name}.yaml."""
    text = resolve_rules_path("glm5").read_text()
    assert old in text, old
    path = tmp_path / f"glm5-{name}.yaml"
    path.write_text(text.replace(old, new))
    return path


VARIANTS = {  # the README's and the rule files' advice, each on rules/glm5.yaml
    "ring256": ("gpu_tokens: 64", "gpu_tokens: 64, gpu_ring: 256"),  # 80 GB+ GPUs: a whole layer in the ring
    "slabs": ("window: 512}", "window: 512, prefill_rows: 256}"),  # a staging buffer smaller than the prompt
    "int4": ("{format: fp8}", "{format: int4}"),  # projections and lm_head in int4 ("halves them again")
    "staged": ("gpu_tokens: 64", "gpu_tokens: 64, pin_experts: false"),  # the stream through pinned buffers
    "split": ("decode_gpu_experts: auto", "decode_gpu_experts: 1"),  # what auto keeps where the GPU's share pays
}


def rule_files(tmp_path) -> list[Path]:
    shipped = [resolve_rules_path(name) for name in ("glm5", "glm5-reference", "glm5-gpu", "glm5-cpu")]
    return shipped + [variant(tmp_path, name, *change) for name, change in VARIANTS.items()]


def model_layer(model, experts) -> str:
    """The name of the experts module `experts` in model."""
    return next(n for n, m in model.named_modules() if m is experts)


def turns(engine: Engine) -> list[list[int]]:
    """Three turns: 1100 prompt tokens (a chunk above split_tokens 1024: every expert on the GPU), a rewind to 500
    of them and 100 new (between gpu_tokens 64 and split_tokens: split between the GPU and the CPU cores), then that
    turn's prompt and reply and 20 more (on the CPU)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(12, 1024, (1100,), generator=g).tolist()
    outputs = [engine.generate(prompt, NEW_TOKENS).output_ids]
    second = prompt[:500] + torch.randint(12, 1024, (100,), generator=g).tolist()
    outputs.append(engine.generate(second, NEW_TOKENS).output_ids)
    third = second + outputs[-1] + torch.randint(12, 1024, (20,), generator=g).tolist()
    outputs.append(engine.generate(third, NEW_TOKENS).output_ids)
    return outputs


@pytest.mark.parametrize("index", range(4 + len(VARIANTS)),
                         ids=["glm5", "glm5-reference", "glm5-gpu", "glm5-cpu"] + [f"glm5-{n}" for n in VARIANTS])
def test_shipped_rules_over_three_turns_equal_eager(checkpoint, tmp_path, index):
    rules = load_rules(rule_files(tmp_path)[index])
    model = load_model(checkpoint, rules=rules, dtype=torch.float32, max_seq_len=4096)
    results = {}
    for graphs in (True, False):
        engine = Engine(model, max_seq_len=4096, prefill_chunk=2048, cuda_graphs=graphs)
        engine.stop_ids = set()
        results[graphs] = turns(engine)
        assert (engine.graphs is not None) == (graphs and engine.use_graphs)
        ours = {id(m) for m in model.modules()}  # (rings are per device and shape: other tests' rings too)
        staged = [(key[0], n, model_layer(model, layer), e) for key, ring in expert_ring._rings.items()
                  for n, layer, e, _, _ in ring.queue if id(layer) in ours]
        assert staged == [], staged  # nothing staged that nobody uses
    assert results[True] == results[False]
    assert [len(out) for out in results[True]] == [NEW_TOKENS] * 3
    if index == 0 or index >= 4:
        assert Engine(model, max_seq_len=4096).use_graphs  # the fast placement decodes from graphs


def wide_checkpoint(root: Path, arch: str, layers: int) -> Path:
    """A tiny checkpoint of arch whose projections have dims cuBLAS's blockwise FP8 GEMM takes (hidden 512)."""
    config = tiny_config(arch)
    (config["text_config"] if arch == "glm5_next" else config).update(hidden_size=512, moe_intermediate_size=128)
    (root / "config.json").write_text(json.dumps(config))
    return make_tiny(root / "ckpt", preset=str(root / "config.json"), layers=layers)


@pytest.mark.parametrize("arch, projections", [("glm_moe_dsa", "fp8"), ("glm_moe_dsa", "int4"),
                                               ("deepseek_v32", "fp8"), ("glm5_next", "fp8")])
def test_bf16_prompts_of_any_length_through_the_default_rules(tmp_path, monkeypatch, arch, projections):
    """What a user runs by default: bf16 compute under the family's default rules (glm5.yaml, and its int4
    projections; glm5-flash.yaml), GLM-5, DeepSeek-V3.2 and GLM-5.3-Flash, on dims (hidden 512) whose FP8
    projections cuBLAS's blockwise GEMM takes on an sm90 GPU, with a prompt of 1102 tokens and a second turn of 37
    more (it refused token counts not a multiple of 4 until 84feadf; the float32 tests above never take that path;
    a model with KDA layers prefills all but the prompt's last token: 1101). Graph decode gives eager decode's
    tokens."""
    ckpt = wide_checkpoint(tmp_path, arch, layers=4 if arch == "glm5_next" else 2)  # Flash: KDA layers and a DSA one
    rules = load_rules(variant(tmp_path, "int4", *VARIANTS["int4"]) if projections == "int4"
                       else "glm5-flash" if arch == "glm5_next" else "glm5")
    model = load_model(ckpt, rules=rules, dtype=torch.bfloat16, max_seq_len=2048)
    blockwise, real = [], linear_triton.fp8_blockwise_linear
    monkeypatch.setattr(linear_triton, "fp8_blockwise_linear", lambda x, *w: blockwise.append(len(x)) or real(x, *w))
    g = torch.Generator().manual_seed(1)
    prompt, extra = (torch.randint(12, 1024, (n,), generator=g).tolist() for n in (1102, 37))
    results = {}
    for graphs in (True, False):
        engine = Engine(model, max_seq_len=2048, prefill_chunk=2048, cuda_graphs=graphs)
        engine.stop_ids = set()
        first = engine.generate(prompt, NEW_TOKENS).output_ids
        results[graphs] = [first, engine.generate(prompt + first + extra, NEW_TOKENS).output_ids]
    assert results[True] == results[False] and [len(r) for r in results[True]] == [NEW_TOKENS] * 2
    if projections == "fp8" and linear_triton.has_blockwise_fp8_mm(torch.device("cuda")):
        assert (1101 if arch == "glm5_next" else 1102) in blockwise, blockwise
