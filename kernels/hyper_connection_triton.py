"""GLM-5.3-Flash's hyper-connections (mHC) in three Triton launches instead of some 150 torch kernels a sublayer.

The reference is model/glm5_next.py's HyperConnection: from the residual streams [S, M, D] (M = hc_mult) it takes
the streams' RMS over all M * D values, 2M + M^2 logits (flat streams, normalised, times fn^T), and from them `pre`
(sigmoid), `post` (2 sigmoid) and `comb` (a softmax per row, then Sinkhorn's alternate column and row
normalisations, hc_sinkhorn_iters of them: each a torch kernel or three on a [S, M, M] tensor); the sublayer's input
is the streams weighted by `pre`; after the sublayer `merge` gives stream i = post_i * out + sum_j comb[j, i]
stream_j. A decode step of a Flash layer ran two of them and two merges, some 300 launches of tiny kernels.

- the logits: router_triton.logits_parts (the same skinny GEMV: fn read as stored, split over the inputs, partial
  sums [splits, S, 2M + M^2]; a prefill chunk's by one fp32 matmul). The RMS factor multiplies the dot afterwards.
- `_mix_kernel`, a program per token: the streams' sum of squares, the partial logits' sums (SPLITS_BLOCK a load,
  added in a fixed order: a CUDA graph's replay equals eager), pre, post and comb with
  every Sinkhorn step in registers (M x M padded to a power of two), then the weighted sum of the streams.
- `_merge_kernel`, a program per (token, block of D): post and comb rounded to the streams' dtype as the reference
  rounds them, the products summed in fp32 and rounded once (the reference rounds the two terms and their sum).
"""

import torch
import triton
import triton.language as tl

from .fp8_bits import round_to_bf16
from .router_triton import logits_parts

BLOCK_D = 1024  # values of a stream per step of _mix_kernel
SPLITS_BLOCK = 32  # the logits' partial sums read a load at a time by _mix_kernel
MERGE_BLOCK_D = 256  # values per _merge_kernel program (M x M x this products in registers)


