"""The module tree of each model family, named like the checkpoint, built on the meta device, with the plain-torch
reference forward of every module: blocks.py (norms, linears, MLPs, router, experts), mla.py (attention and the
DSA indexer), pooled_indexer.py (GLM-5.3-Flash's indexer over token groups), kda.py (Kimi Delta Attention), rope.py,
steps.py (a forward as steps, for CUDA graphs), and one file per family (glm_moe_dsa.py, glm5_next.py).
"""

import torch

from ..config import ModelConfig
from . import glm5_next
from .blocks import MLP, Experts, Linear, LMHead, MoE, RMSNorm, Router, keeps_fp32, swiglu
from .glm5_next import HyperConnection
from .glm_moe_dsa import Backbone, CausalLM, DecoderLayer
from .kda import KDA, GatedRMSNorm, KDAState
from .mla import SCORE_BUDGET, Attention, Indexer, LatentLayout, indexer_scores, sparse_mla, topk_indices
from .pooled_indexer import PooledIndexer, PooledKeys
from .steps import CUT, HostStep, Pass, run_steps

__all__ = ["MLP", "Experts", "Linear", "LMHead", "MoE", "Router", "RMSNorm", "keeps_fp32", "swiglu", "Backbone",
           "CausalLM", "DecoderLayer", "build_model", "HyperConnection", "KDA", "KDAState", "GatedRMSNorm",
           "SCORE_BUDGET", "Attention", "Indexer", "LatentLayout", "indexer_scores", "sparse_mla", "topk_indices",
           "PooledIndexer", "PooledKeys", "CUT", "HostStep", "Pass", "run_steps"]


def build_model(config: ModelConfig) -> CausalLM:
    """The module tree of config's family on the meta device: shapes and names only, no memory."""
    family = glm5_next.CausalLM if config.model_type == "glm5_next" else CausalLM
    with torch.device("meta"):
        return family(config)
