"""DeepSeek Sparse Attention on the GPU in Triton: the lightning indexer's scores and sparse MLA, and the FP8 forms
of their cache rows (glm5_offload.formats.kv_rows).

References: `indexer_scores` and `sparse_mla` in glm5_offload/model/mla.py, `quantize_keys` and
`dequantize_latent` in glm5_offload/formats/kv_rows.py; the tests compare each kernel with them. Under
TRITON_INTERPRET=1 (CPU tests) operands are cast to fp32 after loading, since the interpreter's tl.dot multiplies
bf16 bit patterns; bf16 products are exact in fp32, so both paths compute the same sums. FP8 values are loaded and
stored as bytes and converted by fp8_bits.py, so every kernel here runs on sm80/sm86 too.
"""

import torch
import triton
import triton.language as tl

from ..formats import FP8_MAX, fp8_blocks
from ..formats.kv_rows import latent_group
from . import INTERPRET
from .fp8_bits import e4m3_to_f16, f32_to_e4m3, has_fp8_dot, round_to_bf16
from .rope_triton import pairs, rotated

COMBINE_L = 128  # sparse MLA's split combine: a program's values of a head (64 heads x 4 blocks for GLM-5's 512)
DECODE_QUERIES = 4  # indexer_scores' queries up to which a call takes the decode form (and not FP8 queries)


@triton.jit
def _rope_quant_kernel(k_ptr, cos_ptr, sin_ptr, out_ptr, scale_ptr, rows_ptr, D: tl.constexpr, RD: tl.constexpr,
                       HALF: tl.constexpr, REST: tl.constexpr, INTERLEAVED: tl.constexpr, FP8_MAX: tl.constexpr):
    # one key: rope on dims [0:RD] (output [rotated firsts | rotated seconds], as rope.apply_rope), then FP8
    # into output row rows[t]
    t = tl.program_id(0)
    row = tl.load(rows_ptr + t)
    half = HALF
    i = tl.arange(0, HALF)
    x1, x2 = pairs(k_ptr + t * D, i, i < HALF, HALF, INTERLEAVED)
    r1, r2 = rotated(x1, x2, tl.load(cos_ptr + t * half + i), tl.load(sin_ptr + t * half + i), False)
    rest_i = tl.arange(0, REST)
    rest = tl.load(k_ptr + t * D + RD + rest_i).to(tl.float32)
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(r1)), tl.max(tl.abs(r2))), tl.max(tl.abs(rest)))
    scale = tl.div_rn(tl.maximum(amax, 1e-12), FP8_MAX)
    # div_rn: IEEE division, as torch's reference does (plain `/` is approximate on the GPU)
    tl.store(out_ptr + row * D + i, f32_to_e4m3(tl.div_rn(r1, scale)))  # out: e4m3 bytes
    tl.store(out_ptr + row * D + half + i, f32_to_e4m3(tl.div_rn(r2, scale)))
    tl.store(out_ptr + row * D + RD + rest_i, f32_to_e4m3(tl.div_rn(rest, scale)))
    tl.store(scale_ptr + row, scale)


def rope_quantize_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, interleaved: bool,
                       out: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor | None = None):
    """Fused: rope on keys k [N, D] (cos, sin [N, rope_dim/2] fp32), then FP8 straight into rows `rows` [N]
    (int64; default 0..N-1) of out [T, D] e4m3 and scales [T] fp32 (the indexer-key cache; reference: apply_rope,
    then kv_rows.quantize_keys)."""
    N, D = k.shape
    rows = torch.arange(N, device=k.device) if rows is None else rows
    _rope_quant_kernel[(N,)](k.contiguous(), cos.float().contiguous(), sin.float().contiguous(), out.view(torch.uint8),
                             scales, rows,
                             D=D, RD=rope_dim, HALF=rope_dim // 2, REST=D - rope_dim, INTERLEAVED=interleaved,
                             FP8_MAX=FP8_MAX)


@triton.jit
def _head_weights_kernel(x_ptr, w_ptr, out_ptr, K, scale, BLOCK_K: tl.constexpr):
    # x [S, K] (bf16 or fp32), w [N, K] fp32 -> out [S, N] fp32 = (x . w[n]) * scale; program (s, n)
    s, n = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + s.to(tl.int64) * K + k, mask=k < K, other=0.0).to(tl.float32)
        acc += x * tl.load(w_ptr + n.to(tl.int64) * K + k, mask=k < K, other=0.0)
    tl.store(out_ptr + s * tl.num_programs(1) + n, tl.sum(acc) * scale)


