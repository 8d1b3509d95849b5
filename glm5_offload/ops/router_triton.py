"""`router.triton`: the MoE router (model/blocks.py's Router: same weights) in two Triton kernels
(kernels/router_triton.py): the logits' GEMV from the weight as stored, and the sigmoid, bias, group top-k and
normalisation in one program per token. On a CPU outside Triton's interpreter it is the reference."""

from ..kernels import INTERPRET, router_triton
from ..model import Router
from .base import Operator


class TritonRouter(Router):
    def forward(self, x):
        if not (self.weight.is_cuda or INTERPRET):
            return super().forward(x)
        return router_triton.route(x, self.weight, self.e_score_correction_bias, self.top_k, self.n_group,
                                   self.topk_group, self.norm_topk_prob, self.scaling)


OPERATORS = (
    Operator("router.triton", Router, "sigmoid router, correction bias, group-limited top-k in two Triton kernels",
             module_class=TritonRouter),
)
