"""`kda.fla`: Kimi Delta Attention with fla-core's Triton kernels (flash-linear-attention: `chunk_kda` for a prefill
chunk, `fused_recurrent_kda` for a decode step). Projections, convolutions, gates, the output norm and the cache are
kda.reference's (model/kda.py); the recurrence runs in fla-core, with the normalisation of q and k and the forget
gate's activation fused into its kernels.
"""

import importlib

from ..model import KDA, Linear
from ..model.kda import forget_decay
from .reference import KDAOperator


def _fla_kda():
    """fla.ops.kda, imported when a layer first runs: importing fla-core takes seconds, which a run that places no
    KDA layer (every GLM-5 and DeepSeek placement) should not pay."""
    return importlib.import_module("fla.ops.kda")


class FlaKDA(KDA):
    def recurrence(self, q, k, v, g, beta, state):
        """KDA.recurrence in fla-core's kernels, which also normalise q and k and activate the gate (from A_log,
        dt_bias and the lower bound: `safe_gate`, fla-core's bounded-gate path, where the bound is in its [-5, 0))."""
        kda = _fla_kda()
        bound = self.lower_bound
        fused = bound is None or -5 <= bound < 0
        if fused:
            extra = dict(A_log=self.A_log, dt_bias=self.dt_bias, use_gate_in_kernel=True, lower_bound=bound)
        else:  # a bound outside fla-core's: the gate is made here
            g, extra = forget_decay(g, self.A_log, self.dt_bias, bound), {}
        if q.shape[0] == 1:
            kernel = kda.fused_recurrent_kda
        else:
            kernel, extra["safe_gate"] = kda.chunk_kda, fused and bound is not None
        o, new = kernel(q[None], k[None], v[None], g[None], beta[None], scale=q.shape[-1] ** -0.5,
                        initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True, **extra)
        return o[0], new[0]


OPERATORS = (
    KDAOperator("kda.fla", KDA, "Kimi Delta Attention with fla-core's Triton kernels (chunked prefill, fused "
                "recurrent decode)", delegates=(Linear,), devices=("cuda",), module_class=FlaKDA),
)
