"""`norm.triton`: RMSNorm (model/blocks.py's: same weight) in one Triton kernel (kernels/rmsnorm_triton.py) instead
of torch's eight, with the residual stream's pending addition before it in the same kernel. On a CPU outside Triton's
interpreter it is the reference."""

from ..kernels import INTERPRET, rmsnorm_triton
from ..model import RMSNorm
from .base import Operator


class TritonRMSNorm(RMSNorm):
    def forward(self, x):
        if not (self.weight.is_cuda or INTERPRET):
            return super().forward(x)
        return rmsnorm_triton.rmsnorm(x, self.weight, self.eps)

    def add_forward(self, x, adds: tuple):
        if not adds or not (self.weight.is_cuda or INTERPRET) or any(a.device != x.device for a in adds):
            return super().add_forward(x, adds)
        return rmsnorm_triton.add_rmsnorm(x, adds, self.weight, self.eps)


OPERATORS = (Operator("norm.triton", RMSNorm, "RMSNorm in one Triton kernel, a row a program, the residual add "
                      "before it", module_class=TritonRMSNorm),)
