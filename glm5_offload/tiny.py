"""`glm5 make-tiny`: a small checkpoint of the real architecture, as a release lays it out; with a preset,
a checkpoint of the real model's dims cut to a few layers (GLM-5-shaped, for benchmarks).

Seeded random weights in sharded safetensors with an index, a config.json with an IndexShare pattern
and an index_topk below typical prompt lengths (so sparsity matters), a byte-level BPE tokenizer.json
with the GLM special tokens, and a GLM-style chat template. With fp8, the projection weights are
stored as float8_e4m3fn with 128x128-block weight_scale_inv, as GLM-5-FP8 is.
"""

import json
import os
import re
import shutil
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .checkpoint import stored_name
from .config import load_config, parse_config
from .formats import fp8_blocks
from .errors import Glm5Error
from .model import build_model, keeps_fp32
from .util import cache_dir, human_bytes

ARCHS = ("glm_moe_dsa", "deepseek_v32", "glm5_next")
SPECIAL_TOKENS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>", "<think>", "</think>"]
EOS_TOKENS = ["<|endoftext|>", "<|user|>", "<|observation|>"]
VOCAB_SIZE = 1024
_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|system|>\n{{ m.content }}"
    "{%- elif m.role == 'user' -%}<|user|>\n{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|>\n<think>{{ m.reasoning_content or '' }}</think>\n{{ m.content }}"
    "{%- elif m.role in ('tool', 'observation') -%}<|observation|>\n{{ m.content }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{ '<think></think>\\n' }}{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)

# Text the tokenizer's merges are learnt from: prose, chat and code, so the merges look like a real BPE.
CORPUS = """\
GLM-5 is a mixture-of-experts language model with sparse attention. Each token picks eight of two
hundred and fifty six experts, and the lightning indexer picks the two thousand and forty eight
earlier tokens that attention reads. The engine keeps attention on the GPU and the experts on the CPU.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Let me think about this step by step. First, we read the question. Then we plan an answer.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
def main(argv):
    for i in range(10):
        print(f"token {i}: {argv[i]}")
    return 0
import torch
x = torch.randn(4, 8)
y = x @ x.T + 1.0
The cache holds one latent row per token per layer: five hundred and seventy six values.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1024 2048 65536. Symbols: ( ) [ ] { } < > = + - * / % & | ^ ~ ! ? : ; , .
Questions, answers, summaries, translations, poems, stories, recipes, plans, proofs and programs.
"""


def tiny_next_config() -> dict:
    """GLM-5.3-Flash's multimodal config.json at small dims (its vision tower's too, though only the text model's
    tensors are written): KDA layers and NoPE DSA layers (every 4th) with the pooled indexer, hyper-connections."""
    n = 8
    text = {
        "model_type": "glm5_next_text", "vocab_size": VOCAB_SIZE, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_hidden_layers": n, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 0, "qk_head_dim": 32,
        "v_head_dim": 32, "index_n_heads": 8, "index_head_dim": 32, "index_topk": 16, "index_kpool": 4,
        "index_kpool_always_select_tail": True, "n_routed_experts": 16, "n_shared_experts": 1,
        "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "linear_num_heads": 4, "linear_head_dim": 32, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0, "pad_token_id": 0,
        "layer_types": ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
        "indexer_types": ["full"] * n, "mlp_layer_types": ["dense"] + ["sparse"] * (n - 1),
        "tie_word_embeddings": False,
    }
    vision = {"model_type": "glm5_next_vision", "depth": 1, "hidden_size": 32, "intermediate_size": 64,
              "num_heads": 2, "out_hidden_size": 64, "projection_intermediate_size": 64}
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "dtype": "bfloat16",
            "text_config": text, "vision_config": vision, "tie_word_embeddings": False,
            "eos_token_id": [SPECIAL_TOKENS.index(t) for t in EOS_TOKENS]}


