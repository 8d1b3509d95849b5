"""The memory planner: bytes on each device for a config, a placement and a context length.

Weights come from the placed operators and their formats; the latent KV cache lives with each
layer's attention operator and the indexer keys with each full layer's indexer. Activations and
workspace are estimates of one prefill chunk's temporaries. The plan says whether it fits and the
largest context that would.
"""

import re
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .errors import Glm5Error
from .expert_ring import DEPTH
from .kv_cache import LatentLayout, fp8_row_width, latent_layout
from .model import _SCORE_BUDGET, Attention, Experts, Indexer
from .operators import DTYPE_FORMATS
from .rules import Placement

KV_DTYPES = ("fp8", "bf16", "fp32")
SLOT_BYTES = 8  # a tiered layer's hot-slot table entry per token, on the device
EXPERT_FORMATS = {"bf16": 16, "int8": 8, "int4": 4}  # bits per weight
EXPERT_GROUP = 128  # weights per fp32 scale in the int formats
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, flag: str) -> int:
    """'24GiB', '512G' (binary), '80GB' (decimal), '1.5TiB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise Glm5Error(f"{flag}: {text!r} is not a size such as 24GiB, 512G or 80GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human_bytes(n: int | float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def latent_row_bytes(config: ModelConfig, kv_dtype: str) -> int:
    """One token's latent row in one layer: bf16 1152 B for GLM-5; FP8 656 B (e4m3 c, fp32 scale per 128, bf16 rope)."""
    if kv_dtype == "fp8":
        return fp8_row_width(config.kv_lora_rank, config.qk_rope_head_dim)
    return config.latent_dim * (2 if kv_dtype == "bf16" else 4)


def index_key_bytes(config: ModelConfig, kv_dtype: str) -> int:
    """One token's indexer key in one full layer: FP8 132 B (e4m3 + one fp32 scale), bf16 256 B."""
    if kv_dtype == "fp8":
        return config.index_head_dim + 4
    return config.index_head_dim * (2 if kv_dtype == "bf16" else 4)


def expert_bytes(n_weights: int, fmt: str, group: int = EXPERT_GROUP) -> int:
    """Weights in an expert format: the payload plus one fp32 scale per group for int8/int4."""
    payload = n_weights * EXPERT_FORMATS[fmt] // 8
    return payload if fmt == "bf16" else payload + n_weights // group * 4


def active_expert_weights(config: ModelConfig) -> int:
    """Routed-expert weights one decode token reads: MoE layers x top-k x 3 matrices."""
    return len(config.moe_layers) * config.num_experts_per_tok * 3 * config.hidden_size * config.moe_intermediate_size


@dataclass
class DevicePlan:
    device: str
    weights: int = 0
    latent_kv: int = 0
    indexer_keys: int = 0
    activations: int = 0
    workspace: int = 0
    per_token: int = 0  # cache bytes each token adds here
    budget: int | None = None

    @property
    def fixed(self) -> int:
        return self.weights + self.activations + self.workspace

    @property
    def total(self) -> int:
        return self.fixed + self.latent_kv + self.indexer_keys

    @property
    def fits(self) -> bool:
        return self.budget is None or self.total <= self.budget


