"""The operators a rule can name, one file per family: reference.py (the plain-torch modules), dsa_triton.py
(attention and indexer in Triton), linear_triton.py (projections and lm_head with FP8 or int4 weights),
router_triton.py (the MoE router in Triton), norm_triton.py (RMSNorm in Triton),
hyper_connection_triton.py (GLM-5.3-Flash's hyper-connections in Triton), embedding_host.py (the embedding
table in host RAM), kda_fla.py (KDA in fla-core's kernels), experts_numba.py (routed experts on the CPU;
expert_ring.py streams them to a GPU for long prefill chunks). base.py says what an operator is."""

from . import (dsa_triton, embedding_host, hyper_connection_triton, kda_fla, linear_triton, norm_triton, reference,
               router_triton)
from .base import Operator
from .experts_numba import NUMBA_EXPERTS

REGISTRY: dict[str, Operator] = {op.name: op for op in (*reference.OPERATORS, *dsa_triton.OPERATORS,
                                                  *linear_triton.OPERATORS, *embedding_host.OPERATORS,
                                                  *kda_fla.OPERATORS, *router_triton.OPERATORS, *norm_triton.OPERATORS,
                                                  *hyper_connection_triton.OPERATORS,
                                                  NUMBA_EXPERTS)}
DEFAULT_OP = {op.replaces: op for op in reference.OPERATORS}  # slot class -> its reference operator
