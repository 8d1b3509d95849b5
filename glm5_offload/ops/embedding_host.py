"""`embedding.host`: the token embedding table in host RAM, its rows copied to the residual stream's device.

The slot's device is where the residual stream lives (where the rows go); the table (1.8 GiB for GLM-5) stays in
pinned host memory, and each forward's rows are read by the GPU in place (kernels/gather_rows.py: one row per token,
zero-copy, so a CUDA graph replays it). On the CPU it is the plain lookup.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.gather_rows import gather_rows
from .base import Buffer, BuildContext, Operator, PlanContext, Slot


class HostEmbedding(nn.Embedding):
    """nn.Embedding whose weight is in (pinned) host memory and whose rows land on out_device."""

    out_device: torch.device

    def forward(self, tokens):
        if self.out_device.type == "cpu":
            return F.embedding(tokens, self.weight)
        out = torch.empty(tokens.shape[0], self.embedding_dim, dtype=self.weight.dtype, device=self.out_device)
        gather_rows(self.weight, tokens, out, torch.arange(tokens.shape[0], device=self.out_device))
        return out


class HostEmbeddingOperator(Operator):
    def weights_device(self, slot: Slot) -> str:
        return "cpu"

    def memory(self, slot: Slot, ctx: PlanContext) -> list[Buffer]:
        return [Buffer(self.weights_device(slot), "weights", self.weight_bytes(slot, ctx.dtype))]

    def build(self, slot: Slot, checkpoint, ctx: BuildContext) -> nn.Module:
        device = torch.empty(0, device=slot.device).device  # with its index: cuda -> cuda:0, as tensors report it
        table = checkpoint.read(slot.tensor_name("weight")).to(ctx.dtype)
        slot.module.weight = nn.Parameter(table.pin_memory() if device.type == "cuda" else table, requires_grad=False)
        slot.module.__class__ = HostEmbedding
        slot.module.out_device = device
        return slot.module


OPERATORS = (HostEmbeddingOperator("embedding.host", nn.Embedding,
                                   "embedding table in host RAM, each token's row read by the GPU in place"),)
