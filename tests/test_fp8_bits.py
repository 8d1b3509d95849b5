"""FP8 by bit arithmetic (kernels/fp8_bits.py) against torch's float8_e4m3fn, and every Triton kernel of the package
compiled for sm86 (RTX 3090, like sm80: no FP8 conversion instructions, and Triton refuses its float8e4nv type there),
the FP8-dot prefill and activation-quantising kernels for sm89 (RTX 4090: FP8 tensor cores and conversions), on
this machine's Triton (no GPU needed)."""

import os
import subprocess
import sys

import torch
import triton
import triton.language as tl

from glm5_offload.kernels.fp8_bits import e4m3_to_f16, f32_to_e4m3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _widen(b_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = tl.load(b_ptr + i, mask=i < N, other=0)
    tl.store(out_ptr + i, e4m3_to_f16(b).to(tl.float32) * 256.0, mask=i < N)


@triton.jit
def _narrow(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < N, other=0.0)
    tl.store(out_ptr + i, f32_to_e4m3(x), mask=i < N)


def test_every_byte_widens_to_torchs_value():
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # all but the two NaNs
    out = torch.empty(codes.numel(), device=DEVICE)
    _widen[(1,)](codes.to(DEVICE), out, codes.numel(), BLOCK=256)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(out.cpu(), want) and torch.equal(out.cpu().signbit(), want.signbit())  # -0 too


def test_values_narrow_to_torchs_bytes():
    """Every e4m3 value, every midpoint between neighbours (ties to even), the subnormals' range, random values: torch's
    bytes; NaN: torch's NaN, with its sign. What rounds past 448, the largest finite value, infinities too, saturates
    at 448 (torch 2.13's cast does; 2.11's, the GPU machine's, makes them NaN: the kernel keeps one rule)."""
    values = torch.tensor([b for b in range(127)], dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (values[1:] + values[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    x = torch.cat([values, mids, torch.rand(4000, generator=g) * 2**-5, torch.rand(4000, generator=g) * 448,
                   torch.randn(4000, generator=g), torch.tensor([0.0, 448.0, 447.9, 2.0**-10, 2.0**-9 * 1.5]),
                   torch.tensor([464.0, 464.1, 479.0, 480.0, 1e6, float("inf"), float("nan")])])
    x = torch.cat([x, -x])
    out = torch.empty(x.numel(), dtype=torch.uint8, device=DEVICE)
    _narrow[(triton.cdiv(x.numel(), 1024),)](x.to(DEVICE), out, x.numel(), BLOCK=1024)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    past = x.abs() > 464  # (464, the midpoint of 448 and 480, rounds to even: 448)
    want[past] = torch.where(x[past] < 0, 0xFE, 0x7E).to(torch.uint8)
    bad = (out.cpu() != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), out[i].item(), want[i].item()) for i in bad[:5]]


COMPILE = r"""
import multiprocessing
import os
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from glm5_offload.kernels import dsa_triton as d, experts_triton as e, gather_rows as g, linear_triton as l
from glm5_offload.kernels import mla_absorb as a, rmsnorm_triton as n, rope_triton as p, router_triton as r
from glm5_offload.kernels import host_signal as w, host_stage as s, hot_rows as h, topk_triton as t
from glm5_offload.kernels import experts_from_host as x

K = lambda names: {n: "constexpr" for n in names.split()}
fp8_linear = {"x_ptr": "*bf16", "xs_ptr": "*fp32", "w_ptr": "*u8", "ws_ptr": "*fp32", "out_ptr": "*bf16",
              "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "blocks_per_split": "i32",
              **K("BLOCK_M BLOCK_N ACT_FP8 FP8_HW CAST STEP VECTOR LOOP_STAGES")}
int4_linear = {"x_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32",
               "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "groups_per_split": "i32",
               **K("G BLOCK_M BLOCK_N CAST STEP")}
int4_gemv = {**{k: v for k, v in int4_linear.items() if v != "constexpr"}, "w_ptr": "*i32", "magic_16": "i32",
             "magic_1": "i32", **K("G BLOCK_M BLOCK_N CAST STEP EXACT")}
indexer = {"q_ptr": "*bf16", "k_ptr": "*u8", "ks_ptr": "*fp32", "w_ptr": "*fp32", "pos_ptr": "*i64", "out_ptr": "*fp32",
           "S": "i32", "T": "i32", "scale": "fp32"}
indexer_fp8 = {**indexer, "q_ptr": "*u8", **K("H D BLOCK_S S_PAD BLOCK_T KEY_BLOCKS FP8_HW CAST")}
indexer_roped = {"q_ptr": "*bf16", "k_ptr": "*u8", "ks_ptr": "*fp32", "w_ptr": "*fp32", "pos_ptr": "*i64",
                 "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*fp32", "S": "i32", "T": "i32", "scale": "fp32",
                 **K("H D BLOCK_S BLOCK_T KEY_BLOCKS CAST FP8 HALF INTERLEAVED BF16")}
indexer_fp8_tile = lambda hw: dict(H=32, D=128, BLOCK_S=8, S_PAD=16, BLOCK_T=64, KEY_BLOCKS=16, FP8_HW=hw, CAST=False)
quantize = {"x_ptr": "*bf16", "out_ptr": "*u8", "scale_ptr": "*fp32", "M": "i32", "K": "i32", "rows": "i32",
            **K("BLOCK_M FP8_MAX FP8_HW")}
rows = {"scores_ptr": "*fp32", "T": "i32", "k": "i32", "per_program": "i32"}
fp8_tile = lambda **k: {**dict(BLOCK_N=64, ACT_FP8=False, FP8_HW=False, CAST=False, STEP=1, VECTOR=False,
                               LOOP_STAGES=None), **k}
KERNELS = [
    (l._fp8_kernel, fp8_linear, fp8_tile(BLOCK_M=16, STEP=2)),
    (l._fp8_kernel, fp8_linear, fp8_tile(BLOCK_M=1, VECTOR=True)),
    (l._fp8_kernel, fp8_linear, fp8_tile(BLOCK_M=1, VECTOR=True, STEP=2, LOOP_STAGES=3)),
    (l._fp8_kernel, {**fp8_linear, "x_ptr": "*u8"}, fp8_tile(BLOCK_M=64, BLOCK_N=128, ACT_FP8=True)),
    (l._int4_kernel, int4_linear, dict(G=128, BLOCK_M=16, BLOCK_N=64, CAST=False, STEP=2)),
    (l._int4_gemv_kernel, int4_gemv, dict(G=128, BLOCK_M=1, BLOCK_N=128, CAST=False, STEP=2, EXACT=False)),
    (l._quantize_activations_kernel, quantize, dict(BLOCK_M=16, FP8_MAX=448.0, FP8_HW=False)),
    (l._fp8_dequantize_kernel, {"w_ptr": "*u8", "ws_ptr": "*fp32", "out_ptr": "*bf16", "N": "i32", "K": "i32",
                                **K("BLOCK_N")}, dict(BLOCK_N=64)),
    (d._rope_quant_kernel, {"k_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*u8",
                            "scale_ptr": "*fp32", "rows_ptr": "*i64", **K("D RD HALF REST INTERLEAVED FP8_MAX")},
     dict(D=128, RD=64, HALF=32, REST=64, INTERLEAVED=False, FP8_MAX=448.0)),
    *((d._indexer_kernel, indexer_roped, dict(H=32, D=128, BLOCK_S=block_s, BLOCK_T=128, KEY_BLOCKS=blocks, CAST=False,
                                              FP8=True, HALF=half, INTERLEAVED=True, BF16=True))
      for block_s, blocks, half in ((8, 4, 0), (1, 1, 32))),  # a prefill chunk's; a decode step's, its rope in it
    (d._indexer_fp8_kernel, indexer_fp8, indexer_fp8_tile(False)),
    (d._sparse_mla_kernel, {"qc_ptr": "*bf16", "qr_ptr": "*bf16", "lat_ptr": "*u8", "idx_ptr": "*i64",
                            "out_ptr": "*fp32", "lse_ptr": "*fp32", "S": "i32", "K": "i32", "H": "i32",
                            "rows_per_split": "i32", "scale": "fp32", **K("L R RB G BLOCK_H BLOCK_K CAST FP8")},
     dict(L=512, R=64, RB=64, G=128, BLOCK_H=16, BLOCK_K=64, CAST=False, FP8=True)),
    (d._sparse_mla_kernel, {"qc_ptr": "*bf16", "qr_ptr": "*bf16", "lat_ptr": "*u8", "idx_ptr": "*i64",  # no rope
                            "out_ptr": "*fp32", "lse_ptr": "*fp32", "S": "i32", "K": "i32", "H": "i32",
                            "rows_per_split": "i32", "scale": "fp32", **K("L R RB G BLOCK_H BLOCK_K CAST FP8")},
     dict(L=512, R=0, RB=16, G=128, BLOCK_H=16, BLOCK_K=64, CAST=False, FP8=True)),
    (d._combine_kernel, {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*fp32", "lse_ptr": "*fp32",
                         "SH": "i32", "splits": "i32", **K("SPLITS L BLOCK_L")}, dict(SPLITS=8, L=512, BLOCK_L=128)),
    (d._fp8_latent_to_bf16_kernel, {"src_ptr": "*u8", "dst_ptr": "*bf16", "T": "i32", **K("L R RB G BLOCK_T")},
     dict(L=512, R=64, RB=64, G=128, BLOCK_T=16)),
    *[(d._quantize_latent_kernel, {"rows_ptr": "*bf16", "pe_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                                   "out_ptr": "*u8", "T": "i32", "stride": "i32", "pe_stride": "i32",
                                   **K("L R RB G BLOCK_T PE_ROUND FP8_MAX HALF INTERLEAVED ROPE_BF16")},
       dict(L=512, R=64, RB=64, G=128, BLOCK_T=4, PE_ROUND=False, FP8_MAX=448.0, HALF=half, INTERLEAVED=True,
            ROPE_BF16=True)) for half in (0, 32)],  # its rope part as it is, or roped in the kernel
    (d._head_weights_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "K": "i32", "scale": "fp32",
                              **K("BLOCK_K")}, dict(BLOCK_K=2048)),
    (e._dequantize_kernel, {"values_ptr": "*u8", "scales_ptr": "*fp32", "out_ptr": "*bf16", "rows": "i32",
                            "cols": "i32", **K("GROUP INT4 BLOCK_R")}, dict(GROUP=128, INT4=True, BLOCK_R=32)),
    (e._round_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16", "T": "i32", "K": "i32", **K("G BLOCK_T")},
     dict(G=128, BLOCK_T=4)),
    (e._swiglu_kernel, {"gu_ptr": "*bf16", "out_ptr": "*bf16", "T": "i32", "inter": "i32", "limit": "fp32",
                        **K("G BLOCK_T LIMIT QUANT")}, dict(G=128, BLOCK_T=4, LIMIT=True, QUANT=True)),
    (g._gather_rows_kernel, {"src_ptr": "*i32", "src_rows_ptr": "*i64", "dst_ptr": "*i32", "dst_rows_ptr": "*i64",
                             **K("WORDS BLOCK")}, dict(WORDS=328, BLOCK=512)),
    *[(a._absorb_query_kernel, {"q_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*fp32",
                                "out_ptr": "*bf16" if half else "*fp32",
                                "pe_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pe_out_ptr": "*bf16",
                                "S": "i32", "H": "i32", "L": "i32", "stride_s": "i32", "stride_h": "i32",
                                **K("NOPE HEAD_ROWS BLOCK_S BLOCK_D BLOCK_C FP8 FP8_HW ROUND_BF16 DOT HALF "
                                    "INTERLEAVED PE_BF16 OUT_BF16")},
       dict(NOPE=192, HEAD_ROWS=448, BLOCK_S=block_s, BLOCK_D=block, BLOCK_C=128, FP8=True, FP8_HW=False,
            ROUND_BF16=True, DOT=dot, HALF=half, INTERLEAVED=True, PE_BF16=True, OUT_BF16=half > 0))
      for block_s, block, dot, half in ((16, 64, True, 0), (1, 64, False, 32))],  # a decode row: its rope too
    *[(a._absorb_output_kernel, {"o_ptr": "*fp32", "w_ptr": "*u8", "ws_ptr": "*fp32",
                                 "out_ptr": "*fp32" if dot else "*bf16", "S": "i32", "H": "i32",
                                 **K("L V NOPE HEAD_ROWS BLOCK_S BLOCK_V BLOCK_L FP8 FP8_HW ROUND_BF16 DOT OUT_BF16")},
       dict(L=512, V=256, NOPE=192, HEAD_ROWS=448, BLOCK_S=block_s, BLOCK_V=block, BLOCK_L=128, FP8=True,
            FP8_HW=False, ROUND_BF16=True, DOT=dot, OUT_BF16=not dot))
      for block_s, block, dot in ((16, 64, True), (1, 16, False))],
    *[(r._logits_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "part_ptr": "*fp32", "T": "i32", "E": "i32", "K": "i32",
                          "blocks_per_split": "i32", **K("BLOCK_T BLOCK_E BLOCK_K DOT")},
       dict(BLOCK_T=block_t, BLOCK_E=64, BLOCK_K=128, DOT=dot)) for block_t, dot in ((1, False), (16, True))],
    (r._select_kernel, {"part_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "weights_ptr": "*fp32",
                        "splits": "i32", "T": "i32", "E": "i32", "scaling": "fp32",
                        **K("GROUP N_GROUP TOPK_GROUP TOP_K BLOCK_G BLOCK_J BLOCK_TOPK NORM")},
     dict(GROUP=32, N_GROUP=8, TOPK_GROUP=4, TOP_K=8, BLOCK_G=8, BLOCK_J=32, BLOCK_TOPK=8, NORM=True)),
    (t._histogram_kernel, {**rows, "hist_ptr": "*i32", "state_ptr": "*i32", **K("LEVEL BITS BLOCK")},
     dict(LEVEL=0, BITS=8, BLOCK=4096)),
    (t._histogram_kernel, {**rows, "hist_ptr": "*i32", "state_ptr": "*i32", **K("LEVEL BITS BLOCK")},
     dict(LEVEL=2, BITS=8, BLOCK=4096)),
    (t._count_kernel, {**rows, "hist_ptr": "*i32", "state_ptr": "*i32", "counts_ptr": "*i32", **K("BITS BLOCK")},
     dict(BITS=8, BLOCK=4096)),
    (t._write_kernel, {"state_ptr": "*i32", **rows, "counts_ptr": "*i32", "out_ptr": "*i64",
                       **K("BITS BLOCK PROGRAMS")}, dict(BITS=8, BLOCK=4096, PROGRAMS=256)),
    (t._candidates_kernel, {"scores_ptr": "*fp32", "thr_ptr": "*fp32", "count_ptr": "*i32", "cand_ptr": "*i64",
                            "T": "i32", "per_program": "i32", **K("ROWS WIDTH CAP")},
     dict(ROWS=32, WIDTH=128, CAP=16384)),
    *((t._row_topk_kernel, {"scores_ptr": "*fp32", "out_ptr": "*i64", "T": "i32", "k": "i32",
                            **K("BITS BLOCK ONE_BLOCK")}, dict(BITS=8, BLOCK=4096, ONE_BLOCK=one))
      for one in (True, False)),
    (h._write_one_kernel, {"row_ptr": "*i32", "pos_ptr": "*i64", "host_ptr": "*i32", "hot_ptr": "*i32",
                           "slot_ptr": "*i32", "token_ptr": "*i64", "stamp_ptr": "*i64", "step_ptr": "*i64",
                           "unused_ptr": "*i64", "free_ptr": "*i64", "W": "i32", "LRU": "i32",
                           **K("WORDS BLOCK FREE_BLOCK")}, dict(WORDS=164, BLOCK=256, FREE_BLOCK=1024)),
    (h._fetch_one_kernel, {"idx_ptr": "*i64", "pos_ptr": "*i64", "slot_ptr": "*i32", "token_ptr": "*i64",
                           "stamp_ptr": "*i64", "step_ptr": "*i64", "hits_ptr": "*i64", "misses_ptr": "*i64",
                           "unused_ptr": "*i64", "queue_ptr": "*i32", "head_ptr": "*i64", "end_ptr": "*i64",
                           "queued_at_ptr": "*i64", "victims_ptr": "*i64", "src_ptr": "*i64", "dst_ptr": "*i64",
                           "mapped_ptr": "*i32", "K": "i32", "W": "i32", "LRU": "i32",
                           **K("OLDEST BITS BLOCK_K BLOCK")},
     dict(OLDEST=1 << 24, BITS=8, BLOCK_K=2048, BLOCK=4096)),
    (n._rmsnorm_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "add_ptr": "*bf16",
                         "add2_ptr": "*bf16", "sum_ptr": "*bf16", "N": "i32", "stride": "i32", "eps": "fp32",
                         **K("BLOCK ADDS X_BF16 OUT_BF16")}, dict(BLOCK=8192, ADDS=0, X_BF16=True, OUT_BF16=False)),
    (n._rmsnorm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "add_ptr": "*fp32",
                         "add2_ptr": "*bf16", "sum_ptr": "*bf16", "N": "i32", "stride": "i32", "eps": "fp32",
                         **K("BLOCK ADDS X_BF16 OUT_BF16")}, dict(BLOCK=8192, ADDS=2, X_BF16=True, OUT_BF16=True)),
    (p._rope_kernel, {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*bf16", "N": "i32",
                      "M": "i32", "stride_s": "i32", "stride_m": "i32", **K("D HALF REST BLOCK_R INTERLEAVED BF16")},
     dict(D=128, HALF=32, REST=64, BLOCK_R=64, INTERLEAVED=True, BF16=True)),
    (w._wait_kernel, {"given_ptr": "*i64", "waited_ptr": "*i64"}, {}),
    (s._stage_kernel, {"x_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": "*fp32", "x_host_ptr": "*fp32",
                       "ids_host_ptr": "*i64", "w_host_ptr": "*fp32", "N": "i32", "K": "i32", **K("BLOCK BLOCK_K")},
     dict(BLOCK=8192, BLOCK_K=8)),
    *((x._rows_kernel, {"x_ptr": "*fp32", "ids_ptr": "*i64", "w_ptr": w_type, "values_ptr": values,
                        "scales_ptr": "*fp32", "out_ptr": "*fp32", "first": "i32", "slots": "i32", "R": "i32",
                        "K": "i32", **K("FMT G NG BLOCK_R SUM")},
       dict(FMT=fmt, G=128, NG=x.TILE[2] * 8 // (128 * bits), BLOCK_R=x.TILE[0], SUM=summed))  # the shipped tile
      for fmt, values, bits, w_type, summed in ((2, "*u8", 4, "*fp32", False), (1, "*i8", 8, "*bf16", True),
                                                (0, "*i16", 16, "*fp32", True))),
]
NATIVE = fp8_tile(BLOCK_M=64, BLOCK_N=128, ACT_FP8=True, FP8_HW=True)  # FP8 hardware: sm89 and up
HW = [(89, l._fp8_kernel, {**fp8_linear, "x_ptr": "*u8"}, NATIVE),
      (89, l._fp8_kernel, fp8_linear, fp8_tile(BLOCK_M=16, FP8_HW=True, STEP=2)),
      (89, l._fp8_kernel, fp8_linear, fp8_tile(BLOCK_M=1, FP8_HW=True, VECTOR=True)),
      (89, d._indexer_fp8_kernel, indexer_fp8, indexer_fp8_tile(True)),
      (89, l._quantize_activations_kernel, quantize, dict(BLOCK_M=16, FP8_MAX=448.0, FP8_HW=True))]
JOBS = [(86, *k) for k in KERNELS] + HW


def compile_job(i):
    capability, fn, signature, constants = JOBS[i]
    try:
        triton.compile(ASTSource(fn, signature, constexprs=constants), target=GPUTarget("cuda", capability, 32))
    except Exception as exc:
        return f"sm{capability} {fn.__name__} {constants}: {str(exc).splitlines()[0][:300]}"


if __name__ == "__main__":  # one compiling process per core (LLVM and ptxas are single-threaded)
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
        failed = [f for f in pool.map(compile_job, range(len(JOBS)), chunksize=1) if f]
    print(len(KERNELS), "kernels")
    sys.exit("\n".join(failed) if failed else 0)
"""


def test_every_kernel_compiles_for_sm86():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real compiles, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    proc = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "47 kernels" in proc.stdout
