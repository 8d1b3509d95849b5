"""The memory planner: bytes on each device for a config, a placement and a context length.

Every placed operator declares the buffers it needs (ops/base.py `memory`): weights, cache per token, fixed
buffers, buffers several slots share (counted once), workspace (a device's largest counts: operators run one at a
time). The planner sums them, adds one prefill chunk's activations per device, and says whether it fits and the
largest context that would. It knows no operator and no module class.
"""

from dataclasses import dataclass, field

import torch

from .config import ModelConfig
from .errors import Glm5Error
from .formats.int_groups import BITS
from .ops.base import Buffer, PlanContext
from .rules import Placement
from .util import human_bytes

KV_DTYPES = ("fp8", "bf16", "fp32")
ACTIVATION_BYTES = 4  # a prefill chunk's activations are counted in fp32


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
    notes: list[str]  # what the operators say of their buffers: "latent KV fp8 (656 B/token/layer)", ...
    active_expert_bytes: int  # routed-expert bytes one decode token reads (payload, no scales)
    devices: list[DevicePlan] = field(default_factory=list)

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
            ", ".join([f"max_seq_len {self.max_seq_len}"] + self.notes),
            f"active routed-expert weights per decode token: {c.active_expert_weights / 1e9:.1f} G "
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
        lines.append(("fits" if self.fits else "does NOT fit") + f"; largest context that fits: {self.largest()}")
        return "\n".join(lines)

    def largest(self) -> str:
        """The largest context in words: its tokens, or why there is none."""
        over = [d.device for d in self.devices if d.budget is not None and d.fixed > d.budget]
        if over:
            return f"none: the weights and buffers alone are over the budget of {', '.join(over)}"
        return f"{self.largest_context} tokens"


class PlanError(Glm5Error):
    """The placement does not fit this machine; carries the plan to show."""

    def __init__(self, plan: Plan):
        self.plan = plan
        over = [d for d in plan.devices if not d.fits]
        super().__init__("the model does not fit: " + ", ".join(
            f"{d.device} needs {d.total / 2**30:.1f} GiB of {d.budget / 2**30:.1f} GiB" for d in over)
            + f"; largest context that fits: {plan.largest()}")


def make_plan(config: ModelConfig, placement: Placement, max_seq_len: int, budgets: dict[str, int | None],
              kv_dtype: str | None = None, expert_format: str | None = None, dtype: torch.dtype | None = None,
              prefill_chunk: int = 2048) -> Plan:
    """budgets: 'cpu' -> host bytes, 'cuda' -> bytes of each GPU (None: no limit known).

    kv_dtype fp8 puts every layer's cache in the FP8 forms (656 B latent rows, 132 B indexer keys); bf16 or fp32
    count the layers whose attention rule does not ask for FP8 in that dtype instead of the compute dtype.
    expert_format counts the routed experts in that format whatever their operator holds."""
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise Glm5Error(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if expert_format is not None and expert_format not in BITS:
        raise Glm5Error(f"--expert-format must be one of {', '.join(BITS)}, got {expert_format!r}")
    dtype = dtype or getattr(torch, config.dtype)
    stream = placement.slots["model.embed_tokens"].device
    ctx = PlanContext(config, dtype, max_seq_len, kv_dtype, expert_format, prefill_chunk, stream)
    devices: dict[str, DevicePlan] = {}
    shared: dict[tuple, Buffer] = {}
    notes: list[str] = []
    active = 0

    def on(device: str) -> DevicePlan:
        if device not in devices:
            devices[device] = DevicePlan(device, budget=budgets.get(device.split(":")[0]))
        return devices[device]

    def add(b: Buffer):
        d = on(b.device)
        if b.kind == "workspace" and b.shared is None:  # temporaries: one operator's at a time
            d.workspace = max(d.workspace, b.bytes)
        else:
            setattr(d, b.kind, getattr(d, b.kind) + b.bytes + b.per_token * max_seq_len)
            d.per_token += b.per_token

    for slot in placement.slots.values():
        on(slot.device)
        active += slot.op.active_bytes(slot, ctx)
        for b in slot.op.memory(slot, ctx):
            if b.note is not None and b.note not in notes:
                notes.append(b.note)
            if b.shared is None:
                add(b)
            else:  # counted once: the largest of its kind
                key = (b.device, b.kind, b.shared)
                if key not in shared or (b.bytes, b.per_token) > (shared[key].bytes, shared[key].per_token):
                    shared[key] = b
    for b in shared.values():
        add(b)
    # per head: q, the output, and sparse MLA's o [kv_lora_rank] twice (a tiered cache's key slab merges its own)
    heads = config.num_attention_heads * (config.qk_head_dim + config.v_head_dim + 2 * config.kv_lora_rank)
    if config.kda_layers:  # a KDA layer's q, k, v, gates and convolution inputs
        heads = max(heads, 12 * config.linear_num_heads * config.linear_head_dim)
    # residual stream(s: hc_mult with hyper-connections), norms, projections of one chunk, and the logits
    stream = (5 + config.hc_mult) * config.hidden_size
    for d in devices.values():
        d.activations = prefill_chunk * (stream + heads) * ACTIVATION_BYTES + config.vocab_size * 4
    return Plan(config, placement, max_seq_len, notes, active, sorted(devices.values(), key=lambda d: d.device))


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