@triton.jit
def _round(x, KIND: tl.constexpr):
    """fp32 -> the nearest value of the streams' dtype (KIND 1: bf16, by bits; 2: fp16), still fp32; 0: fp32."""
    if KIND == 1:
        x = round_to_bf16(x)
    elif KIND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _mix_kernel(part_ptr, streams_ptr, base_ptr, scale_ptr, h_ptr, post_ptr, comb_ptr, splits, S, D, norm_eps, eps,
                M: tl.constexpr, ITERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                SPLITS_BLOCK: tl.constexpr, KIND: tl.constexpr):
    # part [splits, S, 2M + M^2] fp32, streams [S, M, D], base [2M + M^2], scale [3] -> h [S, D] (streams' dtype),
    # post [S, M] fp32, comb [S, M, M] fp32; program: token s
    s = tl.program_id(0).to(tl.int64)
    a = tl.arange(0, BLOCK_M)
    b = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    a_ok = a < M
    rows = streams_ptr + s * M * D + a[:, None] * D
    squares = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(0, D, BLOCK_D):
        x = tl.load(rows + start + d[None, :], mask=a_ok[:, None] & (start + d < D)[None, :], other=0.0)
        squares += x.to(tl.float32) * x.to(tl.float32)
    r = 1.0 / tl.sqrt_rn(tl.sum(tl.sum(squares, axis=1), axis=0) / (M * D) + norm_eps)

    n_out = 2 * M + M * M
    ok = a_ok[:, None] & (b < M)[None, :]
    pre = tl.zeros((BLOCK_M,), tl.float32)
    post = tl.zeros((BLOCK_M,), tl.float32)
    comb = tl.zeros((BLOCK_M, BLOCK_M), tl.float32)
    sp = tl.arange(0, SPLITS_BLOCK)
    for first in range(0, splits, SPLITS_BLOCK):  # SPLITS_BLOCK partial sums a load (Flash: 128 of them)
        at = part_ptr + ((first + sp) * S + s) * n_out  # [SPLITS_BLOCK]
        sp_ok = first + sp < splits
        pre += tl.sum(tl.load(at[:, None] + a[None, :], mask=sp_ok[:, None] & a_ok[None, :], other=0.0), axis=0)
        post += tl.sum(tl.load(at[:, None] + M + a[None, :], mask=sp_ok[:, None] & a_ok[None, :], other=0.0),
                       axis=0)
        comb += tl.sum(tl.load(at[:, None, None] + 2 * M + a[None, :, None] * M + b[None, None, :],
                               mask=sp_ok[:, None, None] & ok[None, :, :], other=0.0), axis=0)
    scale_pre = tl.load(scale_ptr).to(tl.float32)
    scale_post = tl.load(scale_ptr + 1).to(tl.float32)
    scale_comb = tl.load(scale_ptr + 2).to(tl.float32)
    pre = tl.sigmoid(pre * r * scale_pre + tl.load(base_ptr + a, mask=a_ok, other=0.0).to(tl.float32)) + eps
    post = 2 * tl.sigmoid(post * r * scale_post + tl.load(base_ptr + M + a, mask=a_ok, other=0.0).to(tl.float32))
    z = comb * r * scale_comb + tl.load(base_ptr + 2 * M + a[:, None] * M + b[None, :], mask=ok,
                                        other=0.0).to(tl.float32)
    z = tl.where(ok, z, float("-inf"))
    z = tl.where(a_ok[:, None], z, 0.0)  # padding rows: finite (their values are dropped below)
    e = tl.exp(z - tl.max(z, axis=1)[:, None])
    comb = tl.where(ok, e / tl.sum(e, axis=1)[:, None] + eps, 0.0)  # softmax over each row, + eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)  # the columns
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)  # the rows
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)  # the columns
    tl.store(post_ptr + s * M + a, post, mask=a_ok)
    tl.store(comb_ptr + s * M * M + a[:, None] * M + b[None, :], comb, mask=ok)

    for start in range(0, D, BLOCK_D):
        mask = start + d < D
        x = tl.load(rows + start + d[None, :], mask=a_ok[:, None] & mask[None, :], other=0.0).to(tl.float32)
        h = tl.sum(tl.where(a_ok, pre, 0.0)[:, None] * x, axis=0)
        tl.store(h_ptr + s * D + start + d, _round(h, KIND).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_kernel(streams_ptr, out_ptr, post_ptr, comb_ptr, new_ptr, D, M: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr, KIND: tl.constexpr):
    # streams [S, M, D], out [S, D], post [S, M] fp32, comb [S, M, M] fp32 -> new [S, M, D] (streams' dtype)
    s = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_M)
    i = tl.arange(0, BLOCK_M)
    d_ok = d < D
    j_ok = j < M
    x = tl.load(streams_ptr + s * M * D + j[:, None] * D + d[None, :], mask=j_ok[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32)  # [j, d]
    c = tl.load(comb_ptr + s * M * M + j[:, None] * M + i[None, :], mask=j_ok[:, None] & (i < M)[None, :],
                other=0.0)  # [j, i]
    p = _round(tl.load(post_ptr + s * M + i, mask=i < M, other=0.0), KIND)
    o = _round(tl.load(out_ptr + s * D + d, mask=d_ok, other=0.0).to(tl.float32), KIND)
    new = p[:, None] * o[None, :] + tl.sum(_round(c, KIND)[:, :, None] * x[:, None, :], axis=0)  # [i, d]
    tl.store(new_ptr + s * M * D + i[:, None] * D + d[None, :], _round(new, KIND).to(new_ptr.dtype.element_ty),
             mask=(i < M)[:, None] & d_ok[None, :])


def _kind(dtype: torch.dtype) -> int:
    return {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)


def mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
        norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HyperConnection.forward: streams [S, M, D], fn [2M + M^2, M*D], base [2M + M^2], scale [3] (as stored) ->
    (post [S, M] fp32, comb [S, M, M] fp32, the sublayer's input [S, D] in the streams' dtype)."""
    S, M, D = streams.shape
    flat = streams.contiguous().view(S, M * D)
    part = logits_parts(flat, fn)
    h = torch.empty(S, D, dtype=streams.dtype, device=streams.device)
    post = torch.empty(S, M, dtype=torch.float32, device=streams.device)
    comb = torch.empty(S, M, M, dtype=torch.float32, device=streams.device)
    if S:
        _mix_kernel[(S,)](part, flat, base, scale, h, post, comb, part.shape[0], S, D, norm_eps, eps, M=M,
                          ITERS=iters, BLOCK_M=triton.next_power_of_2(M),
                          BLOCK_D=min(BLOCK_D, triton.next_power_of_2(D)),
                          SPLITS_BLOCK=min(SPLITS_BLOCK, triton.next_power_of_2(part.shape[0])),
                          KIND=_kind(streams.dtype), num_warps=4)
    return post, comb, h


def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """HyperConnection.merge: streams [S, M, D], out [S, D], post [S, M] fp32, comb [S, M, M] fp32 -> the streams
    after the sublayer [S, M, D] in the streams' dtype."""
    S, M, D = streams.shape
    streams, out = streams.contiguous(), out.contiguous()
    new = torch.empty_like(streams)
    if S:
        block = min(MERGE_BLOCK_D, triton.next_power_of_2(D))
        _merge_kernel[(S, triton.cdiv(D, block))](streams, out, post.contiguous(), comb.contiguous(), new, D, M=M,
                                                  BLOCK_M=triton.next_power_of_2(M), BLOCK_D=block,
                                                  KIND=_kind(streams.dtype), num_warps=4)
    return new
