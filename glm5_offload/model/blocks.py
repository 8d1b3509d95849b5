"""The building blocks of the GLM-5 family's module tree, with their plain-torch reference forward: norms, linear
layers, SwiGLU MLPs, the sigmoid router and the routed experts of a MoE block.

Modules are named exactly like the checkpoint's tensors and built on the meta device; operators (glm5_offload.ops)
fill them from the checkpoint or replace them. A forward takes one sequence, no batch dimension: x is [S, hidden].
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..util import Beside, span
from .steps import CUT, HostStep, Pass

# as the releases store them, whatever the dtype (KDA's convolution taps and gate parameters too)
FP32_WEIGHTS = ("e_score_correction_bias", "weights_proj.weight", "conv1d.weight", ".dt_bias", ".A_log")


def keeps_fp32(name: str) -> bool:
    """Whether the checkpoint tensor `name` stays fp32 whatever the compute dtype (the router's correction bias, the
    indexer's head weights)."""
    return name.endswith(FP32_WEIGHTS)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add_forward(self, x, adds: tuple):
        """The residual stream's pending addition, then the norm: (x + summed(adds, x), RMSNorm of that); adds ()
        is x's norm alone."""
        if adds:
            x = x + summed(adds, x)
        return x, self(x)


def summed(parts: tuple, like: torch.Tensor) -> torch.Tensor:
    """A sublayer's output from its parts (a MoE block's: the routed experts' sum, then the shared expert's output),
    added in order, each in like's dtype on like's device."""
    total = parts[0].to(like.device, like.dtype)
    for part in parts[1:]:
        total = total + part.to(like.device, like.dtype)
    return total


class Linear(nn.Linear):
    """y = x W^T without bias: a slot of its own (linear.reference), so a rule can hold its weight in another form."""

    def __init__(self, in_features: int, out_features: int):
        # nn.Linear's own __init__, its checks through Module.__setattr__ skipped: GLM-5's tree has 58,288 of these
        # (75 MoE layers x 257 MLPs x 3), built by `glm5 plan` (5.8 -> 2.7 s for them on a 2-core machine; the whole
        # tree 7.8 -> 6.0 s)
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self._parameters["weight"] = nn.Parameter(torch.empty(out_features, in_features))
        self._parameters["bias"] = None

    def reset_parameters(self):  # every weight comes from the checkpoint
        pass

    def dense_weight(self) -> torch.Tensor:
        """W [out, in], dense, in the compute dtype (absorbed MLA splits kv_b_proj's into W_UK and W_UV)."""
        return self.weight


class LMHead(Linear):
    """The output projection hidden -> vocab (its own class so a rule can place it by class)."""


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(gate) * up; with a limit (GLM-5.3-Flash's swiglu_limit) gate <= limit and -limit <= up <= limit first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Dense layers, each routed expert and the shared expert."""

    SAME_INPUT = ("gate_proj", "up_proj")  # the projections that read x

    def __init__(self, hidden: int, inner: int, limit: float | None = None):
        super().__init__()
        self.gate_proj = Linear(hidden, inner)
        self.up_proj = Linear(hidden, inner)
        self.down_proj = Linear(inner, hidden)
        self.limit = limit
        self.fused_inputs = None  # gate_proj and up_proj of x at once, where their operator can (set by the loader)

    def forward(self, x):
        gate, up = (self.gate_proj(x), self.up_proj(x)) if self.fused_inputs is None else self.fused_inputs(x)
        return self.down_proj(swiglu(gate, up, self.limit))


class Router(nn.Module):
    """Sigmoid router with correction bias and group-limited top-k (checkpoint name `mlp.gate`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.empty(config.n_routed_experts, dtype=torch.float32))
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor

    def forward(self, x):
        """x [T, hidden] -> expert ids [T, top_k] (int64), weights [T, top_k] (fp32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(x.shape[0], self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(x.shape[0], -1)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class Experts(nn.ModuleList):
    """The routed experts, one MLP each (`mlp.experts.E.{gate,up,down}_proj`).

    A MoE block drives them in parts so that other work fits between: begin (here: compute now), beside (the GPU's
    share, queued while the host works; none here), host (work on the host, none here), finish (the sum, on the
    caller's device). experts.numba's module overlaps them,
    and starts streaming its weights to the GPU when told a long chunk begins (prepare)."""

    def __init__(self, config: ModelConfig):
        super().__init__(MLP(config.hidden_size, config.moe_intermediate_size, config.swiglu_limit)
                         for _ in range(config.n_routed_experts))

    def prepare(self, tokens: int, device: torch.device):
        """A forward of `tokens` tokens on `device` starts (nothing to get ready here)."""

    def begin(self, x, ids, weights):
        with span("experts", x.device):
            return self(x, ids, weights)

    def beside(self, pending):
        """Queue the GPU's share of work begun on the host (none here), to run while the host does its part."""

    def host(self, pending):
        pass

    def finish(self, pending):
        """The sum begin started, on x's device (in x's dtype, or fp32 where an operator's experts computed it so)."""
        return pending

    def forward(self, x, ids, weights):
        """x [T, hidden], ids/weights [T, top_k] -> sum_i w_i * expert_i(x)."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slot = torch.where(ids == e)
            y = self[e](x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.swiglu_limit)
            if config.n_shared_experts
            else None
        )

    def steps(self, enter, leave) -> list:
        """leave(s, MoE(enter(s))) as steps on a Pass (enter: the block's input, e.g. a norm of the residual stream;
        leave: what the output does to the stream, given as its parts: (routed experts' sum, shared expert's output),
        whose sum is blocks.summed): the routing, whose input starts on its way to the experts (CPU experts: to the
        host); the shared expert (on a side stream: its HBM-bound GEMVs beside the GPU's share of the experts, which
        reads host memory) and that share (beside), queued meanwhile; the experts' host work; their output handed on."""

        def route(s: Pass):
            s.moe_x = enter(s)
            ids, weights = self.gate(s.moe_x)
            s.routed = self.experts.begin(s.moe_x, ids, weights)

        def beside(s: Pass):  # the GPU's work while the host's runs
            with Beside(s.moe_x.device, on=self.shared_experts is not None, stream=1) as side:
                if self.shared_experts is not None:
                    s.shared = self.shared_experts(s.moe_x)
            self.experts.beside(s.routed)
            side.join()

        def combine(s: Pass):
            out = self.experts.finish(s.routed)
            leave(s, (out,) if self.shared_experts is None else (out, s.shared))

        return [route, CUT, beside, HostStep(lambda s: self.experts.host(s.routed)), combine]
