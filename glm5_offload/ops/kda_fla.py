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
        """KDA.recurrence with fla-core's kernels for the recurrence itself: q and k normalised (q scaled) and the
        gate activated here in fp32, as the reference does, then chunk_kda (a chunk) or fused_recurrent_kda (one
        token). (fla-core can fuse the normalisation and the gate into its kernels: not yet measured here.)"""
        kda = _fla_kda()
        q, k, v, g = self.prepare(q, k, v, g)
        kernel = kda.fused_recurrent_kda if q.shape[0] == 1 else kda.chunk_kda
        o, new = kernel(q[None], k[None], v[None], g[None], beta[None], scale=1.0, initial_state=state[None],
                        output_final_state=True)
        return o[0], new[0]


OPERATORS = (
    KDAOperator("kda.fla", KDA, "Kimi Delta Attention with fla-core's Triton kernels (chunked prefill, fused "
                "recurrent decode)", delegates=(Linear,), devices=("cuda",), module_class=FlaKDA),
)