@dataclass
class Plan:
    config: ModelConfig
    placement: Placement
    max_seq_len: int
    kv_dtypes: list[str]  # the latent forms the attention layers use
    key_bytes: int  # one token's indexer key in one full layer (the largest form, if the layers differ)
    expert_format: str
    active_expert_bytes: int  # routed-expert bytes one decode token reads (payload, no scales)
    devices: list[DevicePlan]

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    @property
    def largest_context(self) -> int:
        """Most tokens whose cache fits every budget, capped at max_position_embeddings."""
        best = self.config.max_position_embeddings
        for d in self.devices:
            if d.budget is None or d.per_token == 0:
                continue
            best = min(best, max(d.budget - d.fixed, 0) // d.per_token)
        return best

    def table(self) -> str:
        c = self.config
        rules = self.placement.rules.path if self.placement.rules else f"default placement on {self.placement.default_device}"
        lines = [
            f"plan: {c.path} ({c.model_type}, {c.num_hidden_layers} layers, {len(c.full_layers)} full indexer layers), "
            f"rules {rules}",
            f"max_seq_len {self.max_seq_len}, latent KV "
            + ", ".join(f"{k} ({latent_row_bytes(c, k)} B/token/layer)" for k in self.kv_dtypes)
            + f", indexer keys {self.key_bytes} B/token/full layer, experts {self.expert_format}",
            f"active routed-expert weights per decode token: {active_expert_weights(c) / 1e9:.1f} G "
            f"= {self.active_expert_bytes / 1e9:.1f} GB",
            "",
            f"{'device':<8} {'weights':>12} {'latent KV':>12} {'idx keys':>12} {'activations':>12} {'workspace':>12} "
            f"{'total':>12} {'budget':>12}  verdict",
        ]
        for d in self.devices:
            budget = human_bytes(d.budget) if d.budget is not None else "-"
            verdict = "ok" if d.fits else f"OVER by {human_bytes(d.total - d.budget)}"
            lines.append(f"{d.device:<8} {human_bytes(d.weights):>12} {human_bytes(d.latent_kv):>12} {human_bytes(d.indexer_keys):>12} "
                         f"{human_bytes(d.activations):>12} {human_bytes(d.workspace):>12} {human_bytes(d.total):>12} {budget:>12}  {verdict}")
        lines.append("")
        lines.append(("fits" if self.fits else "does NOT fit") +
                     f"; largest context that fits: {self.largest_context} tokens")
        return "\n".join(lines)


def make_plan(config: ModelConfig, placement: Placement, max_seq_len: int, budgets: dict[str, int | None],
              kv_dtype: str | None = None, expert_format: str | None = None, dtype: torch.dtype | None = None,
              prefill_chunk: int = 2048) -> Plan:
    """budgets: 'cpu' -> host bytes, 'cuda' -> bytes of each GPU (None: no limit known).

    kv_dtype fp8 puts every layer's latent rows and indexer keys in the FP8 forms (656 B, 132 B); bf16 or
    fp32 count the layers whose attention rule does not ask for FP8 (kv_cache.latent_layout) in that dtype,
    instead of the compute dtype. Offloaded latent rows count on the host; their device holds the hot buffer and
    one prefill staging buffer of every row. A device with FP8 rows holds one more buffer of every row, in bf16,
    for prefill chunks' sparse MLA (kernels/dsa_triton.sparse_mla converts them once per chunk)."""
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise Glm5Error(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if expert_format is not None and expert_format not in EXPERT_FORMATS:
        raise Glm5Error(f"--expert-format must be one of {', '.join(EXPERT_FORMATS)}, got {expert_format!r}")
    dtype = dtype or getattr(torch, config.dtype)
    devices: dict[str, DevicePlan] = {}

    def on(device: str) -> DevicePlan:
        if device not in devices:
            devices[device] = DevicePlan(device, budget=budgets.get(device.split(":")[0]))
        return devices[device]

    compute_kv = DTYPE_FORMATS[dtype]

    def layout_of(attention_slot) -> LatentLayout:
        return latent_layout(attention_slot.kwargs, "fp8" if kv_dtype == "fp8" else None)

    def kv_form(layout: LatentLayout) -> str:
        """The form of a layer's latent rows and indexer keys: FP8 by the flag or the attention rule, else the
        flag's dtype or the compute dtype."""
        return "fp8" if layout.fp8 else kv_dtype or compute_kv

    key_kinds = set()
    activation_bytes = 4  # temporaries are fp32 at worst
    rings: dict[str, set[tuple]] = {}  # GPU -> its expert rings (expert_ring.py: one per format and depth)
    converted: dict[str, int] = {}  # device -> bf16 row bytes of the FP8 rows converted for a prefill chunk
    staging: dict[str, int] = {}  # device -> row bytes of the prefill staging buffer its offloaded layers share
    latent_kinds = set()
    for slot in placement.slots.values():
        d = on(slot.device)
        if isinstance(slot.module, Experts) and expert_format is not None:
            d.weights += expert_bytes(sum(p.numel() for p in slot.module.parameters()), expert_format)
        else:
            d.weights += slot.op.weight_bytes(slot.module, slot.kwargs, dtype, skip=slot.child_slots)
        if isinstance(slot.module, Attention):
            layout = layout_of(slot)
            kind = kv_form(layout)
            latent_kinds.add(kind)
            row = latent_row_bytes(config, kind)
            home = on("cpu") if layout.offload else d
            home.per_token += row
            home.latent_kv += row * max_seq_len
            if layout.offload:  # the hot buffer, and its slot table: one int64 per token (tiered_kv.slot_of)
                d.latent_kv += layout.hot_bytes + SLOT_BYTES * max_seq_len
                d.per_token += SLOT_BYTES
                staging[slot.device] = max(staging.get(slot.device, 0), row)
            d.workspace = max(d.workspace, 3 * _SCORE_BUDGET * activation_bytes)
            if kind == "fp8":  # a prefill chunk's sparse MLA converts every row so far to bf16 (dsa_triton)
                converted[slot.device] = config.latent_dim * 2
        elif isinstance(slot.module, Indexer):
            key = index_key_bytes(config, kv_form(layout_of(placement.slots[slot.name.rpartition(".")[0]])))  # its attention's
            key_kinds.add(key)
            d.per_token += key
            d.indexer_keys += key * max_seq_len
            d.workspace = max(d.workspace, 3 * _SCORE_BUDGET * activation_bytes)
        elif isinstance(slot.module, Experts):
            d.workspace = max(d.workspace, prefill_chunk * config.moe_intermediate_size * 3 * activation_bytes)
            gate = placement.slots.get(slot.name.rpartition(".")[0] + ".gate")
            if slot.kwargs.get("gpu_tokens") and gate is not None and gate.device != slot.device:
                fmt = slot.op.format(slot.kwargs, dtype).split("/")[0]
                ring = (fmt, slot.kwargs.get("group_size", EXPERT_GROUP), slot.kwargs.get("gpu_ring", DEPTH))
                rings.setdefault(gate.device, set()).add(ring)
    one_expert = 3 * config.hidden_size * config.moe_intermediate_size
    for device, kinds in rings.items():  # long prefill chunks' experts: the rings stay, the layers share them;
        # and one expert dequantised at a time
        devices[device].workspace += sum(depth * expert_bytes(one_expert, fmt, group) for fmt, group, depth in kinds)
        devices[device].workspace += one_expert * dtype.itemsize
    for device, row in [*staging.items(), *converted.items()]:  # one buffer of every row, shared by the layers
        devices[device].latent_kv += row * max_seq_len
        devices[device].per_token += row
    heads = config.num_attention_heads * (config.qk_head_dim + config.v_head_dim + config.kv_lora_rank)
    for d in devices.values():  # residual stream, norms, projections of one chunk, and the logits
        d.activations = prefill_chunk * (6 * config.hidden_size + heads) * activation_bytes + config.vocab_size * 4
    if expert_format is None:  # the experts operator's own format
        expert_format = next((s.op.format(s.kwargs, dtype) for s in placement.slots.values()
                              if isinstance(s.module, Experts)), DTYPE_FORMATS[dtype])
    bits = EXPERT_FORMATS.get(expert_format.split("/")[0]) or torch.finfo(dtype).bits
    active = active_expert_weights(config) * bits // 8
    key_bytes = max(key_kinds, default=index_key_bytes(config, kv_dtype or compute_kv))
    return Plan(config, placement, max_seq_len, sorted(latent_kinds) or [compute_kv], key_bytes, expert_format, active,
                sorted(devices.values(), key=lambda d: d.device))


def detected_budgets() -> dict[str, int | None]:
    """This machine's memory: MemAvailable for the host, each GPU's total memory."""
    budgets: dict[str, int | None] = {"cpu": None, "cuda": None}
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        budgets["cpu"] = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    if torch.cuda.is_available():
        budgets["cuda"] = torch.cuda.get_device_properties(0).total_memory
    return budgets