def head_weights(x: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
    """The indexer's head weights of decode rows x [S, K]: (x.float() @ weight.T) * scale, weight [N, K] fp32 ->
    [S, N] fp32, in one launch (reference: mla.head_weights, a cast, cuBLAS's GEMV in two kernels and the scale;
    the same products, summed in another order)."""
    S, K = x.shape
    out = torch.empty(S, weight.shape[0], dtype=torch.float32, device=x.device)
    if S:
        _head_weights_kernel[(S, weight.shape[0])](x.contiguous(), weight.contiguous(), out, K, scale,
                                                   BLOCK_K=min(2048, triton.next_power_of_2(K)))
    return out


@triton.jit
def _indexer_kernel(q_ptr, k_ptr, ks_ptr, w_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, S, T, scale, H: tl.constexpr,
                    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, KEY_BLOCKS: tl.constexpr,
                    CAST: tl.constexpr, FP8: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                    BF16: tl.constexpr):
    # q [S, H, D], keys [T, D] (FP8: e4m3 bytes with scales ks [T]), w [S, H] fp32, out [S, T] fp32;
    # one program: BLOCK_S queries x KEY_BLOCKS blocks of BLOCK_T keys, the queries loaded once. An FP8 key's
    # scale (> 0) comes out of the ReLU: relu(q . k8 s) = s relu(q . k8), so keys enter the dot exactly and
    # the score is scaled after. HALF > 0: q is not roped yet; its first 2 HALF values are rotated here by cos, sin
    # [S, HALF] fp32 as rope_triton.rope rotates them (BF16: each op rounded as torch's bf16 ops round: the same
    # values).
    pid_t, pid_s = tl.program_id(0), tl.program_id(1)
    rows = pid_s * BLOCK_S * H + tl.arange(0, BLOCK_S * H)  # (query, head) pairs, head fastest
    d = tl.arange(0, D)
    row_ok = rows < S * H
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    if HALF > 0:
        i = tl.where(d < HALF, d, d - HALF)[None, :]  # each value's pair (the rest's: unused)
        in_pairs = row_ok[:, None] & (d < 2 * HALF)[None, :]
        c = tl.load(cos_ptr + (rows // H)[:, None] * HALF + i, mask=in_pairs, other=0.0)
        sn = tl.load(sin_ptr + (rows // H)[:, None] * HALF + i, mask=in_pairs, other=0.0)
        x1, x2 = pairs(q_ptr + rows[:, None] * D, i, in_pairs, HALF, INTERLEAVED)
        first, second = rotated(x1, x2, c, sn, BF16)
        q = tl.where(d[None, :] < HALF, first, tl.where(d[None, :] < 2 * HALF, second, q.to(tl.float32)))
        q = q.to(q_ptr.dtype.element_ty)
    if CAST:
        q = q.to(tl.float32)
    w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    pos = tl.load(pos_ptr + s, mask=s < S, other=0)
    for b in range(KEY_BLOCKS):
        cols = (pid_t * KEY_BLOCKS + b) * BLOCK_T + tl.arange(0, BLOCK_T)
        k = tl.load(k_ptr + cols[:, None] * D + d[None, :], mask=(cols < T)[:, None], other=0.0)
        if FP8:
            k = e4m3_to_f16(k)  # e4m3 bytes -> values / 256, exact in bf16 and fp32 (256 goes into the scale)
        k = k.to(q.dtype)
        logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_S*H, BLOCK_T]
        weighted = tl.maximum(logits, 0.0) * w[:, None]
        scores = tl.sum(tl.reshape(weighted, (BLOCK_S, H, BLOCK_T)), axis=1)  # [BLOCK_S, BLOCK_T]
        if FP8:
            scores = scores * (tl.load(ks_ptr + cols, mask=cols < T, other=1.0) * 256.0)[None, :]
        scores = tl.where(cols[None, :] > pos[:, None], float("-inf"), scores)
        tl.store(out_ptr + s[:, None] * T + cols[None, :], scores, mask=(s[:, None] < S) & (cols[None, :] < T))


@triton.jit
def _indexer_fp8_kernel(q_ptr, k_ptr, ks_ptr, w_ptr, pos_ptr, out_ptr, S, T, scale, H: tl.constexpr, D: tl.constexpr,
                        BLOCK_S: tl.constexpr, S_PAD: tl.constexpr, BLOCK_T: tl.constexpr, KEY_BLOCKS: tl.constexpr,
                        FP8_HW: tl.constexpr, CAST: tl.constexpr):
    # The prefill form over FP8 queries and keys, laid out as flash attention is: q [S, H, D] and keys [T, D] e4m3
    # bytes (q's scales already in w [S, H] fp32, the keys' in ks [T]), out [S, T] fp32. Per block of keys:
    #   logits^T = k q^T                  [BLOCK_T, BLOCK_S*H]   (an FP8 dot on FP8_HW GPUs)
    #   scores^T = relu(logits^T) W       [BLOCK_T, S_PAD]       W[(s, h), s] = w[s, h], zero elsewhere
    # so the sum over heads is a second dot on the first one's registers (in bf16) instead of a reduction across
    # threads. Without FP8_HW (sm86) the first dot takes the values widened to fp16 by bit arithmetic (exact, each
    # / 256: the factors go into the scales); CAST (the interpreter): both dots in fp32.
    pid_t, pid_s = tl.program_id(0), tl.program_id(1)
    pairs = tl.arange(0, BLOCK_S * H)  # (query, head), head fastest
    rows = pid_s * BLOCK_S * H + pairs
    d = tl.arange(0, D)
    row_ok = rows < S * H
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=row_ok[:, None], other=0)
    if FP8_HW:
        q = q.to(tl.float8e4nv, bitcast=True)
        key_scale = 1.0
    else:
        q = e4m3_to_f16(q)
        key_scale = 65536.0
        if CAST:
            q = q.to(tl.float32)
    column = tl.arange(0, S_PAD)
    w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
    heads_sum = tl.where((pairs // H)[:, None] == column[None, :], w[:, None], 0.0)  # [BLOCK_S*H, S_PAD]
    if not CAST:
        heads_sum = heads_sum.to(tl.bfloat16)
    s = pid_s * BLOCK_S + column
    s_ok = (column < BLOCK_S) & (s < S)
    pos = tl.load(pos_ptr + s, mask=s_ok, other=0)
    for b in range(KEY_BLOCKS):
        cols = (pid_t * KEY_BLOCKS + b) * BLOCK_T + tl.arange(0, BLOCK_T)
        k = tl.load(k_ptr + cols[:, None] * D + d[None, :], mask=(cols < T)[:, None], other=0)
        if FP8_HW:
            k = k.to(tl.float8e4nv, bitcast=True)
        else:
            k = e4m3_to_f16(k).to(q.dtype)
        relu = tl.maximum(tl.dot(k, tl.trans(q), input_precision="ieee"), 0.0)  # [BLOCK_T, BLOCK_S*H]
        if not CAST:
            relu = relu.to(tl.bfloat16)
        scores = tl.dot(relu, heads_sum, input_precision="ieee")  # [BLOCK_T, S_PAD]
        scores *= (tl.load(ks_ptr + cols, mask=cols < T, other=1.0) * (scale * key_scale))[:, None]
        scores = tl.where(cols[:, None] > pos[None, :], float("-inf"), scores)
        tl.store(out_ptr + s[None, :] * T + cols[:, None], scores, mask=s_ok[None, :] & (cols[:, None] < T))


def quantize_queries(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [S, H, D] -> (e4m3 [S, H, D], weights [S, H] times each (query, head)'s scale): fp8_blocks'
    quantize_activations with a block of D; the scale comes out of the ReLU as a key's does (DeepSeek's indexer
    quantises its queries so)."""
    S, H, D = q.shape
    q8, q_scales = fp8_blocks.quantize_activations(q.reshape(S * H, D), block=D)
    return q8.view(S, H, D), weights.float() * q_scales.view(S, H)


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                   out: torch.Tensor | None = None, key_scales: torch.Tensor | None = None,
                   block_s: int | None = None, block_t: int | None = None, key_blocks: int | None = None,
                   num_warps: int | None = None, num_stages: int = 3, q_fp8: bool | None = None,
                   rope: tuple | None = None) -> torch.Tensor:
    """score[s, t] = sum_h w[s,h] relu(q[s,h] . k[t]) D^-0.5, -inf for t > positions[s].

    q [S, H, D], keys [T, D] (bf16 or fp32, or float8_e4m3fn with key_scales [T] fp32), weights [S, H] fp32,
    positions [S] int64 (on the device: a CUDA graph replays it for any position) -> [S, T] fp32. q_fp8 (FP8 keys
    only; default: a prefill, S > DECODE_QUERIES, on a GPU with FP8 tensor cores) quantises q per (query, head)
    (quantize_queries) and runs _indexer_fp8_kernel (FP8 dots; the weighted sum over heads in bf16). rope (cos, sin
    [S, rope_dim/2] fp32, rope_dim, interleaved), not with q_fp8: q is not roped yet, and the kernel ropes it as it
    loads it (rope_triton.rope's values: a decode step's indexer saves that launch). The block shapes default to
    the fastest of bench_dsa's sweeps on an H200.
    """
    fp8 = keys.dtype == torch.float8_e4m3fn
    if fp8 != (key_scales is not None):
        raise ValueError("float8_e4m3fn keys need their key_scales, and only they")
    S, H, D = q.shape
    if q_fp8 is None:
        q_fp8 = fp8 and S > DECODE_QUERIES and has_fp8_dot(q.device)
    if q_fp8 and not fp8:
        raise ValueError("q_fp8 is for float8_e4m3fn keys")
    if q_fp8 and rope is not None:
        raise ValueError("rope is for queries in their dtype, not q_fp8's")
    T = keys.shape[0]
    out = torch.empty(S, T, dtype=torch.float32, device=q.device) if out is None else out
    if q_fp8:
        q, weights = quantize_queries(q, weights)
        block_s = block_s or max(1, 256 // H)
        block_t, key_blocks = block_t or 64, key_blocks or 16
        grid = (triton.cdiv(T, block_t * key_blocks), triton.cdiv(S, block_s))
        _indexer_fp8_kernel[grid](q.view(torch.uint8), keys.contiguous().view(torch.uint8), key_scales.contiguous(),
                                  weights.contiguous(), positions.contiguous(), out, S, T, D**-0.5, H=H, D=D,
                                  BLOCK_S=block_s, S_PAD=max(16, block_s), BLOCK_T=block_t, KEY_BLOCKS=key_blocks,
                                  FP8_HW=has_fp8_dot(q.device), CAST=INTERPRET, num_warps=num_warps or 4,
                                  num_stages=num_stages)
        return out
    decode = S <= DECODE_QUERIES
    block_s = min(block_s or max(1, 256 // H), triton.next_power_of_2(S))  # BLOCK_S * H rows feed tl.dot
    block_t = block_t or 128
    key_blocks = key_blocks or (1 if decode else 4)
    grid = (triton.cdiv(T, block_t * key_blocks), triton.cdiv(S, block_s))
    scales = key_scales.contiguous() if fp8 else weights  # any fp32 tensor stands in when unused
    keys = keys.contiguous().view(torch.uint8) if fp8 else keys.contiguous()
    cos, sin, rope_dim, interleaved = rope or (weights, weights, 0, False)  # (any fp32 tensors when unused)
    if rope_dim % 2 or (rope_dim // 2) & (rope_dim // 2 - 1) or rope_dim > D:
        raise ValueError(f"indexer_scores: rope_dim {rope_dim} must be even, half a power of two, and at most {D}")
    _indexer_kernel[grid](q.contiguous(), keys, scales, weights.float().contiguous(), positions.contiguous(),
                          cos.float().contiguous(), sin.float().contiguous(), out, S, T, D**-0.5, H=H, D=D,
                          BLOCK_S=block_s, BLOCK_T=block_t, KEY_BLOCKS=key_blocks,
                          CAST=INTERPRET or q.dtype == torch.float32, FP8=fp8, HALF=rope_dim // 2,
                          INTERLEAVED=interleaved, BF16=q.dtype == torch.bfloat16, num_warps=num_warps or 8,
                          num_stages=num_stages)
    return out


@triton.jit
def _sparse_mla_kernel(qc_ptr, qr_ptr, lat_ptr, idx_ptr, range_ptr, out_ptr, lse_ptr, S, K, H, rows_per_split,
                       scale, L: tl.constexpr, R: tl.constexpr, RB: tl.constexpr, G: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, CAST: tl.constexpr, FP8: tl.constexpr,
                       RANGED: tl.constexpr, ACCUMULATE: tl.constexpr):
    # qc [S, H, L], qr [S, H, R], idx [S, K] int64 (-1 = none); latent [T, L+R] = [c | k_pe], or with FP8
    # bytes [T, L + 4L/G + 2R] = [c e4m3 | one fp32 scale per G values | k_pe bf16]. Program (s, head block,
    # split) handles the split's rows of idx[s] and writes its normalised o [split, S, H, L], lse [split, S, H].
    # RB: R rounded up to a block (>= 16; R may be 0: GLM-5.3-Flash has no rope, its dot then adds zeros).
    # RANGED: range [S, 2] int32 holds the span of idx[s] with its valid rows; the rest is not read.
    # ACCUMULATE (one split): out and lse hold the attention over other rows, merged with this one's.
    s, pid_h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    lc, lr = tl.arange(0, L), tl.arange(0, RB)
    r_ok = lr < R
    q_c = tl.load(qc_ptr + (s * H + h[:, None]) * L + lc[None, :], mask=h_ok[:, None], other=0.0)
    q_r = tl.load(qr_ptr + (s * H + h[:, None]) * R + lr[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    if CAST:
        q_c, q_r = q_c.to(tl.float32), q_r.to(tl.float32)
    out_ptrs = out_ptr + ((split * S + s) * H + h[:, None]) * L + lc[None, :]
    if ACCUMULATE:  # the online softmax goes on from the other rows' (o, lse): max lse, sum 1, accumulator o
        m = tl.load(lse_ptr + s * H + h, mask=h_ok, other=float("-inf"))
        l = tl.where(m == float("-inf"), 0.0, 1.0)
        acc = tl.load(out_ptrs, mask=h_ok[:, None], other=0.0)
    else:
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, L), tl.float32)
    k_begin = split * rows_per_split
    k_end = tl.minimum(k_begin + rows_per_split, K)
    if RANGED:
        k_begin = tl.maximum(k_begin, tl.load(range_ptr + 2 * s))
        k_end = tl.minimum(k_end, tl.load(range_ptr + 2 * s + 1))
    for k0 in tl.range(k_begin, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + s * K + kk, mask=kk < k_end, other=-1)
        ok = idx >= 0
        if FP8:
            row = lat_ptr + tl.where(ok, idx, 0).to(tl.int64) * (L + 4 * (L // G) + 2 * R)
            c8 = tl.load(row[:, None] + lc[None, :], mask=ok[:, None], other=0)  # e4m3 bytes
            # each row's L // G scales loaded once and spread over their groups in registers (a scale loaded for
            # every value took 32 us a decode call against 18, H100, 2048 rows of 656 B: bench/RESULTS.md)
            g = tl.arange(0, L // G)
            sc = tl.load((row[:, None] + L + 4 * g[None, :]).to(tl.pointer_type(tl.float32)), mask=ok[:, None],
                         other=0.0)
            c = tl.reshape(e4m3_to_f16(c8).to(tl.float32), (BLOCK_K, L // G, G)) * (sc * 256.0)[:, :, None]
            c = tl.reshape(c, (BLOCK_K, L)).to(q_c.dtype)
            pe = tl.load((row[:, None] + L + 4 * (L // G) + 2 * lr[None, :]).to(tl.pointer_type(tl.bfloat16)),
                         mask=ok[:, None] & r_ok[None, :], other=0.0).to(q_r.dtype)
        else:
            row = tl.where(ok, idx, 0).to(tl.int64) * (L + R)
            c = tl.load(lat_ptr + row[:, None] + lc[None, :], mask=ok[:, None], other=0.0)
            pe = tl.load(lat_ptr + row[:, None] + L + lr[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
            if CAST:
                c, pe = c.to(tl.float32), pe.to(tl.float32)
        scores = (tl.dot(q_c, tl.trans(c), input_precision="ieee")
                  + tl.dot(q_r, tl.trans(pe), input_precision="ieee")) * scale
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee")
        m = m_new
    empty = l == 0.0  # no valid row in this split: weight 0 when the splits are combined
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l)[:, None])
    tl.store(out_ptrs, out, mask=h_ok[:, None])
    tl.store(lse_ptr + (split * S + s) * H + h, tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l))),
             mask=h_ok)


@triton.jit
def _combine_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, SH, splits, SPLITS: tl.constexpr, L: tl.constexpr,
                    BLOCK_L: tl.constexpr, ACCUMULATE: tl.constexpr):
    # part_out [splits, S*H, L], part_lse [splits, S*H] -> out [S*H, L], lse [S*H]; one program per (s, head) and
    # BLOCK_L of the L values (the first block's program writes lse); SPLITS: splits rounded up to a power of two;
    # ACCUMULATE: out and lse hold another row set's, merged in
    r, block = tl.program_id(0), tl.program_id(1)
    sp, lc = tl.arange(0, SPLITS), block * BLOCK_L + tl.arange(0, BLOCK_L)
    lse = tl.load(part_lse_ptr + sp * SH + r, mask=sp < splits, other=float("-inf"))  # -inf: split without a row
    prior = tl.load(lse_ptr + r) if ACCUMULATE else float("-inf")
    top = tl.maximum(tl.max(lse, axis=0), prior)
    top = tl.where(top == float("-inf"), 0.0, top)  # no row in any part (a key slab's): o 0, lse -inf
    w, w_prior = tl.exp(lse - top), tl.exp(prior - top)
    total = tl.sum(w, axis=0) + w_prior
    o = tl.load(part_out_ptr + (sp[:, None] * SH + r) * L + lc[None, :], mask=(sp < splits)[:, None], other=0.0)
    o = tl.sum(o * w[:, None], axis=0)
    if ACCUMULATE:
        o += tl.load(out_ptr + r * L + lc) * w_prior
    tl.store(out_ptr + r * L + lc, o / tl.where(total == 0.0, 1.0, total))
    if block == 0:  # (ACCUMULATE takes one block: no other program reads the prior lse this overwrites)
        tl.store(lse_ptr + r, top + tl.log(total))


@triton.jit
def _fp8_latent_to_bf16_kernel(src_ptr, dst_ptr, T, L: tl.constexpr, R: tl.constexpr, RB: tl.constexpr,
                               G: tl.constexpr, BLOCK_T: tl.constexpr):
    # FP8 rows [T, L + 4L/G + 2R] bytes -> bf16 [T, L+R]: the values _sparse_mla_kernel's FP8 path computes with
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < T
    lc, lr = tl.arange(0, L), tl.arange(0, RB)
    r_ok = lr < R
    row = src_ptr + t.to(tl.int64) * (L + 4 * (L // G) + 2 * R)
    c8 = tl.load(row[:, None] + lc[None, :], mask=ok[:, None], other=0)  # e4m3 bytes
    sc = tl.load((row[:, None] + L + 4 * (lc[None, :] // G)).to(tl.pointer_type(tl.float32)), mask=ok[:, None],
                 other=0.0) * 256.0
    pe = tl.load((row[:, None] + L + 4 * (L // G) + 2 * lr[None, :]).to(tl.pointer_type(tl.bfloat16)),
                 mask=ok[:, None] & r_ok[None, :], other=0.0)
    dst = dst_ptr + t.to(tl.int64)[:, None] * (L + R)
    tl.store(dst + lc[None, :], (e4m3_to_f16(c8).to(tl.float32) * sc).to(tl.bfloat16), mask=ok[:, None])
    tl.store(dst + L + lr[None, :], pe, mask=ok[:, None] & r_ok[None, :])


@triton.jit
def _quantize_latent_kernel(rows_ptr, pe_ptr, cos_ptr, sin_ptr, out_ptr, T, stride, pe_stride, L: tl.constexpr,
                            R: tl.constexpr, RB: tl.constexpr, G: tl.constexpr, BLOCK_T: tl.constexpr,
                            PE_ROUND: tl.constexpr, FP8_MAX: tl.constexpr, HALF: tl.constexpr,
                            INTERLEAVED: tl.constexpr, ROPE_BF16: tl.constexpr):
    # latent rows [T, L(+R)] (rows `stride` apart; bf16 or fp32) -> their FP8 form [T, L + 4L/G + 2R] bytes:
    # c as e4m3 with one fp32 scale per G values (amax / FP8_MAX), k_pe as bf16 (PE_ROUND: from fp32, by bits).
    # HALF > 0: k_pe is read from pe [T, R = 2 HALF] (rows pe_stride apart) and roped first, as rope_triton ropes it
    # (cos/sin [T, HALF] fp32; ROPE_BF16: each op rounded as torch's bf16 ops round)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < T
    src = rows_ptr + t.to(tl.int64)[:, None] * stride
    row = out_ptr + t.to(tl.int64) * (L + 4 * (L // G) + 2 * R)
    dst = row[:, None]
    j = tl.arange(0, G)[None, :]
    for g in tl.static_range(L // G):
        c = tl.load(src + g * G + j, mask=ok[:, None], other=0.0).to(tl.float32)
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(c), axis=1), 1e-12), FP8_MAX)  # IEEE division, as torch's
        scale = tl.where(tl.max((c != c).to(tl.int32), axis=1) > 0, float("nan"), scale)  # amax's NaN, as torch's
        tl.store(dst + g * G + j, f32_to_e4m3(tl.div_rn(c, scale[:, None])), mask=ok[:, None])
        tl.store((row + L + 4 * g).to(tl.pointer_type(tl.float32)), scale, mask=ok)
    pe_dst = (dst + L + 4 * (L // G)).to(tl.pointer_type(tl.bfloat16))
    if HALF > 0:
        i = tl.arange(0, HALF)[None, :]
        c = tl.load(cos_ptr + t[:, None] * HALF + i, mask=ok[:, None], other=0.0)
        sn = tl.load(sin_ptr + t[:, None] * HALF + i, mask=ok[:, None], other=0.0)
        x1, x2 = pairs(pe_ptr + t.to(tl.int64)[:, None] * pe_stride, i, ok[:, None], HALF, INTERLEAVED)
        first, second = rotated(x1, x2, c, sn, ROPE_BF16)
        if PE_ROUND:
            first, second = round_to_bf16(first), round_to_bf16(second)
        tl.store(pe_dst + i, first.to(tl.bfloat16), mask=ok[:, None])
        tl.store(pe_dst + HALF + i, second.to(tl.bfloat16), mask=ok[:, None])
    else:
        lr = tl.arange(0, RB)[None, :]
        r_ok = ok[:, None] & (lr < R)
        pe = tl.load(src + L + lr, mask=r_ok, other=0.0).to(tl.float32)
        if PE_ROUND:
            pe = round_to_bf16(pe)
        tl.store(pe_dst + lr, pe.to(tl.bfloat16), mask=r_ok)


def quantize_latent(rows: torch.Tensor, kv_lora_rank: int, rope: tuple | None = None) -> torch.Tensor:
    """Latent rows [T, L+R] (bf16 or fp32) -> their FP8 form [T, L + 4L/G + 2R] uint8, in one kernel (reference:
    kv_rows.quantize_latent, some ten torch kernels; bit-exact with it on the CPU, where torch divides by IEEE
    division: on the GPU its scales came out one ulp off this kernel's at times).
    rope: (k_pe [T, R] (its last dim contiguous; rows is then c [T, L] alone), cos, sin [T, R/2] fp32, interleaved):
    k_pe roped in the same launch, as rope_triton.rope ropes it (no rope and no cat of their own)."""
    T, L = rows.shape[0], kv_lora_rank
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rope is None:
        pe, cos, sin, interleaved, R = rows, rows, rows, False, rows.shape[1] - L
    else:
        pe, cos, sin, interleaved = rope
        pe = pe if pe.stride(-1) == 1 else pe.contiguous()
        cos, sin, R = cos.float().contiguous(), sin.float().contiguous(), pe.shape[1]
        if R % 2 or (R // 2) & (R // 2 - 1) or rows.shape[1] != L:
            raise ValueError(f"quantize_latent: c of {rows.shape[1]} values (want {L}) or a rope part of {R} "
                             "(want 2 x a power of two)")
    G = latent_group(L)
    out = torch.empty(T, L + 4 * (L // G) + 2 * R, dtype=torch.uint8, device=rows.device)
    if T:
        block_t = 256 if INTERPRET else 4
        _quantize_latent_kernel[(triton.cdiv(T, block_t),)](
            rows, pe, cos, sin, out, T, rows.stride(0), pe.stride(0), L=L, R=R, RB=rope_block(R), G=G,
            BLOCK_T=block_t, PE_ROUND=pe.dtype != torch.bfloat16, FP8_MAX=FP8_MAX, HALF=0 if rope is None else R // 2,
            INTERLEAVED=interleaved, ROPE_BF16=pe.dtype == torch.bfloat16)
    return out


def rope_block(rope_dim: int) -> int:
    """The rope part's block width in the kernels: a power of two >= 16 (tl.dot's least), 16 for no rope."""
    return triton.next_power_of_2(max(rope_dim, 16))


def fp8_latent_to_bf16(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int) -> torch.Tensor:
    """FP8 latent rows [T, L + 4L/G + 2R] uint8 -> bf16 [T, L+R] (reference: kv_rows.dequantize_latent)."""
    T, L, R = rows.shape[0], kv_lora_rank, rope_dim
    out = torch.empty(T, L + R, dtype=torch.bfloat16, device=rows.device)
    block_t = 256 if INTERPRET else 16
    _fp8_latent_to_bf16_kernel[(triton.cdiv(T, block_t),)](rows.contiguous(), out, T, L=L, R=R, RB=rope_block(R),
                                                             G=latent_group(L), BLOCK_T=block_t)
    return out


def sparse_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor,
               kv_lora_rank: int, scale: float, out: torch.Tensor | None = None,
               lse: torch.Tensor | None = None, splits: int | None = None, block_h: int | None = None,
               block_k: int | None = None, num_warps: int = 8, num_stages: int | None = None,
               convert_fp8: bool | None = None, span: torch.Tensor | None = None,
               accumulate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-form sparse MLA: q_lat [S, H, L], q_pe [S, H, R], indices [S, K] (-1 = none; each row at least
    one valid), latent [T, L+R] = [c | k_pe] (bf16/fp32) or its FP8 rows [T, L + 4L/128 + 2R] uint8 (656 B for
    GLM-5, see kv_rows.quantize_latent) -> (o [S, H, L] fp32, lse [S, H] fp32).

    Few queries (decode) split the selected rows over several programs, flash-decoding style, and a second
    kernel combines the splits by their log-sum-exp. FP8 rows are converted in the kernel where they are read;
    when the queries read at least as many rows as there are (prefill chunks; convert_fp8 None), every row is
    converted to bf16 once instead (the same values) and the bf16 kernel reads each row once for 64 heads. The
    block shapes default to the fastest of bench_dsa's sweep on an H200. span [S, 2] int32: the run of each row of
    indices that holds its valid ones (the tiered cache's key slabs: rows sorted, -1 outside the slab); only that
    run is read. accumulate: out and lse hold the attention over other rows (as this returns it); they become the
    attention over both (model.mla.merge_attention's merge, in the kernel's last step)."""
    S, H, L = q_lat.shape
    R, K = q_pe.shape[-1], indices.shape[1]
    fp8 = latent.dtype == torch.uint8
    G = latent_group(L)
    assert L == kv_lora_rank and latent.shape[1] == (L + 4 * (L // G) + 2 * R if fp8 else L + R)
    if fp8 and (convert_fp8 if convert_fp8 is not None else S * K >= latent.shape[0]):
        latent, fp8 = fp8_latent_to_bf16(latent, L, R), False
    block_k = block_k or (128 if INTERPRET else 64)
    # one query: 16 heads a program (more programs); several: up to 64 (each row read once for all heads);
    # FP8 rows need more shared memory for their conversion: 32
    block_h = block_h or (16 if S == 1 or H < 64 else 32 if fp8 else 64)
    num_stages = num_stages or (3 if block_h <= 16 else 2)  # 64 heads x 3 stages overflow shared memory
    head_blocks = triton.cdiv(H, block_h)
    # enough programs to fill the GPU: split the rows when queries x head blocks are few
    if splits is None:
        splits = 1 if INTERPRET else max(1, min(triton.cdiv(K, block_k), 264 // (S * head_blocks)))
    rows_per_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    splits = triton.cdiv(K, rows_per_split)
    cast = INTERPRET or latent.dtype == torch.float32
    dtype = torch.float32 if cast else torch.bfloat16 if fp8 else latent.dtype
    if accumulate and (out is None or lse is None):
        raise ValueError("accumulate merges into the out and lse given")
    out = torch.empty(S, H, L, dtype=torch.float32, device=q_lat.device) if out is None else out
    lse = torch.empty(S, H, dtype=torch.float32, device=q_lat.device) if lse is None else lse
    part_out = torch.empty(splits, S, H, L, dtype=torch.float32, device=q_lat.device) if splits > 1 else out[None]
    part_lse = torch.empty(splits, S, H, dtype=torch.float32, device=q_lat.device) if splits > 1 else lse[None]
    _sparse_mla_kernel[(S, head_blocks, splits)](
        q_lat.to(dtype).contiguous(), q_pe.to(dtype).contiguous(), latent.contiguous(), indices.contiguous(),
        indices if span is None else span.contiguous(),
        part_out, part_lse, S, K, H, rows_per_split, scale, L=L, R=R, RB=rope_block(R), G=G, BLOCK_H=block_h,
        BLOCK_K=block_k, CAST=cast, FP8=fp8, RANGED=span is not None, ACCUMULATE=accumulate and splits == 1,
        num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        block_l = L if accumulate else min(L, COMBINE_L)
        _combine_kernel[(S * H, L // block_l)](part_out, part_lse, out, lse, S * H, splits,
                                               SPLITS=triton.next_power_of_2(splits), L=L, BLOCK_L=block_l,
                                               ACCUMULATE=accumulate)
    return out, lse
