"""The operator registry: the only things a rule file can name.

Reference operators are the plain-torch modules of model.py themselves; the others replace them.
"""

from torch import nn

from .attention_triton import TritonAttention, TritonIndexer
from .experts_numba import NUMBA_EXPERTS
from .kernels.dsa_triton import INTERPRET
from .kv_cache import LAYOUT_KWARGS
from .model import MLP, Attention, Experts, Indexer, LMHead, RMSNorm, Router
from .operators import AttentionOperator, Operator

REGISTRY: dict[str, Operator] = {
    op.name: op
    for op in (
        Operator("embedding.reference", nn.Embedding, "token embedding lookup"),
        Operator("norm.reference", RMSNorm, "RMSNorm of the residual stream"),
        AttentionOperator("attention.reference", Attention,
                          "MLA in absorbed latent form over the DSA-selected rows (plain torch)",
                          kwargs=LAYOUT_KWARGS, delegates=(Indexer,)),
        Operator("indexer.reference", Indexer, "lightning indexer: scores, causal mask, top-k (plain torch)"),
        Operator("mlp.reference", MLP, "SwiGLU MLP: dense layers and the shared expert"),
        Operator("router.reference", Router, "sigmoid router, correction bias, group-limited top-k"),
        Operator("experts.reference", Experts, "routed SwiGLU experts, one loop over the chosen experts"),
        Operator("lm_head.reference", LMHead, "output projection to the vocabulary"),
        NUMBA_EXPERTS,
        AttentionOperator("attention.dsa_triton", Attention, "MLA over the selected rows in a Triton kernel",
                          kwargs=LAYOUT_KWARGS, delegates=(Indexer,), devices=("cuda", "cpu") if INTERPRET else ("cuda",),
                          module_class=TritonAttention),
        Operator("indexer.dsa_triton", Indexer, "lightning indexer scores in a Triton kernel, torch.topk",
                 devices=("cuda", "cpu") if INTERPRET else ("cuda",), module_class=TritonIndexer),
    )
}
DEFAULT_OP = {op.replaces: op for op in REGISTRY.values() if op.name.endswith(".reference")}  # slot class -> op
