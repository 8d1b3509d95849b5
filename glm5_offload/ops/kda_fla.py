"""`kda.fla`: Kimi Delta Attention with fla-core's Triton kernels (flash-linear-attention: `chunk_kda` for a prefill
chunk, `fused_recurrent_kda` for a decode step). Projections, convolutions, gates, the output norm and the cache are
kda.reference's (model/kda.py); only the recurrence runs in fla-core, from the same normalised q, k and decays.
"""

import importlib

from ..model import KDA, Linear
from .reference import KDAOperator


def _fla_kda():
    """fla.ops.kda, imported when a layer first runs: importing fla-core takes seconds, which a run that places no
    KDA layer (every GLM-5 and DeepSeek placement) should not pay."""
    return importlib.import_module("fla.ops.kda")


class FlaKDA(KDA):
    def recurrence(self, q, k, v, g, beta, state):
        """KDA.recurrence with fla-core's kernels for the recurrence itself. A decode step (one token) hands
        fused_recurrent_kda the raw q, k and gate logits: the normalisation, q's scale and the gate's activation
        (KDA.prepare's) run inside its one kernel, as fp32 as the reference's. A chunk normalises and activates here
        (chunk_kda's own gate clamps what the reference does not), then chunk_kda."""
        kda = _fla_kda()
        if q.shape[0] == 1:
            o, new = kda.fused_recurrent_kda(q[None], k[None], v[None], g[None], beta[None], A_log=self.A_log,
                                             dt_bias=self.dt_bias, scale=q.shape[-1] ** -0.5,
                                             initial_state=state[None], output_final_state=True,
                                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                             lower_bound=self.lower_bound)
            return o[0], new[0]
        q, k, v, g = self.prepare(q, k, v, g)
        o, new = kda.chunk_kda(q[None], k[None], v[None], g[None], beta[None], scale=1.0, initial_state=state[None],
                               output_final_state=True)
        return o[0], new[0]


OPERATORS = (
    KDAOperator("kda.fla", KDA, "Kimi Delta Attention with fla-core's Triton kernels (chunked prefill, fused "
                "recurrent decode)", delegates=(Linear,), devices=("cuda",), module_class=FlaKDA),
)
