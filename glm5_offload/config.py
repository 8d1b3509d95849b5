"""Read a published config.json (glm_moe_dsa, deepseek_v32 or glm5_next) into one checked, derived ModelConfig.

Every shape the engine needs comes from here; every other module trusts it. A missing or ill-typed
field is a Glm5Error naming the file and the field.
"""

import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from .errors import Glm5Error

MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32", "glm5_next")
MAX_LAYERS, MAX_EXPERTS = 1024, 4096  # module counts taken (GLM-5: 78 layers, GLM-5.3-Flash: 288 experts a layer)
TEXT_PREFIX = {"glm5_next": "model.language_model."}  # the multimodal release's text model; "model." elsewhere
DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    path: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    num_nextn_predict_layers: int  # MTP layers stored after the last decoder layer (unused for plain decoding)
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    rope_interleave: bool
    indexer_rope_interleave: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    indexer_types: tuple[str, ...]  # per layer: "full" | "shared"
    mlp_layer_types: tuple[str, ...]  # per layer: "dense" | "moe"
    dtype: str  # checkpoint dtype name: bfloat16 | float16 | float32
    fp8_block_size: tuple[int, int] | None  # (128, 128) for FP8 releases, None otherwise
    # GLM-5.3-Flash (glm5_next); the defaults are the other families'
    attention_types: tuple[str, ...] = ()  # per layer: "dsa" (MLA + DSA) | "kda" (Kimi Delta Attention); () = all dsa
    linear_num_heads: int = 0  # KDA heads, each linear_head_dim wide for q, k and v
    linear_head_dim: int = 0
    linear_conv_kernel_dim: int = 0  # KDA's short causal convolutions on q, k, v
    linear_lower_bound: float | None = None  # KDA forget gate in (lower_bound, 0); None: -exp(A_log) softplus
    index_kpool: int = 1  # tokens per indexer group: the indexer scores pooled groups and selects whole groups
    index_select_tail: bool = False  # with groups: the query's incomplete group is always attended
    hc_mult: int = 1  # parallel residual streams (hyper-connections); 1 = the plain residual
    hc_sinkhorn_iters: int = 0
    hc_eps: float = 0.0
    swiglu_limit: float | None = None  # SwiGLU clamps gate <= limit and up to [-limit, limit]
    text_prefix: str = "model."  # where the text model's tensors sit in the checkpoint

    @property
    def latent_dim(self) -> int:
        """Width of one cached latent row: kv_lora_rank + qk_rope_head_dim (576 for GLM-5)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times yarn's mscale^2 when the rope scaling asks for it."""
        scale = self.qk_head_dim**-0.5
        if self.rope.type == "yarn" and self.rope.mscale_all_dim and self.rope.factor > 1:
            m = 0.1 * self.rope.mscale_all_dim * math.log(self.rope.factor) + 1.0
            scale *= m * m
        return scale

    def attention_type(self, layer: int) -> str:
        return self.attention_types[layer] if self.attention_types else "dsa"

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.attention_types) if t == "kda"]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.indexer_types) if t == "full"]

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "moe"]

    @property
    def active_expert_weights(self) -> int:
        """Routed-expert weights one decode token reads: MoE layers x top-k x 3 matrices (22.6 G for GLM-5)."""
        return len(self.moe_layers) * self.num_experts_per_tok * 3 * self.hidden_size * self.moe_intermediate_size

    def check_positions(self, max_seq_len: int, source: str = "max_seq_len"):
        """A context the model's positions reach; source: what set it, named in the error."""
        if max_seq_len > self.max_position_embeddings:
            raise Glm5Error(f"{source} {max_seq_len} exceeds the model's max_position_embeddings "
                            f"{self.max_position_embeddings} ({self.path})")


class _Fields:
    """Typed access to the raw JSON dict; every failure names the file and the field."""

    def __init__(self, raw: dict, path: str):
        self.raw, self.path = raw, path

    def fail(self, field: str, why: str):
        raise Glm5Error(f"{self.path}: field '{field}' {why}")

    def get(self, field, kind, default=...):
        if field not in self.raw or self.raw[field] is None:
            if default is ...:
                self.fail(field, "is missing")
            return default
        value = self.raw[field]
        ok = {
            int: isinstance(value, int) and not isinstance(value, bool),
            float: isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
            bool: isinstance(value, bool),
            str: isinstance(value, str),
            dict: isinstance(value, dict),
            list: isinstance(value, list),
        }[kind]
        if not ok:
            wanted = "a finite number" if kind is float else kind.__name__
            self.fail(field, f"must be {wanted}, got {type(value).__name__} {value!r}")
        return float(value) if kind is float else value

    def positive(self, field, default=..., kind=int, most=None):
        """most: the largest value taken (a count of modules the model is built with: beyond it, a typo or a
        hostile file would build the tree for minutes and exhaust memory)."""
        value = self.get(field, kind, default)
        if value is not None and value <= 0:
            self.fail(field, f"must be > 0, got {value}")
        if value is not None and most is not None and value > most:
            self.fail(field, f"{value} is more than {most}, the most this engine builds")
        return value

    def count(self, field, default=...):
        """An int >= 0."""
        value = self.get(field, int, default)
        if value is not None and value < 0:
            self.fail(field, f"must be >= 0, got {value}")
        return value


