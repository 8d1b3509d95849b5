"""What an operator is, and a placed one (a slot). The registry of them is registry.py.

An operator replaces one class of module in the tree (its "slot"), runs on one device and holds its
weights in one format. A slot owns its whole subtree, except the child slots it delegates (attention
delegates its indexer, which a rule may place on its own).
"""

from dataclasses import dataclass, field

import torch
from torch import nn

DTYPE_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
FP32_WEIGHTS = ("e_score_correction_bias", "weights_proj.weight")  # kept fp32 whatever the format


def is_positive_int(value) -> bool:
    """A rule's count kwarg (threads, tokens): an int >= 1; YAML's true/false are not numbers here."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Operator:
    name: str
    replaces: type
    summary: str
    kwargs: tuple[str, ...] = ()  # the kwargs a rule may pass
    delegates: tuple[type, ...] = ()  # child slot classes placed by their own rules
    devices: tuple[str, ...] = ("cpu", "cuda")  # device types it runs on
    build = None  # (slot, lazy tensors, config, model_dir) -> module, for operators that load their own weights
    module_class: type | None = None  # the slot's module becomes this subclass (same weights), if set

    def check_kwargs(self, kwargs: dict) -> str | None:
        """What is wrong with a rule's kwargs values (their names are checked already), or None."""
        return None

    def format(self, kwargs: dict, dtype: torch.dtype) -> str:
        """The weight format this operator holds: the compute dtype, for the reference operators."""
        return DTYPE_FORMATS[dtype]

    def weight_bytes(self, module: nn.Module, kwargs: dict, dtype: torch.dtype, skip: tuple = ()) -> int:
        """Bytes of the slot's own weights (not those of delegated child slots) in its format."""
        total = 0
        for name, t in module.state_dict(keep_vars=True).items():
            if name.startswith(skip):
                continue
            size = 4 if name.endswith(FP32_WEIGHTS) else torch.empty((), dtype=dtype).element_size()
            total += t.numel() * size
        return total


@dataclass
class Slot:
    """One placed operator: the module it replaces, where it runs, and which rule put it there."""

    name: str
    module: nn.Module = field(repr=False)
    op: Operator
    device: str
    kwargs: dict
    rule: int | None  # index of the rule that matched it or an ancestor; None = the default

    @property
    def child_slots(self) -> tuple[str, ...]:
        """Names (relative) of delegated children, whose weights this slot does not hold."""
        return tuple(f"{n}." for n, m in self.module.named_children() if isinstance(m, self.op.delegates))


class AttentionOperator(Operator):
    """Attention: its kwargs say how the layer keeps its latent rows (kv_cache.latent_layout)."""

    def check_kwargs(self, kwargs: dict) -> str | None:
        from .errors import Glm5Error
        from .kv_cache import latent_layout

        try:
            latent_layout(kwargs)
        except Glm5Error as e:
            return str(e)
        return None
