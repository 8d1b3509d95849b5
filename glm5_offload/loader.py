"""Load a checkpoint directory (safetensors only) into the module tree.

Reads `model.safetensors.index.json` and its shards, or one `model.safetensors`. Accepts bf16, fp16
and fp32 tensors, and FP8 e4m3 weights with a 128x128-block `weight_scale_inv` sibling, which are
dequantised (W = W8 * scale per block). The MTP layer (`model.layers.{num_hidden_layers}.*`) is
skipped. Every tensor is checked against the module tree before any is assigned, so a bad checkpoint
raises one Glm5Error naming the tensor or file, and nothing half-loaded is ever used.
"""

import json
import logging
import re
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from .config import ModelConfig, load_config
from .errors import Glm5Error
from .experts_numba import NumbaExperts, chain_layers
from .kv_cache import latent_layout
from .model import Attention, CausalLM, build_model
from .planner import detected_budgets, make_plan
from .rules import RuleFile, check_devices_present, place

log = logging.getLogger("glm5_offload")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KEEP_FP32 = ("e_score_correction_bias", "indexer.weights_proj.weight")


class PlanError(Glm5Error):
    """The placement does not fit this machine; carries the plan to show."""

    def __init__(self, plan):
        self.plan = plan
        over = [d for d in plan.devices if not d.fits]
        super().__init__("the model does not fit: " + ", ".join(
            f"{d.device} needs {d.total / 2**30:.1f} GiB of {d.budget / 2**30:.1f} GiB" for d in over)
            + f"; largest context that fits: {plan.largest_context} tokens")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def shard_files(model_dir: Path) -> dict[Path, set[str] | None]:
    """Each shard file, with the tensor names the index assigns to it (None: no index, take all)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (json.JSONDecodeError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
            raise Glm5Error(f"{index}: not a safetensors index (no 'weight_map' object)") from None
        shards: dict[Path, set[str]] = {}
        for name, file in weight_map.items():
            shards.setdefault(model_dir / file, set()).add(name)
        for file in shards:
            if not file.is_file():
                raise Glm5Error(f"{file}: shard named in {INDEX_FILE} is missing")
        return shards
    if (model_dir / SINGLE_FILE).is_file():
        return {model_dir / SINGLE_FILE: None}
    pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    hint = f" ({', '.join(pickles)} found: pickle checkpoints are never loaded)" if pickles else ""
    raise Glm5Error(f"{model_dir}: no {INDEX_FILE} or {SINGLE_FILE}{hint}")


def check_shard(path: Path) -> tuple[int, dict]:
    """Refuse a truncated or corrupt safetensors file before it is memory-mapped; (header length, header)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise Glm5Error(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise Glm5Error(f"{path}: corrupt or truncated safetensors header (claims {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, IndexError):
            raise Glm5Error(f"{path}: corrupt safetensors header") from None
    if 8 + n + end != size:
        raise Glm5Error(f"{path}: truncated or corrupt safetensors file (data needs {8 + n + end} bytes, file has {size})")
    return n, header


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W [out, in] float8_e4m3fn, scale_inv [ceil(out/b0), ceil(in/b1)] fp32 -> W8 * scale, fp32."""
    out_f, in_f = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:out_f].repeat_interleave(block[1], 1)[:, :in_f]
    return weight.float() * scale


class LazyTensors:
    """Tensors left in their shards, for an operator that reads and converts them itself."""

    def __init__(self, model_dir: Path, located: dict[str, Path], block: tuple[int, int] | None):
        self.model_dir, self.located, self.block = model_dir, located, block

    def _read(self, name: str) -> torch.Tensor:
        if name not in self.located:
            raise Glm5Error(f"{self.model_dir}: missing tensor {name}")
        try:
            with safe_open(self.located[name], framework="pt") as f:
                return f.get_tensor(name)
        except SafetensorError as e:
            raise Glm5Error(f"{self.located[name]}: corrupt safetensors file ({e})") from None

    def get(self, name: str, shape: tuple) -> torch.Tensor:
        """The tensor as a float tensor (FP8 dequantised), checked against shape."""
        t = self._read(name)
        scale = self._read(name + "_scale_inv") if t.dtype == torch.float8_e4m3fn else None
        if tuple(t.shape) != tuple(shape):
            raise Glm5Error(f"{self.model_dir}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if scale is not None:
            if self.block is None:
                raise Glm5Error(f"{self.model_dir}: tensor {name} is float8_e4m3fn but config.json has no fp8 "
                                "quantization_config")
            return dequantize_fp8(t, scale, self.block)
        if t.dtype not in FLOAT_DTYPES:
            raise Glm5Error(f"{self.model_dir}: tensor {name} has dtype {t.dtype}, expected a float dtype")
        return t


def read_tensors(model_dir: Path, config: ModelConfig, expected: dict[str, torch.Tensor],
                 lazy: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], LazyTensors]:
    """Every expected tensor, checked, FP8 dequantised, as stored otherwise (dtype conversion is later).

    Tensors under a `lazy` prefix are only located (their operators read them, or a cache instead).
    """
    tensors: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    located: dict[str, Path] = {}
    skipped_mtp = 0
    shards = shard_files(model_dir)
    for path, listed in tqdm(shards.items(), desc="loading shards", unit="shard", disable=None):
        check_shard(path)
        try:
            with safe_open(path, framework="pt") as f:
                names = set(f.keys())
                if listed is not None and listed - names:
                    raise Glm5Error(f"{path}: {INDEX_FILE} lists {sorted(listed - names)[0]} but the shard lacks it")
                for name in sorted(names if listed is None else listed):
                    layer = _LAYER.match(name)
                    if layer and int(layer.group(1)) >= config.num_hidden_layers:
                        skipped_mtp += 1
                        continue
                    if name.startswith(lazy) and name.removesuffix("_scale_inv") in expected:
                        located[name] = path
                    elif name.endswith(".weight_scale_inv"):
                        scales[name] = f.get_tensor(name)
                    elif name in expected:
                        tensors[name] = f.get_tensor(name)
                    else:
                        raise Glm5Error(f"{path}: unexpected tensor {name} (not part of this {config.model_type} model)")
        except SafetensorError as e:
            raise Glm5Error(f"{path}: corrupt safetensors file ({e})") from None
    if skipped_mtp:
        log.info("skipped %d tensors of the MTP layer model.layers.%d.* (not used for decoding)",
                 skipped_mtp, config.num_hidden_layers)

    missing = [n for n in expected if n not in tensors and n not in located]
    if missing:
        raise Glm5Error(f"{model_dir}: missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, scale in scales.items():
        weight = name[: -len("_scale_inv")]
        if weight not in tensors or tensors[weight].dtype != torch.float8_e4m3fn:
            raise Glm5Error(f"{model_dir}: unexpected tensor {name} (no float8_e4m3fn weight {weight} beside it)")
    for name, t in tensors.items():
        want = tuple(expected[name].shape)
        if tuple(t.shape) != want:
            raise Glm5Error(f"{model_dir}: tensor {name} has shape {tuple(t.shape)}, expected {want}")
        if t.dtype == torch.float8_e4m3fn:
            scale = scales.get(name + "_scale_inv")
            if scale is None or config.fp8_block_size is None:
                why = "without its weight_scale_inv" if scale is None else "but config.json has no fp8 quantization_config"
                raise Glm5Error(f"{model_dir}: tensor {name} is float8_e4m3fn {why}")
            block = config.fp8_block_size
            want_scale = tuple(-(-d // b) for d, b in zip(t.shape, block))
            if t.dim() != 2 or tuple(scale.shape) != want_scale or not scale.dtype.is_floating_point:
                raise Glm5Error(f"{model_dir}: tensor {name}_scale_inv has shape {tuple(scale.shape)} "
                                f"{scale.dtype}, expected {want_scale} float")
            tensors[name] = dequantize_fp8(t, scale, block)
        elif t.dtype not in FLOAT_DTYPES:
            raise Glm5Error(f"{model_dir}: tensor {name} has dtype {t.dtype}, expected bfloat16, float16, "
                            "float32 or float8_e4m3fn with weight_scale_inv")
    return tensors, LazyTensors(model_dir, located, config.fp8_block_size)


def _to_device_hook(device: torch.device):
    """A forward pre-hook that brings every tensor argument to the operator's device."""
    def hook(module, args, kwargs):
        move = lambda v: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}
    return hook


def load_model(model_dir: str | Path, device: str | None = None, dtype: torch.dtype | None = None,
               rules: RuleFile | None = None, max_seq_len: int | None = None,
               budgets: dict[str, int | None] | None = None, kv_dtype: str | None = None) -> CausalLM:
    """config.json + safetensors in model_dir -> a ready CausalLM placed by rules.

    device: the default device (over the rule file's); dtype: compute dtype (default: the config's).
    With max_seq_len, the planner checks the placement against the memory budgets first ('cpu',
    'cuda'; this machine's where not given) and refuses what would not fit before anything is loaded.
    kv_dtype 'fp8' keeps every layer's latent rows in the FP8 form, whatever the attention rules say.
    """
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    dtype = dtype or getattr(torch, config.dtype)
    model = build_model(config)
    placement = place(model, rules, device)
    check_devices_present(placement)
    if max_seq_len is not None:
        limits = {k: v for k, v in (budgets or {}).items() if v is not None}
        plan = make_plan(config, placement, max_seq_len, {**detected_budgets(), **limits}, dtype=dtype, kv_dtype=kv_dtype)
        if not plan.fits:
            raise PlanError(plan)
    expected = {k: v for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    built = [s for s in placement.slots.values() if s.op.build is not None]
    tensors, lazy = read_tensors(model_dir, config, expected, tuple(s.name + "." for s in built))
    for slot in tqdm(built, desc="preparing experts", unit="layer", disable=None if built else True):
        parent, _, child = slot.name.rpartition(".")
        slot.module = slot.op.build(slot, lazy, config, model_dir)
        setattr(model.get_submodule(parent), child, slot.module)
    chain_layers([s.module for s in built if isinstance(s.module, NumbaExperts)])
    for name, t in tensors.items():
        target = placement.slot_of(name).device
        tensors[name] = t.to(target, torch.float32 if name.endswith(KEEP_FP32) else dtype)
    if config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].to(placement.slots["lm_head"].device)
    for slot in placement.slots.values():
        if slot.op.module_class is not None:
            slot.module.__class__ = slot.op.module_class
        if isinstance(slot.module, Attention):
            slot.module.latent_layout = latent_layout(slot.kwargs, kv_dtype)
    model.load_state_dict(tensors, strict=True, assign=True)
    for slot in placement.slots.values():
        slot.module.register_forward_pre_hook(_to_device_hook(torch.device(slot.device)), with_kwargs=True)
    model.placement = placement
    return model.eval()