def tiny_config(arch: str = "glm_moe_dsa") -> dict:
    """A config.json dict of the real architecture at small dims."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if arch == "glm5_next":
        return tiny_next_config()
    config = {
        "architectures": ["GlmMoeDsaForCausalLM" if arch == "glm_moe_dsa" else "DeepseekV32ForCausalLM"],
        "model_type": arch,
        "dtype": "bfloat16",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "index_n_heads": 8,
        "index_head_dim": 32,
        "index_topk": 16,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "eos_token_id": [SPECIAL_TOKENS.index(t) for t in EOS_TOKENS],
        "pad_token_id": 0,
    }
    if arch == "glm_moe_dsa":
        config.update({
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
            "rope_interleave": True,
            "indexer_rope_interleave": True,
            "index_topk_freq": 2,  # IndexShare as GLM-5.2 has it: layers F F S F S
            "index_skip_topk_offset": 2,
        })
    else:
        config.update({
            "rms_norm_eps": 1e-6,
            "n_group": 4,
            "topk_group": 2,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
                                "mscale": 1.0, "mscale_all_dim": 1.0},
        })
    return config


def is_fp8_projection(name: str) -> bool:
    """The weights an FP8 release stores as float8 blocks: every projection except router and indexer weights."""
    if any(k in name for k in ("embed_tokens", "lm_head", "mlp.gate.weight", "weights_proj")):
        return False
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight", ".wq_b.weight", ".wk.weight"))


def random_tensor(name: str, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """A seeded fp32 weight: norms near 1, projections ~ 1/sqrt(fan_in)."""
    noise = torch.randn(shape, generator=gen)
    if name.endswith("norm.weight"):
        return 1 + 0.1 * noise
    if name.endswith(("k_norm.bias", "e_score_correction_bias")):
        return 0.1 * noise
    if name.endswith("embed_tokens.weight"):
        return noise
    return noise * shape[-1] ** -0.5


def stored(name: str, w: torch.Tensor, fp8: bool) -> dict[str, torch.Tensor]:
    """A weight as a release stores it: FP8 blocks + scale_inv for projections (fp8), fp32 router bias and
    indexer head weights, bf16 for the rest."""
    if fp8 and is_fp8_projection(name):
        w8, scale = fp8_blocks.quantize(w)
        return {name: w8, name + "_scale_inv": scale}
    if keeps_fp32(name):
        return {name: w}
    return {name: w.to(torch.bfloat16)}


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor name belongs to, or None (embedding, final norm, head)."""
    layer = _LAYER.search(name)
    return int(layer.group(1)) if layer else None


def layer_groups(names: list[str]) -> list[list[str]]:
    """Names in order, one group per decoder layer (what precedes layer 1 joins layer 0, what follows the last
    layer joins it): one shard per layer, so a checkpoint of real dims is written a layer at a time."""
    groups, current = [], None
    for name in names:
        layer = layer_of(name)
        if layer is not None and layer != current and current is not None:
            groups.append([])
        if layer is not None:
            current = layer
        if not groups:
            groups.append([])
        groups[-1].append(name)
    return groups


def shaped_config(preset: str, layers: int, overrides: dict | None = None) -> dict:
    """A published config (a preset name or config.json path) with its real dims, cut to `layers` layers (the
    first dense, the rest MoE) and the tiny tokenizer's vocabulary; then `overrides` (config.json keys; GLM-5.3-Flash:
    its text_config's). GLM-5.3-Flash keeps its per-layer lists' first `layers` entries: KDA layers first, a DSA
    layer from the 4th."""
    path = Path(load_config(preset).path)
    config = json.loads(path.read_text())
    total = config.get("text_config", config)["num_hidden_layers"]
    if not 1 <= layers <= total:
        raise Glm5Error(f"--layers must be from 1 to {preset}'s {total} layers, got {layers}")
    eos = [SPECIAL_TOKENS.index(t) for t in EOS_TOKENS]
    config.pop("quantization_config", None)  # FP8 is the fp8 flag's to say
    if "text_config" in config:
        text = config["text_config"]
        text.update(num_hidden_layers=layers, vocab_size=VOCAB_SIZE, pad_token_id=0)
        for key in ("layer_types", "indexer_types"):
            text[key] = text[key][:layers]
        text["mlp_layer_types"] = ["dense"] + ["sparse"] * (layers - 1)
        text.update(overrides or {})
        config["eos_token_id"] = eos
        return config
    config.update(num_hidden_layers=layers, first_k_dense_replace=1, vocab_size=VOCAB_SIZE, eos_token_id=eos,
                  pad_token_id=0)
    for key in ("mlp_layer_types", "indexer_types", "index_topk_pattern"):
        config.pop(key, None)  # per-layer lists no longer fit
    config.update(overrides or {})
    return config


