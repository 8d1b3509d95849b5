"""`hyper_connection.triton`: GLM-5.3-Flash's hyper-connections (model/glm5_next.py's HyperConnection: same weights)
in Triton (kernels/hyper_connection_triton.py): the logits' GEMV and one program a token for the norm, the gates and
every Sinkhorn step, one kernel for the merge. On a CPU outside Triton's interpreter it is the reference."""

from ..kernels import INTERPRET, hyper_connection_triton
from ..model import HyperConnection
from .base import Operator


class TritonHyperConnection(HyperConnection):
    def _kernels(self) -> bool:
        return self.fn.is_cuda or INTERPRET

    def forward(self, streams):
        if not self._kernels():
            return super().forward(streams)
        return hyper_connection_triton.mix(streams, self.fn, self.base, self.scale, self.iters, self.eps,
                                           self.norm_eps)

    def merge(self, streams, out, post, comb):
        if not self._kernels():
            return super().merge(streams, out, post, comb)
        return hyper_connection_triton.merge(streams, out, post, comb)


OPERATORS = (
    Operator("hyper_connection.triton", HyperConnection, "mixes the residual streams around a sublayer (mHC) in "
             "three Triton launches: the logits' GEMV, the gates and Sinkhorn steps a program a token, the merge",
             module_class=TritonHyperConnection),
)
