"""GPU linear layers y = x W^T with W kept in 8 or 4 bits, in Triton.

- fp8: W8 [N, K] float8_e4m3fn with one fp32 scale per 128 x 128 block (formats.fp8_blocks: the form GLM-5-FP8 and
  DeepSeek-V3.2 are released in);
- int4: W [N, K/2] uint8 with one fp32 scale per `group` inputs of a row (formats.int_groups: the nibble layout of
  the CPU experts; w4a16).

One kernel per format serves decode and prefill (int4 has a second for one row): a program computes a BLOCK_M x
BLOCK_N tile of y over its share of the inputs. For decode (M <= 32) the inputs are split over programs so every SM
streams weights (bandwidth-bound: the packed weights are read once); each program writes its partial tile, and the
last of a tile's programs to arrive (an atomic counter per tile) adds the partials in a fixed order and writes y: one
launch, and a CUDA graph's replay equals eager. For one row (M = 1) products are summed without a dot, into a 2-D
accumulator reduced once at the end; int4's one-row kernel (_int4_gemv_kernel) reads the weights as 32-bit words and
spends about 3.5 instructions a weight on them (the dot kernel's M = 1 form spent 6.6: ALU-bound below half the HBM
bandwidth on an H200). Prefill takes big tiles. Weights are loaded as bytes and widened by bit arithmetic to bf16
(e4m3 and int4 values are exact in bf16), so the kernels run on any GPU Triton supports (sm80, sm86 included). Where
the GPU has FP8 tensor cores (sm89, sm90, sm120) a prefill's activations are quantised to e4m3 per 128 inputs of a
row (as DeepSeek's inference does; `quantize_activations`, one kernel, bit-exact with fp8_blocks') and the fp8 kernel
takes FP8 dots, or on sm90 cuBLAS's blockwise FP8 GEMM does (`fp8_blockwise_linear`).

References: `linear_reference` (the weights and activations dequantised, x W^T in fp32); the tests hold each path to
it on the CPU (Triton's interpreter) and on the GPU.
"""

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..formats import FP8_MAX, fp8_blocks, int_groups
from . import INTERPRET, programs_wanted
from .fp8_bits import e4m3_to_f16, f32_to_e4m3, has_fp8_dot

DECODE_ROWS = 32  # up to this many rows of x: the split GEMV
BLOCK = 128  # the fp8 kernel's blocks: a 128 x 128 scale block per k step
# tiles and launch settings (block_n divides 128), from bench/bench_linear.py's sweep on an H200
# loop_stages: a one-row fp8 program's loop pipelined by Triton when it runs at least long_loop iterations (H200,
# GLM-5's shapes: o_proj's 13 iterations 73.5 -> 77.1% of HBM; the others' 1-4 lose 0.3-13 points; 2 stages lose
# everywhere)
DECODE_TILE = {"block_n": 64, "num_warps": 4, "num_stages": 2, "step": 2, "vector": True, "loop_stages": 3,
               "long_loop": 8}
INT4_DECODE_TILE = {"block_n": 64, "num_warps": 4, "num_stages": 2, "step": 2}  # ditto, int4 for 2-32 rows
INT4_GEMV_TILE = {"block_n": 64, "num_warps": 4, "num_stages": 2, "step": 2, "oversplit": 1}  # int4, one row
MAGIC_BITS = (0x41800000, 0x3F800000)  # 16.0 and 1.0 as fp32 bits (_int4_gemv_kernel's magic_16, magic_1)
MAX_TILES = 4096  # decode tiles that can be split (more tiles than programs wanted are never split)
PREFILL_TILE = {"block_m": 64, "block_n": 128, "num_warps": 8, "num_stages": 3}


