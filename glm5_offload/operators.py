"""The operator registry: the only things a rule file can name.

An operator replaces one class of module in the tree (its "slot"), runs on one device and holds its
weights in one format. A slot owns its whole subtree, except the child slots it delegates (attention
delegates its indexer, which a rule may place on its own). Reference operators are the plain-torch
modules of model.py themselves.
"""

from dataclasses import dataclass, field

import torch
from torch import nn

from .model import MLP, Attention, Experts, Indexer, LMHead, RMSNorm, Router

DTYPE_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
FP32_WEIGHTS = ("e_score_correction_bias", "weights_proj.weight")  # kept fp32 whatever the format


@dataclass(frozen=True)
class Operator:
    name: str
    replaces: type
    summary: str
    kwargs: tuple[str, ...] = ()  # the kwargs a rule may pass
    delegates: tuple[type, ...] = ()  # child slot classes placed by their own rules

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


REGISTRY: dict[str, Operator] = {
    op.name: op
    for op in (
        Operator("embedding.reference", nn.Embedding, "token embedding lookup"),
        Operator("norm.reference", RMSNorm, "RMSNorm of the residual stream"),
        Operator("attention.reference", Attention,
                 "MLA in absorbed latent form over the DSA-selected rows (plain torch)", delegates=(Indexer,)),
        Operator("indexer.reference", Indexer, "lightning indexer: scores, causal mask, top-k (plain torch)"),
        Operator("mlp.reference", MLP, "SwiGLU MLP: dense layers and the shared expert"),
        Operator("router.reference", Router, "sigmoid router, correction bias, group-limited top-k"),
        Operator("experts.reference", Experts, "routed SwiGLU experts, one loop over the chosen experts"),
        Operator("lm_head.reference", LMHead, "output projection to the vocabulary"),
    )
}
DEFAULT_OP = {op.replaces: op for op in REGISTRY.values()}  # each slot class -> its reference operator


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