def train_tokenizer():
    """A byte-level BPE tokenizer (tokenizers library) with the GLM special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer)
    return tok


def save_tokenizer(out_dir: Path):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(), eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(out_dir))


def stored_bytes(name: str, shape: tuple, fp8: bool) -> int:
    """What `stored` writes for a weight of this shape, in bytes (FP8 blocks with their scales, fp32 or bf16)."""
    if fp8 and is_fp8_projection(name):
        return fp8_blocks.nbytes(shape)
    return torch.Size(shape).numel() * (4 if keeps_fp32(name) else 2)


CHECKPOINT_SUFFIXES = {".safetensors", ".json", ".jinja", ".txt", ".model", ".md"}  # weights, configs, tokenizers


def check_out_dir(out_dir: Path, overwrite: bool, needed: int) -> None:
    """A folder make_tiny may write: new or empty (or, with overwrite, a folder to replace), on a disk with room for
    `needed` bytes. Never a file, never someone's folder replaced unasked, never a folder of anything but a
    checkpoint's files replaced at all."""
    if out_dir.exists() and not out_dir.is_dir():
        raise Glm5Error(f"{out_dir}: exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise Glm5Error(f"{out_dir}: the folder is not empty; make-tiny writes a new one (--overwrite replaces it)")
        if out_dir.is_symlink():
            raise Glm5Error(f"{out_dir}: is a link; --overwrite replaces a folder, not what a link points to")
        other = next((p for p in sorted(out_dir.iterdir()) if not p.is_file() or p.suffix not in CHECKPOINT_SUFFIXES),
                     None)
        if other is not None:  # `--overwrite` on ~ or a project folder must not delete it
            raise Glm5Error(f"{out_dir}: holds {other.name}, which is not a checkpoint's file; --overwrite replaces "
                            "only a folder of checkpoint files")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Glm5Error(f"{out_dir}: cannot create its folder ({e.strerror})") from None
    free = shutil.disk_usage(out_dir.parent).free
    if needed > free:
        raise Glm5Error(f"{out_dir}: the checkpoint needs {human_bytes(needed)}, its disk has {human_bytes(free)} free")


def make_tiny(out_dir: str | Path, arch: str = "glm_moe_dsa", fp8: bool = False, seed: int = 0,
              preset: str | None = None, layers: int = 4, overrides: dict | None = None,
              overwrite: bool = False) -> Path:
    """Write a random checkpoint into out_dir (built in a temporary folder, then moved): the tiny config of
    `arch`, or with `preset` a published config's real dims cut to `layers` layers (`overrides`: config.json
    keys set after the cut, e.g. which layers are dense or share an indexer). One shard per layer,
    generated and written a layer at a time (a GLM-5 MoE layer is 19 GB in bf16, 9.7 GB in FP8). The tiny
    checkpoints draw every tensor from one seeded stream, in order; a preset's tensors each from a stream
    seeded by the seed and the tensor's name, on every core (one stream would take minutes per layer). An existing
    out_dir that is not empty is refused unless overwrite, as is a disk without room for the checkpoint."""
    out_dir = Path(out_dir)
    config = tiny_config(arch) if preset is None else shaped_config(preset, layers, overrides)
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(fp8_blocks.BLOCK)}
    parsed = parse_config(config, "tiny config")
    shapes = {stored_name(parsed, n): tuple(t.shape) for n, t in build_model(parsed).state_dict().items()}
    groups = layer_groups(list(shapes))
    check_out_dir(out_dir, overwrite, sum(stored_bytes(n, shape, fp8) for n, shape in shapes.items()))
    gen = torch.Generator().manual_seed(seed)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir.parent))
    except OSError as e:
        raise Glm5Error(f"{out_dir}: cannot write in {out_dir.parent} ({e.strerror})") from None
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        weight_map, total = {}, 0
        for i, names in enumerate(tqdm(groups, desc="writing layers", unit="layer", disable=None if preset else True)):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            if preset is None:
                weights = [stored(name, random_tensor(name, shapes[name], gen), fp8) for name in names]
            else:
                with ThreadPoolExecutor(os.cpu_count()) as pool:
                    weights = list(pool.map(lambda name: stored(name, random_tensor(
                        name, shapes[name], torch.Generator().manual_seed(seed << 32 | zlib.crc32(name.encode()))), fp8),
                        names))
            tensors = {k: v for weight in weights for k, v in weight.items()}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        save_tokenizer(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


def default_model_dir() -> Path:
    """Where the embedded default tiny checkpoint lives: the user's cache directory."""
    return cache_dir() / "tiny-glm5"


def ensure_default_model() -> Path:
    path = default_model_dir()
    if not (path / "config.json").is_file():
        make_tiny(path, overwrite=True)  # the cache's own folder: whatever is there without a config is a leftover
    return path