def _indexer_types(f: _Fields, n_layers: int, attention: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Per layer "full" (owns an indexer) or "shared" (reuses the full layer below it); "none" for a KDA layer."""
    if f.raw.get("indexer_types") is not None:
        types = f.get("indexer_types", list)
        if len(types) != n_layers or any(t not in ("full", "shared") for t in types):
            f.fail("indexer_types", f"must list 'full' or 'shared' for each of {n_layers} layers")
    elif f.raw.get("index_topk_pattern") is not None:
        pattern = f.raw["index_topk_pattern"]
        if isinstance(pattern, str):
            pattern = list(pattern)
        if not isinstance(pattern, list) or len(pattern) != n_layers or any(c not in ("F", "S") for c in pattern):
            f.fail("index_topk_pattern", f"must be {n_layers} letters F or S, got {f.raw['index_topk_pattern']!r}")
        types = ["full" if c == "F" else "shared" for c in pattern]
    else:
        freq = f.get("index_topk_freq", int, 1)
        offset = f.get("index_skip_topk_offset", int, 2)
        if freq < 1:
            f.fail("index_topk_freq", f"must be >= 1, got {freq}")
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
    if attention:
        types = ["none" if a == "kda" else t for a, t in zip(attention, types)]
        for i in range(1, n_layers):  # a KDA layer in between ends the selection a shared layer would reuse
            if types[i] == "shared" and types[i - 1] not in ("full", "shared"):
                f.fail("indexer_types", f"layer {i} is 'shared' but layer {i - 1} has no DSA selection to share")
    first = next((t for t in types if t != "none"), "full")
    if first != "full":
        f.fail("indexer_types", "must start with a 'full' layer: a shared layer reuses the full layer below it")
    return tuple(types)


def _conv_width(f: _Fields) -> int:
    width = f.positive("linear_conv_kernel_dim")
    if width < 2:
        f.fail("linear_conv_kernel_dim", f"must be >= 2 (a short convolution over the last tokens), got {width}")
    return width


def _attention_types(f: _Fields, n_layers: int) -> tuple[str, ...]:
    types = f.get("layer_types", list)
    names = {"deepseek_sparse_attention": "dsa", "linear_attention": "kda"}
    if len(types) != n_layers or any(t not in names for t in types):
        f.fail("layer_types", f"must list 'linear_attention' or 'deepseek_sparse_attention' for each of {n_layers} layers")
    return tuple(names[t] for t in types)


def _mlp_layer_types(f: _Fields, n_layers: int) -> tuple[str, ...]:
    if f.raw.get("mlp_layer_types") is not None:
        types = f.get("mlp_layer_types", list)
        if len(types) != n_layers or any(t not in ("dense", "sparse") for t in types):
            f.fail("mlp_layer_types", f"must list 'dense' or 'sparse' for each of {n_layers} layers")
        return tuple("moe" if t == "sparse" else "dense" for t in types)
    n_dense = min(f.count("first_k_dense_replace"), n_layers)
    return tuple(["dense"] * n_dense + ["moe"] * (n_layers - n_dense))


def _eos_ids(f: _Fields, vocab: int) -> list[int]:
    """eos_token_id, one id or a list, each a token of the vocabulary (one past it would never end a reply)."""
    eos = f.raw.get("eos_token_id")
    if isinstance(eos, int) and not isinstance(eos, bool):
        eos = [eos]
    if eos is None:
        eos = []
    if not isinstance(eos, list) or any(not isinstance(e, int) or isinstance(e, bool) for e in eos):
        f.fail("eos_token_id", f"must be an integer or a list of integers, got {eos!r}")
    for e in eos:
        if not 0 <= e < vocab:
            f.fail("eos_token_id", f"holds {e}, not a token id of the vocabulary (0..{vocab - 1})")
    return eos


def _rope(f: _Fields) -> RopeConfig:
    if f.raw.get("rope_parameters") is not None:
        field, params = "rope_parameters", dict(f.get("rope_parameters", dict))
    else:  # older layout: rope_theta at the top, rope_scaling beside it
        field, params = "rope_scaling", dict(f.get("rope_scaling", dict, None) or {})
        params.setdefault("rope_theta", f.get("rope_theta", float, 10000.0))
    p = _Fields(params, f"{f.path}: {field}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        p.fail("rope_type", f"must be 'default' or 'yarn', got {rope_type!r}")
    theta = p.positive("rope_theta", kind=float)  # a base <= 0 puts NaN in every rotation
    if rope_type == "default":
        return RopeConfig(theta=theta, type="default")
    return RopeConfig(
        theta=theta,
        type="yarn",
        factor=p.positive("factor", kind=float),
        original_max_position_embeddings=p.positive("original_max_position_embeddings"),
        beta_fast=p.get("beta_fast", float, 32.0),
        beta_slow=p.get("beta_slow", float, 1.0),
        mscale=p.get("mscale", float, 0.0),
        mscale_all_dim=p.get("mscale_all_dim", float, 0.0),
        attention_factor=p.get("attention_factor", float, None),
    )


def _fp8_block_size(f: _Fields) -> tuple[int, int] | None:
    q = f.get("quantization_config", dict, None)
    if q is None:
        return None
    qf = _Fields(q, f"{f.path}: quantization_config")
    method = qf.get("quant_method", str)
    if method != "fp8":
        qf.fail("quant_method", f"must be 'fp8' (the only quantised release format), got {method!r}")
    fmt = qf.get("fmt", str, "e4m3")
    if fmt != "e4m3":
        qf.fail("fmt", f"must be 'e4m3', got {fmt!r}")
    block = qf.get("weight_block_size", list)
    if len(block) != 2 or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in block):
        qf.fail("weight_block_size", f"must be two positive integers, got {block!r}")
    return tuple(block)


def parse_config(raw: dict, path: str = "config.json") -> ModelConfig:
    f = _Fields(raw, path)
    model_type = f.get("model_type", str)
    if model_type == "glm5_next_text":  # the text model's config on its own: its tensors under "model."
        return _parse_glm5_next(f, f, "model.", path)
    if model_type not in MODEL_TYPES:
        f.fail("model_type", f"is {model_type!r}; supported: {', '.join(MODEL_TYPES)} (and glm5_next_text)")
    if model_type == "glm5_next":
        text = _Fields(f.get("text_config", dict), f"{path}: text_config")
        return _parse_glm5_next(text, f, TEXT_PREFIX[model_type], path)
    return _parse(f, model_type, path)


def _parse_glm5_next(f: _Fields, outer: _Fields, prefix: str, path: str) -> ModelConfig:
    """GLM-5.3-Flash: the text model of the multimodal config (text_config), or a text-only config."""
    n_layers = f.positive("num_hidden_layers", most=MAX_LAYERS)
    attention = _attention_types(f, n_layers)
    if f.get("qk_rope_head_dim", int, 0) != 0:
        f.fail("qk_rope_head_dim", "must be 0: GLM-5.3-Flash's sparse attention has no rope")
    kpool = f.positive("index_kpool", 1)
    topk = f.positive("index_topk")
    if topk % kpool:
        f.fail("index_topk", f"must be a multiple of index_kpool ({kpool}), got {topk}")
    limit = f.get("swiglu_limit", float, None)
    if limit is not None and limit <= 0:
        f.fail("swiglu_limit", f"must be > 0, got {limit}")
    lower = f.get("linear_lower_bound", float, None)
    if lower is not None and lower >= 0:
        f.fail("linear_lower_bound", f"must be < 0, got {lower}")
    merged = dict(f.raw)
    for key in ("dtype", "torch_dtype", "quantization_config", "eos_token_id"):  # the release keeps them outside
        if merged.get(key) is None and outer.raw.get(key) is not None:
            merged[key] = outer.raw[key]
    merged.setdefault("num_nextn_predict_layers", 1)  # the release may store an MTP layer after the last (unused)
    g = _Fields(merged, f.path)
    return _parse(g, "glm5_next", path, extra=dict(
        attention_types=attention,
        linear_num_heads=f.positive("linear_num_heads"),
        linear_head_dim=f.positive("linear_head_dim"),
        linear_conv_kernel_dim=_conv_width(f),
        linear_lower_bound=lower,
        index_kpool=kpool,
        index_select_tail=f.get("index_kpool_always_select_tail", bool, False),
        hc_mult=f.positive("hc_mult", 1),
        hc_sinkhorn_iters=f.positive("hc_sinkhorn_iters", 20),
        hc_eps=f.positive("hc_eps", 1e-6, kind=float),
        swiglu_limit=limit,
        text_prefix=prefix,
    ))


def _parse(f: _Fields, model_type: str, path: str, extra: dict | None = None) -> ModelConfig:
    extra = extra or {}
    attention = extra.get("attention_types", ())
    for field, want in (("hidden_act", "silu"), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        value = f.get(field, str, want)
        if value != want:
            f.fail(field, f"must be {want!r}, got {value!r}")
    n_layers = f.positive("num_hidden_layers", most=MAX_LAYERS)
    heads = f.positive("num_attention_heads")
    kv_heads = f.positive("num_key_value_heads", heads)
    if kv_heads != heads:
        f.fail("num_key_value_heads", f"must equal num_attention_heads ({heads}) for MLA, got {kv_heads}")
    rope_dim = f.count("qk_rope_head_dim") if attention else f.positive("qk_rope_head_dim")
    index_head_dim = f.positive("index_head_dim")
    if index_head_dim < rope_dim:
        f.fail("index_head_dim", f"must be >= qk_rope_head_dim ({rope_dim}), got {index_head_dim}")
    n_experts = f.positive("n_routed_experts", most=MAX_EXPERTS)
    n_group, topk_group = f.positive("n_group", 1), f.positive("topk_group", 1)
    if n_experts % n_group or topk_group > n_group:
        f.fail("n_group", f"must divide n_routed_experts ({n_experts}) and be >= topk_group ({topk_group})")
    top_k = f.positive("num_experts_per_tok")
    if top_k > n_experts // n_group * topk_group:
        f.fail("num_experts_per_tok", f"{top_k} is more than the {topk_group} kept groups hold")
    vocab = f.positive("vocab_size")
    eos = _eos_ids(f, vocab)
    dtype = f.get("dtype", str, None) or f.get("torch_dtype", str, "bfloat16")
    if dtype not in DTYPES:
        f.fail("dtype", f"must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return ModelConfig(
        path=path,
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=f.positive("hidden_size"),
        intermediate_size=f.positive("intermediate_size"),
        moe_intermediate_size=f.positive("moe_intermediate_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        q_lora_rank=f.positive("q_lora_rank"),
        kv_lora_rank=f.positive("kv_lora_rank"),
        qk_nope_head_dim=f.positive("qk_nope_head_dim"),
        qk_rope_head_dim=rope_dim,
        v_head_dim=f.positive("v_head_dim"),
        index_n_heads=f.positive("index_n_heads"),
        index_head_dim=index_head_dim,
        index_topk=f.positive("index_topk"),
        n_routed_experts=n_experts,
        n_shared_experts=f.count("n_shared_experts", 1),
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        num_nextn_predict_layers=f.count("num_nextn_predict_layers", 0),
        routed_scaling_factor=f.get("routed_scaling_factor", float, 1.0),
        norm_topk_prob=f.get("norm_topk_prob", bool, True),
        rms_norm_eps=f.positive("rms_norm_eps", kind=float),
        max_position_embeddings=f.positive("max_position_embeddings"),
        rope=_rope(f) if rope_dim else RopeConfig(theta=1.0, type="default"),
        rope_interleave=f.get("rope_interleave", bool, True),
        indexer_rope_interleave=f.get("indexer_rope_interleave", bool, model_type == "glm_moe_dsa"),
        tie_word_embeddings=f.get("tie_word_embeddings", bool, False),
        eos_token_ids=tuple(eos),
        indexer_types=_indexer_types(f, n_layers, attention),
        mlp_layer_types=_mlp_layer_types(f, n_layers),
        dtype=dtype,
        fp8_block_size=_fp8_block_size(f),
        **extra,
    )


def preset_names() -> list[str]:
    presets = resources.files("glm5_offload") / "presets"
    return sorted(p.name[: -len(".json")] for p in presets.iterdir() if p.name.endswith(".json"))


def json_object(path: Path) -> dict:
    """A JSON file's object, or a one-line Glm5Error naming the file (bad JSON, bad UTF-8, not an object)."""
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:  # (nested past Python's stack)
        raise Glm5Error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise Glm5Error(f"{path}: must hold a JSON object, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path) -> ModelConfig:
    """Load config.json from a model directory, a file, or a shipped preset name (glm-5, glm-5.2, ...)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    elif not path.exists() and str(path) in preset_names():
        path = Path(str(resources.files("glm5_offload") / "presets" / f"{path}.json"))
    if not path.is_file():
        raise Glm5Error(f"{path}: no such config file (or preset: {', '.join(preset_names())})")
    config = parse_config(json_object(path), str(path))
    generation = path.parent / "generation_config.json"
    if not generation.is_file():
        return config
    # the end-of-turn ids a release may keep only here (transformers' generate stops at them): added to config.json's
    extra = _eos_ids(_Fields(json_object(generation), str(generation)), config.vocab_size)
    return replace(config, eos_token_ids=tuple(dict.fromkeys([*config.eos_token_ids, *extra])))