@triton.jit
def _fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, M, N, K, blocks_per_split,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT_FP8: tl.constexpr, FP8_HW: tl.constexpr,
                CAST: tl.constexpr, STEP: tl.constexpr, VECTOR: tl.constexpr, LOOP_STAGES: tl.constexpr):
    # x [M, K] (bf16/fp32; ACT_FP8: e4m3 bytes with scales xs [KB, M] fp32, quantize_activations'), w [N, K] e4m3
    # bytes, ws [NB, KB] fp32 (KB = cdiv(K, 128)); out [M, N]; part [splits, M, N] fp32 and count [tiles] int32
    # (zero) when split (_write_tile). BLOCK_N divides 128.
    # FP8_HW: the GPU converts e4m3 itself and has FP8 tensor cores (sm89+); else bit arithmetic (x 1/256).
    # STEP 128-blocks of inputs per iteration; VECTOR (M = 1): products summed without a dot. LOOP_STAGES (None:
    # Triton's default, which pipelines only the loads that feed a dot): the loop's loads issued that many
    # iterations ahead (cp.async into shared memory), so a long one-row loop keeps HBM reads in flight while it
    # computes.
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    kk = tl.arange(0, 128)
    KB = tl.cdiv(K, 128)
    nb = pid_n * BLOCK_N // 128
    kb0 = split * blocks_per_split
    kb1 = tl.minimum(kb0 + blocks_per_split, KB)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * K
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_vector = tl.zeros((BLOCK_N, 128), tl.float32)
    for kb_first in tl.range(kb0, kb1, STEP, num_stages=LOOP_STAGES):
        for j in tl.static_range(STEP):
            kb = kb_first + j
            k = kb * 128 + kk
            k_ok = (k < K) & (kb < kb1)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            w_scale = tl.load(ws_ptr + nb * KB + kb, mask=kb < kb1, other=0.0)
            if VECTOR:
                x = tl.load(x_ptr + k, mask=k_ok, other=0).to(tl.float32)
                if FP8_HW:
                    b = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                else:
                    b = e4m3_to_f16(w).to(tl.float32)
                    w_scale = w_scale * 256.0
                acc_vector += b * (x * w_scale)[None, :]
            else:
                x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
                if ACT_FP8:
                    x_scale = tl.load(xs_ptr + kb * M + m, mask=m_ok & (kb < kb1), other=0.0)
                    if FP8_HW:
                        d = tl.dot(x.to(tl.float8e4nv, bitcast=True), tl.trans(w.to(tl.float8e4nv, bitcast=True)))
                        acc += d * (x_scale[:, None] * w_scale)
                    else:  # both widened: each carries a factor 1/256
                        a, b = e4m3_to_f16(x).to(tl.float32), e4m3_to_f16(w).to(tl.float32)
                        d = tl.dot(a, tl.trans(b), input_precision="ieee")
                        acc += d * (x_scale[:, None] * (w_scale * 65536.0))
                else:
                    if FP8_HW:
                        b = w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
                    else:
                        b = e4m3_to_f16(w).to(tl.bfloat16)
                        w_scale = w_scale * 256.0
                    if CAST:
                        d = tl.dot(x.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
                    else:
                        d = tl.dot(x, tl.trans(b))
                    acc += d * w_scale
    if VECTOR:
        acc = acc + tl.sum(acc_vector, axis=1)[None, :]  # row 0 (the only one)
    _write_tile(acc, out_ptr, part_ptr, count_ptr, m, n, M, N)


@triton.jit
def _int4_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, M, N, K, groups_per_split, G: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAST: tl.constexpr, STEP: tl.constexpr):
    # x [M, K], w [N, K/2] bytes (in group g of a row, byte j holds input gG + j in its low nibble and gG + G/2 + j in
    # its high one), ws [N, K/G] fp32; out, part, count as _fp8_kernel's. STEP groups per iteration.
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    j = tl.arange(0, G // 2)
    n_groups = K // G
    g0 = split * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, n_groups)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * K
    w_rows = w_ptr + n.to(tl.int64)[:, None] * (K // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    steps = tl.arange(0, STEP)
    for g_first in range(g0, g1, STEP):
        # the STEP groups' scales of each row in one load (a row's are adjacent; loaded one by one, each would take
        # a memory sector of its own)
        scales = tl.load(ws_ptr + n[:, None] * n_groups + g_first + steps[None, :],
                         mask=n_ok[:, None] & (g_first + steps < g1)[None, :], other=0.0)
        for i in tl.static_range(STEP):
            g = g_first + i
            g_ok = g < g1
            p = tl.load(w_rows + g * (G // 2) + j[None, :], mask=n_ok[:, None] & g_ok, other=0).to(tl.int32)
            w_scale = tl.sum(tl.where(steps[None, :] == i, scales, 0.0), axis=1)
            low, high = (p & 15) - 8, (p >> 4) - 8
            x_low = tl.load(x_rows + g * G + j[None, :], mask=m_ok[:, None] & g_ok, other=0)
            x_high = tl.load(x_rows + g * G + G // 2 + j[None, :], mask=m_ok[:, None] & g_ok, other=0)
            if CAST:
                d = tl.dot(x_low.to(tl.float32), tl.trans(low.to(tl.float32)), input_precision="ieee")
                d += tl.dot(x_high.to(tl.float32), tl.trans(high.to(tl.float32)), input_precision="ieee")
            else:
                d = tl.dot(x_low, tl.trans(low.to(tl.bfloat16)))
                d += tl.dot(x_high, tl.trans(high.to(tl.bfloat16)))
            acc += d * w_scale[None, :]
    _write_tile(acc, out_ptr, part_ptr, count_ptr, m, n, M, N)


@triton.jit
def _nibbles(t, word, magic_16, magic_1, x_16, x_1, EXACT: tl.constexpr):
    # t plus the products of the nibbles at bits 12-15 and 16-19 of `word` with their inputs x_16, x_1 [W]: OR'd into
    # the mantissas of 16.0 and 1.0 (magic_16/magic_1: their bits, as runtime values so that AND and OR fuse into one
    # LOP3; two immediates cannot) they read 16 + v/128 and 1 + v/128, exactly. EXACT subtracts the offsets (also
    # exact, leaving (v - 8)/128); else the caller starts its sum from the offsets' products.
    a_16 = ((word & 0xF000) | magic_16).to(tl.float32, bitcast=True)
    a_1 = ((word & 0xF0000) | magic_1).to(tl.float32, bitcast=True)
    if EXACT:
        a_16 -= 16.0625
        a_1 -= 1.0625
    return t + a_16 * x_16[None, :] + a_1 * x_1[None, :]


@triton.jit
def _int4_gemv_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, M, N, K, groups_per_split, magic_16,
                      magic_1, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAST: tl.constexpr,
                      STEP: tl.constexpr, EXACT: tl.constexpr):
    # One row of x [1, K] times int4 W: w as int32 words [N, K/8] (word j of a group = bytes 4j..4j+3 of
    # _int4_kernel's layout: inputs 4j + c in the low nibbles, G/2 + 4j + c in the high ones), ws [N, K/G] fp32; out,
    # part, count as _fp8_kernel's. Bandwidth-bound only if each weight costs few instructions: a word's 8 nibbles
    # come to bits 12-19 by 3 shifts (none, << 8, >> 8, a rotation by 16) and each becomes a float in one LOP3
    # (_nibbles), then one FMA. A word's sum t starts at minus the offsets' products (row-independent, once per
    # group), so t = sum (v - 8)/128 x; its rounding is relative to the offsets' terms (16 per hi nibble), about
    # 2^-13 of the result: far below bf16's rounding of the output, too coarse for fp32 x, which takes EXACT.
    # Each program waits on a group's words, then computes: issuing the reads ahead (the next group's words held in
    # registers, or the loop pipelined by Triton) was 1-5 points of HBM slower on the H200 (bench/RESULTS.md).
    W: tl.constexpr = G // 8
    pid_n, split = tl.program_id(1), tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    j = tl.arange(0, W)
    n_groups = K // G
    g0 = split * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, n_groups)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * (K // 8) + j[None, :]
    acc = tl.zeros((BLOCK_N, W), tl.float32)
    for g_first in range(g0, g1, STEP):
        for i in tl.static_range(STEP):
            g = g_first + i
            g_ok = g < g1
            w = tl.load(w_rows + g * W, mask=n_ok[:, None] & g_ok, other=0).to(tl.uint32, bitcast=True)
            # one scale a row, as a [BLOCK_N] vector (loaded as [BLOCK_N, W] broadcast along the words, it set the
            # layout of the words' load too: a row a thread, uncoalesced, 18% of the H200's bandwidth instead of 53%)
            scale = tl.load(ws_ptr + n * n_groups + g, mask=n_ok & g_ok, other=0.0)
            x = x_ptr + g * G + 4 * j
            lo0 = tl.load(x, mask=g_ok, other=0).to(tl.float32)
            lo1 = tl.load(x + 1, mask=g_ok, other=0).to(tl.float32)
            lo2 = tl.load(x + 2, mask=g_ok, other=0).to(tl.float32)
            lo3 = tl.load(x + 3, mask=g_ok, other=0).to(tl.float32)
            hi0 = tl.load(x + G // 2, mask=g_ok, other=0).to(tl.float32)
            hi1 = tl.load(x + G // 2 + 1, mask=g_ok, other=0).to(tl.float32)
            hi2 = tl.load(x + G // 2 + 2, mask=g_ok, other=0).to(tl.float32)
            hi3 = tl.load(x + G // 2 + 3, mask=g_ok, other=0).to(tl.float32)
            t = tl.zeros((BLOCK_N, W), tl.float32)
            if not EXACT:
                t -= (16.0625 * (hi0 + hi1 + hi2 + hi3) + 1.0625 * (lo0 + lo1 + lo2 + lo3))[None, :]
            t = _nibbles(t, w, magic_16, magic_1, hi1, lo2, EXACT)  # nibbles 3, 4
            t = _nibbles(t, w << 8, magic_16, magic_1, hi0, lo1, EXACT)  # 1, 2
            t = _nibbles(t, w >> 8, magic_16, magic_1, hi2, lo3, EXACT)  # 5, 6
            t = _nibbles(t, (w << 16) | (w >> 16), magic_16, magic_1, hi3, lo0, EXACT)  # 7, 0
            acc += t * scale[:, None]
    y = tl.sum(acc, axis=1) * 128.0
    _write_tile(y[None, :], out_ptr, part_ptr, count_ptr, tl.arange(0, BLOCK_M), n, M, N)


@triton.jit
def _write_tile(acc, out_ptr, part_ptr, count_ptr, m, n, M, N):
    # One split (grid dim 2 of size 1): acc is the tile of out. Several: acc goes to part[split]; the tile's last
    # program to arrive (count[tile], reset to 0 after) adds part[0..splits) in order and writes out.
    ok = (m < M)[:, None] & (n < N)[None, :]
    tile_offsets = m.to(tl.int64)[:, None] * N + n[None, :]
    splits = tl.num_programs(2)
    if splits == 1:
        tl.store(out_ptr + tile_offsets, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + tl.program_id(2) * M * N + tile_offsets, acc, mask=ok)
        tl.debug_barrier()  # every thread's partial written before the arrival is counted
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == splits - 1:
            total = tl.zeros(acc.shape, tl.float32)
            for i in range(0, splits):
                total += tl.load(part_ptr + i * M * N + tile_offsets, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + tile_offsets, total.to(out_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit
def _quantize_activations_kernel(x_ptr, out_ptr, scale_ptr, M, K, rows, BLOCK_M: tl.constexpr,
                                 FP8_MAX: tl.constexpr, FP8_HW: tl.constexpr):
    # x [M, K] -> out [rows, K] e4m3 bytes and scales [KB, rows] fp32 (column-major [rows, KB], as cuBLAS takes them;
    # rows M and up: x's zeros):
    # one program: BLOCK_M rows x one 128-block of inputs (fp8_blocks.quantize_activations). Bit-exact with torch's
    # x / scale cast to e4m3. FP8_HW (a GPU with FP8 conversions): the GPU's conversion (two values an instruction,
    # saturating, to nearest even, as torch's cast), and the division by one reciprocal a row and two fused
    # multiply-adds a value (Markstein: with r = 1/scale correctly rounded and q0 = x r, q0 + (x - scale q0) r rounds
    # to x / scale exactly; outside a quotient below 2^-126, which e4m3 takes to 0 either way) instead of an IEEE
    # division each (ten instructions); the interpreter's fma is not fused, so it takes the division and the bits.
    pid_m, kb = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k = kb * 128 + tl.arange(0, 128)
    ok = (m < rows)[:, None] & (k < K)[None, :]
    offsets = m.to(tl.int64)[:, None] * K + k[None, :]
    x = tl.load(x_ptr + offsets, mask=ok & (m < M)[:, None], other=0.0).to(tl.float32)
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), FP8_MAX)  # IEEE division, as torch's
    if FP8_HW:
        r = tl.div_rn(1.0, scale)[:, None]
        q0 = x * r
        error = tl.fma(-scale[:, None], q0, x)  # exact
        # an infinite scale (an infinite x) leaves error NaN: q0 is then torch's quotient (0, or NaN for x infinite)
        x8 = tl.where(error == error, tl.fma(error, r, q0), q0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        x8 = f32_to_e4m3(tl.div_rn(x, scale[:, None]))
    tl.store(out_ptr + offsets, x8, mask=ok)
    tl.store(scale_ptr + kb * rows + m, scale, mask=m < rows)


@triton.jit
def _fp8_dequantize_kernel(w_ptr, ws_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr):
    # w [N, K] e4m3 bytes, ws [NB, KB] fp32 -> out [N, K]; one program: BLOCK_N rows x 128 inputs
    pid_n, kb = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = kb * 128 + tl.arange(0, 128)
    ok = (n < N)[:, None] & (k < K)[None, :]
    w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=ok, other=0)
    scale = tl.load(ws_ptr + (pid_n * BLOCK_N // 128) * tl.cdiv(K, 128) + kb) * 256.0
    out = e4m3_to_f16(w).to(tl.float32) * scale
    tl.store(out_ptr + n.to(tl.int64)[:, None] * K + k[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


def _tile_counters(device: torch.device) -> torch.Tensor:
    """Arrival counters of split decode tiles (each left at 0 by the tile's last program), one set per stream of a
    GPU: split kernels on two streams run at once (a decode step's query beside its indexer, model/mla.py)."""
    return _counters(device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)


@functools.cache
def _counters(device: torch.device, stream: int) -> torch.Tensor:
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def _launch(kernel, x, steps: int, N: int, args: tuple, tile: dict | None = None, vector: bool = False,
            **meta) -> torch.Tensor:
    """Run `kernel` over the tiles of y [M, N] (`steps` k steps in all), split over the inputs for decode; y in x's
    dtype. tile: the decode tile (default DECODE_TILE; its "oversplit": programs_wanted times that many programs);
    vector: one row a program (M = 1)."""
    M = x.shape[0]
    decode = M <= DECODE_ROWS
    tile = (tile or DECODE_TILE) if decode else PREFILL_TILE
    block_m = 1 if vector else max(16, triton.next_power_of_2(M)) if decode else tile["block_m"]
    block_n = tile["block_n"]
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    programs = programs_wanted(x.device) * tile.get("oversplit", 1)
    per_split = triton.cdiv(steps, max(1, min(steps, programs // tiles))) if decode else steps
    splits = triton.cdiv(steps, per_split)
    if splits > 1 and tiles > MAX_TILES:
        raise ValueError(f"{tiles} tiles split over the inputs: more than the {MAX_TILES} counters")
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    part = torch.empty(splits, M, N, device=x.device, dtype=torch.float32) if splits > 1 else out
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), splits)
    cast = INTERPRET or x.dtype == torch.float32
    if meta.get("LOOP_STAGES") and triton.cdiv(per_split, meta["STEP"]) < tile["long_loop"]:
        meta["LOOP_STAGES"] = None  # a short loop loses more to the pipeline's start than it gains
    kernel[grid](*args, out, part, _tile_counters(x.device), M, N, x.shape[1], per_split, BLOCK_M=block_m,
                 BLOCK_N=block_n, CAST=cast, num_warps=tile["num_warps"], num_stages=tile["num_stages"], **meta)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
               fp8_dot: bool | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or fp32) @ W^T for W8 [N, K] float8_e4m3fn with scales [cdiv(N,128), cdiv(K,128)] fp32 -> [M, N]
    in x's dtype. fp8_dot (default: a bf16 prefill on a GPU with FP8 tensor cores) quantises x per 128 inputs."""
    M, K = x.shape
    N = weight.shape[0]
    if fp8_dot is None:
        fp8_dot = M > DECODE_ROWS and x.dtype == torch.bfloat16 and has_fp8_dot(x.device)
    if fp8_dot:
        x_in, x_scales = quantize_activations(x)  # the scales' [KB, M] buffer (a transposed view of it)
        x_in = x_in.view(torch.uint8)
    else:
        x_in, x_scales = x.contiguous(), scales  # any fp32 tensor stands in for the unused scales
    vector = M == 1 and DECODE_TILE["vector"] and not fp8_dot
    return _launch(_fp8_kernel, x, triton.cdiv(K, BLOCK), N, (x_in, x_scales, weight.view(torch.uint8), scales),
                   vector=vector, ACT_FP8=fp8_dot, FP8_HW=has_fp8_dot(x.device),
                   STEP=DECODE_TILE["step"] if M <= DECODE_ROWS else 1, VECTOR=vector,
                   LOOP_STAGES=DECODE_TILE["loop_stages"] if vector else None)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] (bf16 or fp32) @ W^T for W in int_groups' int4 form (packed [N, K/2] uint8, scales [N, K/group]
    fp32) -> [M, N] in x's dtype."""
    M, K = x.shape
    if K % group:
        raise ValueError(f"group size {group} does not divide the {K} inputs")
    if M == 1:
        return _launch(_int4_gemv_kernel, x, K // group, packed.shape[0], (x.contiguous(), packed.view(torch.int32),
                       scales), INT4_GEMV_TILE, vector=True, magic_16=MAGIC_BITS[0], magic_1=MAGIC_BITS[1], G=group,
                       STEP=INT4_GEMV_TILE["step"], EXACT=x.dtype == torch.float32)
    decode = M <= DECODE_ROWS
    return _launch(_int4_kernel, x, K // group, packed.shape[0], (x.contiguous(), packed, scales), INT4_DECODE_TILE,
                   G=group, STEP=INT4_DECODE_TILE["step"] if decode else 1)


def quantize_activations(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x8 [rows, K] float8_e4m3fn, scales [rows, cdiv(K, 128)] fp32, column-major): fp8_blocks'
    quantize_activations in one kernel; rows (default M): past M, zero rows quantised."""
    M, K = x.shape
    rows = rows or M
    out = torch.empty(rows, K, dtype=torch.uint8, device=x.device)
    scales = torch.empty(triton.cdiv(K, BLOCK), rows, dtype=torch.float32, device=x.device)
    # 32 rows a program: 1.0-1.5x faster than 16 on 4096 x 2048-16384 (H200, RESULTS.md 2026-12-04, session 27)
    _quantize_activations_kernel[(triton.cdiv(rows, 32), triton.cdiv(K, BLOCK))](x.contiguous(), out, scales, M, K,
                                                                                 rows, BLOCK_M=32, FP8_MAX=FP8_MAX,
                                                                                 FP8_HW=has_fp8_dot(x.device))
    return out.view(torch.float8_e4m3fn), scales.t()


def _blockwise_mm(x8: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    return F.scaled_mm(x8, weight.t(), x_scales, F.ScalingType.BlockWise1x128, scales.t(),
                       F.ScalingType.BlockWise128x128, output_dtype=dtype)


@functools.cache
def has_blockwise_fp8_mm(device: torch.device) -> bool:
    """torch's F.scaled_mm with DeepSeek's block scales (x per 1 x 128, W per 128 x 128) on this GPU: cuBLAS >= 12.9
    has them for sm90 and sm100 (tried once, on 128 x 512)."""
    if INTERPRET or device.type != "cuda" or not hasattr(F, "ScalingType"):
        return False
    w8, scales = torch.ones(128, 512, device=device).to(torch.float8_e4m3fn), torch.ones(1, 4, device=device)
    try:
        _blockwise_mm(*quantize_activations(torch.ones(128, 512, device=device, dtype=torch.bfloat16)), w8, scales,
                      torch.bfloat16)
    except (RuntimeError, ValueError):  # not in this torch or cuBLAS, or not for this GPU
        return False
    return True


def blockwise_shape(N: int, K: int) -> bool:
    return N % BLOCK == 0 and K % (4 * BLOCK) == 0


def fp8_blockwise_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A prefill's x [M, K] (bf16) @ W^T by cuBLAS's FP8 GEMM: x quantised per 1 x 128 (quantize_activations), W8
    [N, K] as stored, with N a multiple of 128 and K of 512 (cuBLAS takes W's scales in whole groups of 4 blocks
    along K) and has_blockwise_fp8_mm(device). The quantised x gets zero rows up to a multiple of 4: torch takes the
    activations' scales column-major with their row count as leading dimension, and cuBLAS refuses one that is not
    a multiple of 4 (16 bytes; CUBLAS_STATUS_NOT_SUPPORTED for 33-35, 37-39, 4094 or 4095 tokens on the H200).
    Reference: linear_reference(fp8_dot=True)."""
    if not blockwise_shape(*weight.shape):
        raise ValueError(f"cuBLAS's block scales need N a multiple of 128 and K of 512, not W {tuple(weight.shape)}")
    M = x.shape[0]
    return _blockwise_mm(*quantize_activations(x, rows=M + -M % 4), weight, scales, x.dtype)[:M]


def fp8_dequantize(weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W8 [N, K] float8_e4m3fn and its 128 x 128 block scales -> W [N, K] of dtype (fp8_blocks.dequantize)."""
    N, K = weight.shape
    out = torch.empty(N, K, dtype=dtype, device=weight.device)
    _fp8_dequantize_kernel[(triton.cdiv(N, 64), triton.cdiv(K, BLOCK))](weight.view(torch.uint8), scales, out, N, K,
                                                                         BLOCK_N=64)
    return out


def linear_reference(x: torch.Tensor, fmt: str, weight: torch.Tensor, scales: torch.Tensor, group: int = 0,
                     fp8_dot: bool = False) -> torch.Tensor:
    """What the kernels compute, in fp32: the weights dequantised (and with fp8_dot the activations), x W^T."""
    if fmt == "fp8":
        w = fp8_blocks.dequantize(weight.cpu(), scales.cpu())
        if fp8_dot:
            x8, x_scales = fp8_blocks.quantize_activations(x.cpu())
            x = fp8_blocks.dequantize_activations(x8, x_scales)
    else:
        w = int_groups.dequantize(weight.cpu().numpy(), scales.cpu().numpy(), "int4", group)
    return x.cpu().float() @ w.T
