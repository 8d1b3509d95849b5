"""What an operator is: the one interface through which a rule's choice builds a part of the model and says what
that part needs.

A slot is one placed module of the tree: the module its operator replaces (of class `replaces`), the device it runs
on, the rule's kwargs as the operator parsed them, and the rule that put it there. A slot owns its whole subtree,
except the child slots its operator delegates to their own rules (attention delegates its indexer, linears and
norms).

An operator
- parses and checks its own kwargs (parse_kwargs: defaults filled in; a Glm5Error naming the kwarg at fault),
- runs on the device types in `devices`,
- builds its slot's module from the checkpoint (build: weights in their format, on the slot's device),
- declares memory(slot, ctx): the buffers it needs on each device (weights, per-token cache, fixed and shared
  buffers, workspace), which the planner sums without knowing any operator,
- and links its built modules where they work together (link).
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..formats import dtype_name
from ..model import keeps_fp32


@dataclass(eq=False)
class Slot:
    name: str
    module: nn.Module = field(repr=False)
    op: "Operator"
    device: str
    kwargs: dict  # as op.parse_kwargs returned them
    rule: int | None  # index of the rule that matched it or an ancestor; None = the default
    parent: "Slot | None" = field(default=None, repr=False)  # the slot that delegated it
    children: dict[str, "Slot"] = field(default_factory=dict, repr=False)  # delegated child slots, by relative name

    def tensor_name(self, name: str) -> str:
        """A tensor of the module under its checkpoint name."""
        return f"{self.name}.{name}" if self.name else name

    def own_tensors(self) -> dict[str, torch.Tensor]:
        """The module's tensors that this slot holds (its delegated children's are theirs), by relative name."""
        skip = tuple(f"{child}." for child in self.children)
        return {n: t for n, t in self.module.state_dict(keep_vars=True).items() if not n.startswith(skip)}


@dataclass(frozen=True)
class Buffer:
    """Bytes an operator needs on one device: `bytes` fixed, plus `per_token` for each token of the context."""

    device: str
    kind: str  # what it is for, as the plan's columns say: weights | latent_kv | indexer_keys | workspace
    bytes: int = 0
    per_token: int = 0
    shared: tuple | None = None  # a buffer slots share (the expert ring): counted once per (device, kind, shared)
    note: str | None = None  # what the plan's header says of it, e.g. "latent KV fp8 (656 B/token/layer)"


@dataclass(frozen=True)
class PlanContext:
    config: ModelConfig
    dtype: torch.dtype  # the compute dtype
    max_seq_len: int
    kv_dtype: str | None  # --kv-dtype: fp8 (every layer), or a dtype for the layers not in FP8; None: the rules'
    expert_format: str | None  # --expert-format: count the routed experts in this format
    prefill_chunk: int
    stream_device: str  # where the residual stream lives (the embedding's device)


@dataclass(frozen=True)
class BuildContext:
    config: ModelConfig
    dtype: torch.dtype
    model_dir: Path
    kv_dtype: str | None  # --kv-dtype fp8: every layer's cache in the FP8 forms
    stream_device: str  # where the residual stream lives (the embedding's device)


@dataclass(frozen=True)
class Operator:
    name: str
    replaces: type  # the class of module it replaces
    summary: str
    kwargs: tuple[str, ...] = ()  # the kwargs a rule may pass
    delegates: tuple[type, ...] = ()  # child module classes placed by their own rules
    devices: tuple[str, ...] = ("cpu", "cuda")  # device types it runs on
    module_class: type | None = None  # the slot's module becomes this subclass of `replaces` (same weights)

    def parse_kwargs(self, kwargs: dict) -> dict:
        """A rule's kwargs (their names already checked) with defaults filled in; Glm5Error names a bad value."""
        return dict(kwargs)

    def weights_device(self, slot: Slot) -> str:
        """Where the slot's weights live: its device (embedding.host keeps its table in host memory)."""
        return slot.device

    def check(self, slot: Slot):
        """Refuse (Glm5Error) kwargs that do not suit the slot's module (a group size that does not divide it)."""

    def format(self, slot: Slot, dtype: torch.dtype) -> str:
        """The weight format the slot holds: the compute dtype for the reference operators (fp32 where the model
        keeps every tensor of the slot in it)."""
        names = [slot.tensor_name(n) for n in slot.own_tensors()]
        return "fp32" if names and all(keeps_fp32(n) for n in names) else dtype_name(dtype)

    def weight_bytes(self, slot: Slot, dtype: torch.dtype) -> int:
        """Bytes of the slot's own weights in its format."""
        return sum(t.numel() * (4 if keeps_fp32(slot.tensor_name(n)) else dtype.itemsize)
                   for n, t in slot.own_tensors().items())

    def memory(self, slot: Slot, ctx: PlanContext) -> list[Buffer]:
        return [Buffer(slot.device, "weights", self.weight_bytes(slot, ctx.dtype))]

    def active_bytes(self, slot: Slot, ctx: PlanContext) -> int:
        """Bytes of routed-expert weights one decode token reads through this slot (payload): routed experts only."""
        return 0

    def cache_note(self, slot: Slot, dtype: torch.dtype) -> tuple[str, str] | None:
        """(what, how) of a cache the slot keeps, for `glm5 rules show`: ("latent KV", "bf16 rows on cuda")."""
        return None

    def build(self, slot: Slot, checkpoint, ctx: BuildContext) -> nn.Module:
        """The slot's module with its own tensors from the checkpoint, on its device, in the compute dtype (fp32
        where the model keeps it)."""
        device = torch.device(slot.device)
        tensors = {}
        for name in slot.own_tensors():
            full = slot.tensor_name(name)
            tensors[name] = checkpoint.read(full).to(device, torch.float32 if keeps_fp32(full) else ctx.dtype)
        slot.module.load_state_dict(tensors, strict=False, assign=True)
        if self.module_class is not None:
            slot.module.__class__ = self.module_class
        return slot.module

    def link(self, modules: list[nn.Module]):
        """Called once with every module this operator built, in the model's order."""

    def fuse(self, modules: list[nn.Module]):
        """One callable computing several of this operator's modules that read the same input (a module's
        SAME_INPUT), x -> their outputs as a list, or None where the operator has no such form (the default)."""
        return None
