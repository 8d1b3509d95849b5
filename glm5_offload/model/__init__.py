"""The module tree of each model family, named like the checkpoint, built on the meta device, with the plain-torch
reference forward of every module: blocks.py (norms, linears, MLPs, router, experts), mla.py (attention and the
DSA indexer), rope.py, steps.py (a forward as steps, for CUDA graphs), and one file per family (glm_moe_dsa.py).
"""

from .blocks import MLP, Experts, Linear, LMHead, MoE, RMSNorm, Router, keeps_fp32
from .glm_moe_dsa import Backbone, CausalLM, DecoderLayer, build_model
from .mla import SCORE_BUDGET, Attention, Indexer, LatentLayout, indexer_scores, sparse_mla, topk_indices
from .steps import CUT, HostStep, Pass, run_steps

__all__ = ["MLP", "Experts", "Linear", "LMHead", "MoE", "Router", "RMSNorm", "keeps_fp32", "Backbone",
           "CausalLM", "DecoderLayer", "build_model", "SCORE_BUDGET", "Attention", "Indexer", "LatentLayout",
           "indexer_scores", "sparse_mla", "topk_indices", "CUT", "HostStep", "Pass", "run_steps"]
