"""The MoE router in two Triton kernels: the logits' GEMV from the bf16 weight as stored, then the whole selection
(sigmoid, correction bias, group-limited top-k, normalisation, scaling) in one program per token.

The reference is model/blocks.py's Router.forward: logits = x W^T in fp32 (x and W widened), scores =
sigmoid(logits), the choice = scores + bias; with groups, each group's score is the sum of its two best choices and
only the topk_group best groups stay; the top_k choices' scores, normalised to sum 1, times routed_scaling_factor.

- `_logits_kernel` (up to DECODE_ROWS tokens): W [E, K] is read once, split over the inputs so every SM streams a
  share; each program writes its partial logits part[split, T, E] (fp32). The reference widens W to fp32 each call
  (a 6 MB copy for GLM-5's 256 x 6144) before its GEMV.
- `_select_kernel`: one program per token adds the partials in order (deterministic: a CUDA graph's replay equals
  eager) and selects. Experts sit in a [groups, group size] tile, so group scores are row reductions. Top-k is
  top_k rounds of max-and-remove, the lowest expert id first on a tie (torch.topk's order for distinct values:
  best first).
"""

import torch
import triton
import triton.language as tl

from . import programs_wanted
from .linear_triton import DECODE_ROWS

BROADCAST_ROWS = 4  # up to this many tokens multiply and sum in registers; more take fp32 dots
BLOCK_E = 64  # experts per logits program
BLOCK_K = 128  # inputs per step (for fp32 dots; a multiple of the tokens' block in registers)
SELECT_WARPS = 1  # the select's program: its top-k rounds' reductions within one warp (H100, GLM-5's 256 experts:
# 5.5-5.6 us a call against 6.2-6.4 with 4 warps; most of it is reading the logits' 48 partials, which fewer
# splits only move into a slower GEMV: bench/RESULTS.md, session 56)


@triton.jit
def _logits_kernel(x_ptr, w_ptr, part_ptr, T, E, K, blocks_per_split, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    # x [T, K], w [E, K] -> part [splits, T, E] fp32: program (BLOCK_E experts, one split of the inputs)
    eb, split = tl.program_id(0), tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for kb in range(split * blocks_per_split, tl.minimum((split + 1) * blocks_per_split, tl.cdiv(K, BLOCK_K))):
        k = kb * BLOCK_K + kk
        w = tl.load(w_ptr + e.to(tl.int64)[:, None] * K + k[None, :], mask=(e < E)[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=(t < T)[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        if DOT:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(part_ptr + (split * T + t[:, None]) * E + e[None, :], acc, mask=(t < T)[:, None] & (e < E)[None, :])


@triton.jit
def _select_kernel(part_ptr, bias_ptr, ids_ptr, weights_ptr, splits, T, E, scaling, GROUP: tl.constexpr,
                   N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_J: tl.constexpr, BLOCK_TOPK: tl.constexpr, NORM: tl.constexpr):
    # part [splits, T, E] fp32, bias [E] fp32 -> ids [T, TOP_K] int64, weights [T, TOP_K] fp32; program: token t
    t = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_J)
    ok = (g < N_GROUP)[:, None] & (j < GROUP)[None, :]
    expert = tl.where(ok, g[:, None] * GROUP + j[None, :], E)  # [BLOCK_G, BLOCK_J]: group g's j-th expert; E: none
    logits = tl.zeros((BLOCK_G, BLOCK_J), tl.float32)
    for i in range(0, splits):
        logits += tl.load(part_ptr + (i * T + t) * E + expert, mask=ok, other=0.0)
    scores = tl.sigmoid(logits)
    choice = tl.where(ok, scores + tl.load(bias_ptr + expert, mask=ok, other=0.0), float("-inf"))
    choice = tl.where(choice != choice, float("inf"), choice)  # NaN ranks first, as in torch.topk: ids stay experts
    if N_GROUP > 1:
        best = tl.max(choice, axis=1)
        first = tl.min(tl.where(choice == best[:, None], j[None, :], BLOCK_J), axis=1)
        second = tl.max(tl.where(j[None, :] == first[:, None], float("-inf"), choice), axis=1)
        group_score = tl.where(g < N_GROUP, best + second, float("-inf"))
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.min(tl.where(group_score == tl.max(group_score, axis=0), g, BLOCK_G), axis=0)
            keep = keep | (g == pick)
            group_score = tl.where(g == pick, float("-inf"), group_score)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    k = tl.arange(0, BLOCK_TOPK)
    ids = tl.zeros((BLOCK_TOPK,), tl.int64)
    weights = tl.zeros((BLOCK_TOPK,), tl.float32)
    for r in tl.static_range(TOP_K):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == top, expert, E), axis=1), axis=0)
        ids = tl.where(k == r, pick.to(tl.int64), ids)
        weights = tl.where(k == r, tl.sum(tl.sum(tl.where(expert == pick, scores, 0.0), axis=1), axis=0), weights)
        choice = tl.where(expert == pick, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(ids_ptr + t * TOP_K + k, ids, mask=k < TOP_K)
    tl.store(weights_ptr + t * TOP_K + k, weights * scaling, mask=k < TOP_K)


def logits_parts(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] times weight [E, K]^T -> partial logits [splits, T, E] fp32 (their sum: the logits): up to DECODE_ROWS
    tokens _logits_kernel's split GEMV, the weight read as stored; a prefill chunk's by one fp32 matmul (1 split)."""
    T, K = x.shape
    if T > DECODE_ROWS:
        return (x.float() @ weight.float().t())[None]
    E = weight.shape[0]
    dot = T > BROADCAST_ROWS
    block_t = max(16, triton.next_power_of_2(T)) if dot else triton.next_power_of_2(T)
    block_k = BLOCK_K if dot else BLOCK_K // block_t  # the products' tile stays 64 x 128 in registers
    steps, blocks = triton.cdiv(K, block_k), triton.cdiv(E, BLOCK_E)
    per_split = triton.cdiv(steps, max(1, min(steps, programs_wanted(x.device) // blocks)))
    splits = triton.cdiv(steps, per_split)
    part = torch.empty(splits, T, E, dtype=torch.float32, device=x.device)
    _logits_kernel[(blocks, splits)](x.contiguous(), weight, part, T, E, K, per_split, BLOCK_T=block_t,
                                     BLOCK_E=BLOCK_E, BLOCK_K=block_k, DOT=dot, num_warps=4)
    return part


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
          norm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Router.forward: x [T, K], weight [E, K] (as stored), bias [E] fp32 -> ids [T, top_k] int64 (best first),
    weights [T, top_k] fp32. Decode rows' logits by _logits_kernel; a prefill chunk's by one fp32 matmul."""
    T = x.shape[0]
    E = weight.shape[0]
    part = logits_parts(x, weight)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    group = E // n_group
    _select_kernel[(T,)](part, bias, ids, weights, part.shape[0], T, E, scaling, GROUP=group, N_GROUP=n_group,
                         TOPK_GROUP=topk_group, TOP_K=top_k, BLOCK_G=triton.next_power_of_2(n_group),
                         BLOCK_J=triton.next_power_of_2(group), BLOCK_TOPK=triton.next_power_of_2(top_k), NORM=norm,
                         num_warps=SELECT_WARPS)
    return ids, weights
