"""Routed experts of one MoE layer on the CPU: numba kernels over the packed formats of
glm5_offload/formats/int_groups.py (bf16, int8, int4 with group scales; W13 = [gate; up] fused [E, 2I, H],
W2 = down [E, H, I]), and `moe_reference`, the plain-torch layer they are tested against.

Activations stay fp32 and every product accumulates in fp32, so a kernel equals its reference on the
same quantised weights up to summation order. Or (int8/int4 weights, `act_group` > 0) activations are
quantised to int8 per group of inputs too, and each group's dot is exact integer arithmetic: int8 pairs
widened to int16, multiplied and added in pairs into int32 (x86: vpmaddwd, vpdpwssd with AVX512-VNNI),
as llama.cpp's Q8 activations do; the reference then quantises its activations the same way
(int_groups.quantize_activations).

The kernel is one call per layer and token batch: pairs (token, slot) are grouped by expert; phase 1
computes gate and up for every (expert, block of intermediate indices: one group of the int formats) in
parallel, reading each weight row once for all of that expert's tokens (with int8 activations an int4 row is
unpacked once for 4 of them; an expert's rows go two at a call for its 1-3 tokens, every decode token's experts),
then the block's SiLU(gate) x up and its int8 form; phase 2 splits the output rows into blocks, each thread summing
every active expert's down rows of its block times the routing weight.
Two parallel regions a call (each a fork and a join of the thread team: what a decode step pays besides the
bytes), each with many more work items than cores, so all cores stay busy with 8 experts; a thread takes the next
item of its phase when it finishes one (an atomic counter), so a core slowed by its neighbours takes fewer. Each int4
weight step prefetches the line PREFETCH_AHEAD bytes on (and, a whole line a step, into L2 the one PREFETCH_FAR
bytes on), so a core's dots and its DRAM reads may overlap. Still a core's decode is bound by its own work: its
dots and its reads add up more than they overlap (bench/RESULTS.md, session 61: from L3 as slow as from DRAM).
"""

import os

import llvmlite.binding as llvm_binding
import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..formats.int_groups import quantize_activations

FORMAT_CODES = {"bf16": 0, "int8": 1, "int4": 2}  # how moe_layer takes the format
ROW_BLOCK = 32  # weight rows per work item
_FASTMATH = {"reassoc", "contract", "nsz"}  # reassociation lets LLVM vectorise the fp32 reductions


def moe_reference(x, w13, w2, ids, weights, act_group: int = 0, limit: float | None = None):
    """Plain torch: x [T, H] fp32, w13 [E, 2I, H], w2 [E, H, I] fp32 (int_groups.dequantize of the packed
    weights), ids/weights [T, k] -> [T, H] fp32. act_group > 0: the inputs of both projections are
    int8-quantised in groups of that many first. limit: SwiGLU's clamp (gate <= limit, |up| <= limit)."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    if act_group:
        x = quantize_activations(x, act_group)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            gu = w13[e] @ x[t]
            gate, up = gu[:inter], gu[inter:]
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            act = (torch.nn.functional.silu(gate) * up)[None]
            out[t] += w * (w2[e] @ (quantize_activations(act, act_group) if act_group else act)[0])
    return out


# ---------------------------------------------------------------------------- the numba kernels

# Inner loops index slices from 0 (never `base + j`): numba's negative-index wrap-around on a computed
# index turns LLVM's vector loads into gathers, which made these loops 10x slower.

# ------------------------------------------------------- one row's dot product in LLVM vector IR
#
# fp32 activations: 16 weights a step widen to fp32 and FMA into fp32 lanes; at the end of a group the
# lanes take the group's scale. int8 activations: per group the int8 x int8 (or int4 x int8) products are
# summed exactly in int32 vector lanes:
# pairs sign-extended to int16 and multiplied-added into int32 (the pattern LLVM lowers to vpmaddwd, or
# vpdpwssd with AVX512-VNNI), or with VNNI, int4 nibbles (0..15, unsigned) straight into vpdpbusd quads.
# At the end of a group the lanes turn into fp32 and take the group's scale with one vector FMA; the
# lanes are added up once per row.


def _load_i8(builder, ptr, i, lanes):
    address = builder.bitcast(builder.gep(ptr, [i]), ir.VectorType(ir.IntType(8), lanes).as_pointer())
    return builder.load(address, align=1)


def _pairwise_products(builder, a8, b8):
    """<n x i8> a, b -> <n/2 x i32> a[2k] b[2k] + a[2k+1] b[2k+1]."""
    lanes = a8.type.count
    wide = ir.VectorType(ir.IntType(32), lanes)
    p = builder.mul(builder.sext(a8, wide), builder.sext(b8, wide))
    half = ir.VectorType(ir.IntType(32), lanes // 2)
    even = builder.shuffle_vector(p, p, ir.Constant(half, list(range(0, lanes, 2))))
    odd = builder.shuffle_vector(p, p, ir.Constant(half, list(range(1, lanes, 2))))
    return builder.add(even, odd)


def _vnni_quads(builder, acc, u8, s8):
    """acc (<n/4 x i32>) + sums of 4 adjacent u8 x s8 products: one vpdpbusd."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(acc.type, [acc.type, u8.type, s8.type]),
                                        f"llvm.x86.avx512.vpdpbusd.{u8.type.count * 8}")
    return builder.call(fn, [acc, u8, s8])


def _quads(builder, acc, u8, s8):
    """_vnni_quads where the CPU has vpdpbusd; elsewhere the same sums by widening to int32 (slow: for tests)."""
    if _has_vnni():
        return _vnni_quads(builder, acc, u8, s8)
    lanes = u8.type.count
    wide = ir.VectorType(ir.IntType(32), lanes)
    p = builder.mul(builder.zext(u8, wide), builder.sext(s8, wide))
    quarter = ir.VectorType(ir.IntType(32), lanes // 4)
    for k in range(4):
        acc = builder.add(acc, builder.shuffle_vector(p, p, ir.Constant(quarter, list(range(k, lanes, 4)))))
    return acc


def _has_vnni() -> bool:
    """Whether the CPU numba compiles for has AVX512-VNNI (vpdpbusd). GLM5_NO_VNNI=1 takes the portable
    path (a test does, with a fresh NUMBA_CACHE_DIR: numba's cache does not know this variable)."""
    if os.environ.get("GLM5_NO_VNNI") == "1":
        return False
    features = llvm_binding.get_host_cpu_features()
    return bool(features.get("avx512vnni") and features.get("avx512bw"))


@intrinsic
def _take(typingctx, counters, which):
    """counters[which] += 1 atomically (int64 array); returns the value before: the next work item of a queue the
    threads of a parallel region share, so a core that finishes early takes more than its share."""
    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        at = builder.gep(arr.data, [args[1]])
        return builder.atomic_rmw("add", at, ir.Constant(ir.IntType(64), 1), "monotonic")
    return types.int64(counters, types.intp), codegen


def _sum_lanes(builder, v):
    """The sum of a float vector's lanes by halving shuffles."""
    while v.type.count > 1:
        n = v.type.count // 2
        half = ir.VectorType(ir.IntType(32), n)
        lo = builder.shuffle_vector(v, v, ir.Constant(half, list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(half, list(range(n, 2 * n))))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))


_FP_FLAGS = ("contract", "reassoc", "nsz")  # as the numba kernels' fastmath: FMAs, reordered sums


def _grouped_dot(builder, n_groups, group_bytes, lanes, acc_lanes, step, scales, float_acc=False, offsets=None):
    """For each of len(scales) vectors k: sum over groups g of (k's accumulator lanes for the group, less
    offsets[k](g) in lane 0: an int32, an fp32 with float_acc) x scales[k](g); step(accs, byte offset, the group's
    first byte) adds `lanes` bytes' products into each <acc_lanes x i32> accumulator (fp32 lanes with float_acc) and
    returns them; group_bytes a multiple of lanes. A row shared by several vectors is loaded and unpacked once for
    all of them. The groups go two at a time into two sums: a one-token row dot waits on the chain of those adds,
    not on its reads, and two sums halve it (bench/RESULTS.md, session 60). The lanes are summed once, at the end."""
    f32v = ir.VectorType(ir.FloatType(), acc_lanes)
    accv = f32v if float_acc else ir.VectorType(ir.IntType(32), acc_lanes)
    totals = [[cgutils.alloca_once_value(builder, ir.Constant(f32v, None)) for _ in range(2)] for _ in scales]
    accs = [cgutils.alloca_once_value(builder, ir.Constant(accv, None)) for _ in scales]
    steps = builder.udiv(group_bytes, ir.Constant(group_bytes.type, lanes))

    def group(g, chain):
        for acc in accs:
            builder.store(ir.Constant(accv, None), acc)
        base = builder.mul(g, group_bytes)
        with cgutils.for_range(builder, steps) as inner:
            offset = builder.add(base, builder.mul(inner.index, ir.Constant(base.type, lanes)))
            for acc, value in zip(accs, step([builder.load(acc) for acc in accs], offset, base)):
                builder.store(value, acc)
        for k, (acc, total, scale) in enumerate(zip(accs, totals, scales)):
            value = builder.load(acc)
            if offsets:
                lane0 = builder.insert_element(ir.Constant(accv, None), offsets[k](g), ir.Constant(ir.IntType(32), 0))
                value = builder.fsub(value, lane0, flags=_FP_FLAGS) if float_acc else builder.sub(value, lane0)
            lanes_f32 = value if float_acc else builder.sitofp(value, f32v)
            scaled = builder.fmul(lanes_f32, _splat(builder, scale(g), acc_lanes), flags=_FP_FLAGS)
            builder.store(builder.fadd(builder.load(total[chain]), scaled, flags=_FP_FLAGS), total[chain])

    two = ir.Constant(n_groups.type, 2)
    with cgutils.for_range(builder, builder.udiv(n_groups, two)) as pairs:
        first = builder.mul(pairs.index, two)
        group(first, 0)
        group(builder.add(first, ir.Constant(first.type, 1)), 1)
    with builder.if_then(builder.icmp_unsigned("!=", builder.urem(n_groups, two), ir.Constant(n_groups.type, 0))):
        group(builder.sub(n_groups, ir.Constant(n_groups.type, 1)), 0)
    return [_sum_lanes(builder, builder.fadd(builder.load(a), builder.load(b), flags=_FP_FLAGS)) for a, b in totals]


def _splat(builder, value, lanes):
    vec = ir.VectorType(value.type, lanes)
    first = builder.insert_element(ir.Constant(vec, None), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(first, ir.Constant(vec, None), ir.Constant(ir.VectorType(ir.IntType(32), lanes),
                                                                              [0] * lanes))


def _load_f32(builder, ptr, i, lanes):
    address = builder.bitcast(builder.gep(ptr, [i]), ir.VectorType(ir.FloatType(), lanes).as_pointer())
    return builder.load(address, align=4)


def _fma(builder, acc, a, b):
    return builder.fadd(acc, builder.fmul(a, b, flags=_FP_FLAGS), flags=_FP_FLAGS)


# An int4 weight step asks for the cache line this many bytes ahead: a work item's rows follow each other in memory,
# and the hardware prefetchers alone left a core waiting on DRAM between its dots (H200 host, 16 threads, int4 + int8
# activations: 57 GB/s without, 86 GB/s at 1024 bytes, 72-82 GB/s at 4096; one thread 5.4 -> 9.8 GB/s). int8 rows
# (twice the bytes for the same dots) read at 76% of the host's bandwidth without it: left as they were.
PREFETCH_AHEAD = 1024
# And the line PREFETCH_FAR bytes ahead into L2 alone (prefetcht2): the L1's few fill buffers bound how many lines a
# core has in flight; the far requests keep more of them coming (H100 host, 16 threads, five alternated rounds, the
# medians: 1.99 -> 1.68 ms a GLM-5 layer, 80 -> 84% of the read; t1 at 4096 or t2 at 3072 and 8192 between the two).
# Measured for the steps of a whole line (int8 activations with AVX512-VNNI, groups of 128: the default) and asked
# there alone; the 16-byte steps (fp32 activations, no VNNI, smaller groups) keep the near prefetch only.
PREFETCH_FAR = 4096


def _prefetch(builder, ptr, i, far=False):
    """Prefetch the line PREFETCH_AHEAD bytes past ptr + i into every cache level, or with `far` the line
    PREFETCH_FAR bytes past it into L2 (locality 1: prefetcht2): past an array's end a prefetch does nothing."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p] + [ir.IntType(32)] * 3),
                                        "llvm.prefetch.p0i8")
    at = builder.gep(ptr, [builder.add(i, ir.Constant(i.type, PREFETCH_FAR if far else PREFETCH_AHEAD))])
    builder.call(fn, [builder.bitcast(at, i8p)] + [ir.Constant(ir.IntType(32), v) for v in (0, 1 if far else 3, 1)])


def _int4_step(builder, packed_ptr, i, lanes, group_bytes, base):
    """`lanes` packed int4 bytes at byte offset i of the group starting at byte `base` -> (low nibbles, high
    nibbles) as <lanes x i8> (0..15), and the input offsets they multiply: group g's bytes start at g B (B =
    group_bytes), its inputs at 2 g B, the low nibbles' half first, then the high ones' (int_groups' layout). The
    group's start comes from the loop over groups: a division here, each step, cost the int4 kernels half their
    speed."""
    _prefetch(builder, packed_ptr, i)
    if lanes >= 64:  # a line a step (AVX512-VNNI, groups of 128: what was measured); narrower steps ask as before
        _prefetch(builder, packed_ptr, i, far=True)
    b = _load_i8(builder, packed_ptr, i, lanes)
    low = builder.and_(b, ir.Constant(b.type, [15] * lanes))
    high = builder.lshr(b, ir.Constant(b.type, [4] * lanes))
    lo_at = builder.add(i, base)
    return low, high, lo_at, builder.add(lo_at, group_bytes)


@intrinsic
def _row_dot_f32(typingctx, row, scales, v, vsum):
    """sum_g scales[g] (row_g . v_g) for an int8 row (int8 values) or an int4 one (uint8 packed bytes, the
    nibbles' offset 8 off through vsum[g], v's group sums) against fp32 v: 16 weights a step, fp32 lanes
    across the whole row, one reduction at its end."""
    int4 = row.dtype == types.uint8

    def codegen(context, builder, signature, args):
        row_a, sc_a, v_a, sum_a = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args))
        f32v = ir.VectorType(ir.FloatType(), 16)
        group_bytes = builder.udiv(row_a.nitems, sc_a.nitems)

        def scale(g):
            return _float_at(builder, sc_a, g)

        if not int4:
            def step(accs, i, base):
                w = builder.sitofp(_load_i8(builder, row_a.data, i, 16), f32v)
                return [_fma(builder, accs[0], w, _load_f32(builder, v_a.data, i, 16))]
            return _grouped_dot(builder, sc_a.nitems, group_bytes, 16, 16, step, [scale], float_acc=True)[0]

        def step(accs, i, base):
            low, high, lo_at, hi_at = _int4_step(builder, row_a.data, i, 16, group_bytes, base)
            acc = _fma(builder, accs[0], builder.uitofp(low, f32v), _load_f32(builder, v_a.data, lo_at, 16))
            return [_fma(builder, acc, builder.uitofp(high, f32v), _load_f32(builder, v_a.data, hi_at, 16))]
        eight = ir.Constant(ir.FloatType(), 8.0)  # each group's sum less 8 x its inputs' sum: nibbles - 8
        return _grouped_dot(builder, sc_a.nitems, group_bytes, 16, 16, step, [scale], float_acc=True,
                            offsets=[lambda g: builder.fmul(_float_at(builder, sum_a, g), eight)])[0]
    return types.float32(row, scales, v, vsum), codegen


def _float_at(builder, arr, i):
    return builder.load(builder.gep(arr.data, [i]))


@intrinsic
def _row_dot_i8q(typingctx, row, scales, vq, vs):
    """sum_g scales[g] vs[g] sum_j row[j] vq[j] over groups g (int8 row and vq of one length, a multiple of
    32 per group), each group's sum exact in int32."""
    def codegen(context, builder, signature, args):
        row_a, sc_a, vq_a, vs_a = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args))
        group_bytes = builder.udiv(row_a.nitems, sc_a.nitems)

        def step(accs, i, base):
            return [builder.add(accs[0], _pairwise_products(builder, _load_i8(builder, row_a.data, i, 32),
                                                            _load_i8(builder, vq_a.data, i, 32)))]

        def scale(g):
            return builder.fmul(_float_at(builder, sc_a, g), _float_at(builder, vs_a, g))
        return _grouped_dot(builder, sc_a.nitems, group_bytes, 32, 16, step, [scale])[0]
    return types.float32(row, scales, vq, vs), codegen


@intrinsic
def _row_dots_u4q(typingctx, rows, scales, vqs, vss, vsums):
    """For each row r and vector k of the tuples (r major): sum_g scales[r][g] vss[k][g] (sum_j nibble_j vqs[k][j] -
    8 vsums[k][g]): int4 rows of one length (packed as int_groups lays them out) against int8 vectors with their
    group scales and sums, each row loaded and unpacked once for all the vectors, each vector's bytes loaded once
    for all the rows. With AVX512-VNNI the nibbles (0..15) go straight into vpdpbusd, 64 bytes a step for groups of
    128 and 16 otherwise; without it, vpmaddwd pairs 16 bytes a step."""
    vnni = _has_vnni()
    n_rows, count = len(rows), len(vqs)

    def codegen(context, builder, signature, args):
        row_a, sc_a, vq_a, vs_a, sum_a = ([context.make_array(t.dtype)(context, builder, builder.extract_value(v, k))
                                          for k in range(len(t))] for t, v in zip(signature.args, args))
        group_bytes = builder.udiv(row_a[0].nitems, sc_a[0].nitems)  # half a group of inputs

        def halves(accs, i, base, lanes, combine):
            nibbles = [_int4_step(builder, row.data, i, lanes, group_bytes, base) for row in row_a]
            lo_at, hi_at = nibbles[0][2:]
            inputs = [(_load_i8(builder, vq.data, lo_at, lanes), _load_i8(builder, vq.data, hi_at, lanes))
                      for vq in vq_a]
            return [combine(combine(accs[r * count + k], low, lo), high, hi)
                    for r, (low, high, _, _) in enumerate(nibbles) for k, (lo, hi) in enumerate(inputs)]

        scales = [lambda g, sc=sc, vs=vs: builder.fmul(_float_at(builder, sc, g), _float_at(builder, vs, g))
                  for sc in sc_a for vs in vs_a]
        results = [cgutils.alloca_once(builder, ir.FloatType()) for _ in range(n_rows * count)]

        offsets = [lambda g, sums=sums: builder.mul(builder.load(builder.gep(sums.data, [g])),
                                                    ir.Constant(ir.IntType(32), 8)) for _ in sc_a for sums in sum_a]

        def dots(lanes, acc_lanes, combine):  # each group's integer sum less 8 x its inputs' sum: nibbles - 8
            values = _grouped_dot(builder, sc_a[0].nitems, group_bytes, lanes, acc_lanes,
                                  lambda accs, i, base: halves(accs, i, base, lanes, combine), scales, offsets=offsets)
            for value, result in zip(values, results):
                builder.store(value, result)

        if vnni:
            quads = lambda acc, u8, s8: _vnni_quads(builder, acc, u8, s8)  # noqa: E731
            wide = builder.icmp_unsigned("==", builder.urem(group_bytes, ir.Constant(group_bytes.type, 64)),
                                         ir.Constant(group_bytes.type, 0))
            with builder.if_else(wide) as (then, otherwise):
                with then:
                    dots(64, 16, quads)
                with otherwise:
                    dots(16, 4, quads)
        else:
            dots(16, 8, lambda acc, a8, b8: builder.add(acc, _pairwise_products(builder, a8, b8)))
        return context.make_tuple(builder, signature.return_type, [builder.load(result) for result in results])
    return types.UniTuple(types.float32, n_rows * count)(rows, scales, vqs, vss, vsums), codegen


# ------------------------------------------- a tile: 16 int4 rows x several int8 vectors (prefill)
#
# A row dot keeps the row's inputs in the vector lanes, so each group of 128 costs every (row, vector) pair a
# conversion and a scale, and each vector's bytes are loaded again for every row. A tile puts 16 rows in the lanes
# instead: a group's 64 bytes of 16 rows are loaded (16 vectors) and transposed by 32-bit quads (4 shuffle stages),
# so lane i of quad vector j holds row i's bytes 4j..4j+3, whose low nibbles are inputs 4j..4j+3 of the group and
# high nibbles inputs 64+4j..64+4j+3. Each vector's 4 matching inputs are one broadcast, and one vpdpbusd adds 4
# products to all 16 rows: the transposition and the unpacking are shared by the tile's vectors, the group's scale
# is one vector FMA per vector, and nothing is summed across lanes.

TILE_ROWS = 16  # rows a tile: one per int32 lane of a 512-bit vector
TILE_VECTORS = 8  # vectors a tile at most (their accumulators and the 16 quad vectors fill the 32 registers)
TILE_GROUP = 128  # the only group size tiles take: a group's half (64 bytes a row) is one 16 x 16 quad transpose


def _transpose16(builder, vectors):
    """16 <16 x i32> vectors (rows) -> their transpose (vector j holds lane j of each): 4 stages of blocks swapped
    across pairs of vectors d apart, d = 8, 4, 2, 1."""
    v = list(vectors)
    for d in (8, 4, 2, 1):
        keep = ir.Constant(ir.VectorType(ir.IntType(32), 16), [j if j & d == 0 else 16 + j - d for j in range(16)])
        swap = ir.Constant(ir.VectorType(ir.IntType(32), 16), [j + d if j & d == 0 else 16 + j for j in range(16)])
        for i in range(16):
            if i & d == 0:
                v[i], v[i + d] = (builder.shuffle_vector(v[i], v[i + d], keep),
                                  builder.shuffle_vector(v[i], v[i + d], swap))
    return v


@intrinsic
def _tile_u4q(typingctx, rows, ws, vqs, vss, vsums, out):
    """out[t, i] = sum_g ws[g, i] vss[t][g] (sum_j nibble(i, g, j) vqs[t][128 g + j] - 8 vsums[t][g]) for each vector t
    of the tuples: rows [16, K/2] uint8 (int4 in groups of 128, int_groups' layout; rows a stride apart), ws [K/128, 16]
    fp32 (the rows' scales, group-major), vqs int8 [K], vss fp32 and vsums int32 [K/128] (their group scales and sums),
    out [len(vqs), 16] fp32. Fast with AVX512-VNNI only (moe_layer takes tiles there; elsewhere they are for tests)."""
    count = len(vqs)

    def codegen(context, builder, signature, args):
        rows_a, ws_a = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:2], args[:2]))
        out_a = context.make_array(signature.args[5])(context, builder, args[5])
        vq_a, vs_a, sum_a = ([context.make_array(t.dtype)(context, builder, builder.extract_value(v, k))
                              for k in range(count)] for t, v in zip(signature.args[2:5], args[2:5]))
        i64, i32 = ir.IntType(64), ir.IntType(32)
        i32v, i8v, f32v = ir.VectorType(i32, 16), ir.VectorType(ir.IntType(8), 64), ir.VectorType(ir.FloatType(), 16)
        stride = cgutils.unpack_tuple(builder, rows_a.strides, 2)[0]
        n_groups = cgutils.unpack_tuple(builder, ws_a.shape, 2)[0]
        low_mask, shift = ir.Constant(i8v, [15] * 64), ir.Constant(i8v, [4] * 64)
        totals = [cgutils.alloca_once_value(builder, ir.Constant(f32v, None)) for _ in range(count)]

        def quad(vq, at):  # 4 int8 inputs at byte `at`, broadcast to every lane
            word = builder.load(builder.bitcast(builder.gep(vq.data, [at]), i32.as_pointer()), align=1)
            return builder.bitcast(_splat(builder, word, 16), i8v)

        with cgutils.for_range(builder, n_groups) as groups:
            g = groups.index
            half = builder.mul(g, ir.Constant(i64, TILE_GROUP // 2))  # the group's bytes in each row
            lines = []
            for i in range(TILE_ROWS):
                at = builder.add(builder.mul(stride, ir.Constant(i64, i)), half)
                _prefetch(builder, rows_a.data, at)
                lines.append(builder.bitcast(_load_i8(builder, rows_a.data, at, 64), i32v))
            quads = _transpose16(builder, lines)
            accs = [ir.Constant(i32v, None)] * count
            first = builder.mul(g, ir.Constant(i64, TILE_GROUP))
            for j, q in enumerate(quads):
                b = builder.bitcast(q, i8v)
                low, high = builder.and_(b, low_mask), builder.lshr(b, shift)
                lo_at = builder.add(first, ir.Constant(i64, 4 * j))
                hi_at = builder.add(lo_at, ir.Constant(i64, TILE_GROUP // 2))
                accs = [_quads(builder, _quads(builder, acc, low, quad(vq, lo_at)), high, quad(vq, hi_at))
                        for acc, vq in zip(accs, vq_a)]
            scales = builder.load(builder.bitcast(builder.gep(ws_a.data, [builder.mul(g, ir.Constant(i64, 16))]),
                                                  f32v.as_pointer()), align=4)
            for acc, total, vs, sums in zip(accs, totals, vs_a, sum_a):
                offset = builder.mul(builder.load(builder.gep(sums.data, [g])), ir.Constant(i32, 8))
                dots = builder.sitofp(builder.sub(acc, _splat(builder, offset, 16)), f32v)
                scale = builder.fmul(scales, _splat(builder, _float_at(builder, vs, g), 16), flags=_FP_FLAGS)
                builder.store(_fma(builder, builder.load(total), dots, scale), total)
        for t, total in enumerate(totals):
            at = builder.bitcast(builder.gep(out_a.data, [ir.Constant(i64, 16 * t)]), f32v.as_pointer())
            builder.store(builder.load(total), at, align=4)
        return context.get_dummy_value()
    return types.none(rows, ws, vqs, vss, vsums, out), codegen


@njit(nogil=True, cache=True, inline="always")
def _quantize_group(x, out):
    """One group x [G] fp32 -> out [G] int8 (amax / 127 a step); returns the scale and the sum of out."""
    amax = np.float32(0.0)
    for j in range(x.shape[0]):
        amax = max(amax, abs(x[j]))
    scale = amax / np.float32(127.0)
    total = 0
    for j in range(x.shape[0]):
        out[j] = np.int8(np.round(x[j] / scale)) if scale > 0 else np.int8(0)
        total += out[j]
    return scale, total


@njit(nogil=True, cache=True)
def _quantize_rows(v, group, q, scales, sums):
    """v [N, K] fp32 -> q [N, K] int8, scales and sums of q [N, K/group] (fp32 amax / 127, int32) per group
    (int_groups.quantize_activations)."""
    for i in range(v.shape[0]):
        for g in range(v.shape[1] // group):
            at = slice(g * group, (g + 1) * group)
            scales[i, g], sums[i, g] = _quantize_group(v[i, at], q[i, at])


DOTS_AT_ONCE = 4  # int4 rows x int8 vectors: this many vectors a pass over the row


@njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _rows_times_q(fmt, row, scales, vq, vs, vsum, which, first, last, out):
    """out[p] = row . vq[which[p]] for p in first..last-1, the vectors int8-quantised (vq values, vs group scales,
    vsum their sums); an int4 row unpacked once per DOTS_AT_ONCE of them, and once for the 1-3 left."""
    if fmt == 1:
        for p in range(first, last):
            out[p] = _row_dot_i8q(row, scales, vq[which[p]], vs[which[p]])
        return
    p = first
    while p + DOTS_AT_ONCE <= last:
        a, b, c, d = which[p], which[p + 1], which[p + 2], which[p + 3]
        out[p], out[p + 1], out[p + 2], out[p + 3] = _row_dots_u4q(
            (row,), (scales,), (vq[a], vq[b], vq[c], vq[d]), (vs[a], vs[b], vs[c], vs[d]),
            (vsum[a], vsum[b], vsum[c], vsum[d]))
        p += DOTS_AT_ONCE
    if last - p == 3:
        a, b, c = which[p], which[p + 1], which[p + 2]
        out[p], out[p + 1], out[p + 2] = _row_dots_u4q((row,), (scales,), (vq[a], vq[b], vq[c]), (vs[a], vs[b], vs[c]),
                                                       (vsum[a], vsum[b], vsum[c]))
    elif last - p == 2:
        a, b = which[p], which[p + 1]
        out[p], out[p + 1] = _row_dots_u4q((row,), (scales,), (vq[a], vq[b]), (vs[a], vs[b]), (vsum[a], vsum[b]))
    elif last - p == 1:
        a = which[p]
        out[p] = _row_dots_u4q((row,), (scales,), (vq[a],), (vs[a],), (vsum[a],))[0]


FEW = 3  # an expert's tokens up to which its rows go two at a call straight from the loops (more: _rows_times, tiles)


@njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _two_rows_times_few(fmt, w, s, r, q, vq, vs, vsum, which, first, last, res):
    """res[0, p - first] = row r of w . vq[which[p]] and res[1, p - first] = row q . it, for the 1 to FEW vectors
    first..last-1 (int8-quantised: values vq, group scales vs, sums vsum). The loops over rows call it directly for an
    expert with few tokens, every decode token's (through _rows_times and _rows_times_q one core's layer read 8-12%
    slower: bench/RESULTS.md, session 61), two rows at once (an int4 step's vector bytes loaded once for both)."""
    if fmt == 1:
        for p in range(first, last):
            res[0, p - first] = _row_dot_i8q(w[r], s[r], vq[which[p]], vs[which[p]])
            res[1, p - first] = _row_dot_i8q(w[q], s[q], vq[which[p]], vs[which[p]])
        return
    rows, scales, a = (w[r], w[q]), (s[r], s[q]), which[first]
    if last - first == 1:
        res[0, 0], res[1, 0] = _row_dots_u4q(rows, scales, (vq[a],), (vs[a],), (vsum[a],))
    elif last - first == 2:
        b = which[first + 1]
        res[0, 0], res[0, 1], res[1, 0], res[1, 1] = _row_dots_u4q(rows, scales, (vq[a], vq[b]), (vs[a], vs[b]),
                                                                   (vsum[a], vsum[b]))
    else:
        b, c = which[first + 1], which[first + 2]
        res[0, 0], res[0, 1], res[0, 2], res[1, 0], res[1, 1], res[1, 2] = _row_dots_u4q(
            rows, scales, (vq[a], vq[b], vq[c]), (vs[a], vs[b], vs[c]), (vsum[a], vsum[b], vsum[c]))


TILES = _has_vnni()  # tiles need vpdpbusd
TILE_MIN = 4  # an expert's vectors from which its int4 rows go by tiles (fewer: row dots)


@njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _tile_rows(w, s, r0, vq, vs, vsum, which, first, last, ws, res):
    """res[p - first, i] = row r0 + i of w (int4 [R, K/2], scales s [R, K/128]) . vq[which[p]] for p in first..last-1
    and i < TILE_ROWS (vq int8 vectors with group scales vs and sums vsum): tiles of TILE_VECTORS vectors, then of 4,
    the last one padded by repeating the last vector (res has 3 rows to spare); ws [K/128, TILE_ROWS] scratch."""
    for g in range(s.shape[1]):
        for i in range(TILE_ROWS):
            ws[g, i] = s[r0 + i, g]
    rows = w[r0 : r0 + TILE_ROWS]
    p = first
    while p + TILE_VECTORS <= last:
        a, b, c, d = which[p], which[p + 1], which[p + 2], which[p + 3]
        e, f, g, h = which[p + 4], which[p + 5], which[p + 6], which[p + 7]
        _tile_u4q(rows, ws, (vq[a], vq[b], vq[c], vq[d], vq[e], vq[f], vq[g], vq[h]),
                  (vs[a], vs[b], vs[c], vs[d], vs[e], vs[f], vs[g], vs[h]),
                  (vsum[a], vsum[b], vsum[c], vsum[d], vsum[e], vsum[f], vsum[g], vsum[h]),
                  res[p - first : p - first + TILE_VECTORS])
        p += TILE_VECTORS
    while p < last:
        a, b, c, d = which[p], which[min(p + 1, last - 1)], which[min(p + 2, last - 1)], which[min(p + 3, last - 1)]
        _tile_u4q(rows, ws, (vq[a], vq[b], vq[c], vq[d]), (vs[a], vs[b], vs[c], vs[d]),
                  (vsum[a], vsum[b], vsum[c], vsum[d]), res[p - first : p - first + 4])
        p += 4


@njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _nibbles(byte):
    """A packed int4 byte -> (high, low) nibbles as fp32, split in fp32 arithmetic (exact below 256): integer
    masks and shifts on a uint8 would be widened to int64 by numba, four times the vector instructions."""
    b = np.float32(byte)
    high = np.floor(b * np.float32(0.0625))
    return high, b - np.float32(16.0) * high


@njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _row_f32(fmt, row, scales, group, buf):
    """One weight row (values row, scales [ngroups]) dequantised into buf (fp32, the row's length)."""
    if fmt == 0:
        bits = buf.view(np.uint32)
        for j in range(bits.shape[0]):
            bits[j] = np.uint32(row[j]) << np.uint32(16)
        return
    half = group // 2
    for g in range(buf.shape[0] // group):
        scale = scales[g]
        if fmt == 1:
            w, out = row[g * group : (g + 1) * group], buf[g * group : (g + 1) * group]
            for j in range(group):
                out[j] = np.float32(w[j]) * scale
        else:
            w = row[g * half : (g + 1) * half]
            lo, hi = buf[g * group : g * group + half], buf[g * group + half : (g + 1) * group]
            for j in range(half):
                high, low = _nibbles(w[j])
                lo[j] = (low - np.float32(8.0)) * scale
                hi[j] = (high - np.float32(8.0)) * scale


@njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _dot(a, b):
    acc = np.float32(0.0)
    for j in range(a.shape[0]):
        acc += a[j] * b[j]
    return acc


@njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _row_dot(fmt, row, scales, group, v, v_group_sums, buf):
    """row . v; int8 and int4 without writing the row out (int4's +8 offset comes off through v's group sums)."""
    if fmt == 0:
        _row_f32(fmt, row, scales, group, buf)
        return _dot(buf, v)
    return _row_dot_f32(row, scales, v, v_group_sums)


@njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _rows_times(fmt, row, scales, group, vectors, sums, vq, vs, vsum, which, first, last, buf, out):
    """out[p] = row . vectors[which[p]] for p in first..last-1: one vector fused, more: the row dequantised
    once; with int8 activations (vq [N, K] int8, vs scales, vsum sums, non-empty) integer dots per vector."""
    if vq.shape[0]:
        _rows_times_q(fmt, row, scales, vq, vs, vsum, which, first, last, out)
        return
    if last - first == 1:
        out[first] = _row_dot(fmt, row, scales, group, vectors[which[first]], sums[which[first]], buf)
        return
    _row_f32(fmt, row, scales, group, buf)
    for p in range(first, last):
        out[p] = _dot(buf, vectors[which[p]])


@njit(nogil=True, fastmath=_FASTMATH, cache=True)
def _group_sums(v, group):
    sums = np.empty((v.shape[0], v.shape[1] // group), np.float32)
    for i in range(v.shape[0]):
        for g in range(sums.shape[1]):
            sums[i, g] = v[i, g * group : (g + 1) * group].sum()
    return sums


@njit(parallel=True, nogil=True, fastmath=_FASTMATH, cache=True)
def moe_layer(fmt, group, w13, s13, w2, s2, x, pair_token, pair_weight, expert_ids, expert_start, gu, act, out,
              workers, act_int8=False, limit=np.inf):
    """One MoE layer's routed experts for T tokens, summed into out [T, H] (fp32, zeroed by the caller).

    x [T, H] fp32; pairs (token, slot) sorted by expert: pair_token [P] int32, pair_weight [P] fp32;
    expert_ids [A] int32 the active experts, expert_start [A+1] int32 their pair ranges;
    scratch gu [P, 2I], act [P, I] fp32. act_int8 (int8/int4 weights): x and act int8-quantised per group.
    limit: SwiGLU's clamp, gate <= limit and -limit <= up <= limit (inf: none). workers: numba's thread count.
    """
    hidden, rows13 = x.shape[1], w13.shape[1]
    inter = rows13 // 2
    n_active, n_pairs = expert_ids.shape[0], gu.shape[0]
    x_sums = _group_sums(x, group) if fmt == 2 and not act_int8 else np.zeros((x.shape[0], 1), np.float32)
    xq = np.empty((x.shape[0] if act_int8 else 0, hidden), np.int8)
    xs = np.empty((xq.shape[0], hidden // group), np.float32)
    x_qsums = np.empty((xq.shape[0], hidden // group), np.int32)
    _quantize_rows(x[: xq.shape[0]], group, xq, xs, x_qsums)
    tiles = (TILES and fmt == 2 and act_int8 and group == TILE_GROUP and inter % TILE_ROWS == 0
             and hidden % TILE_ROWS == 0)
    most = 0  # pairs of the busiest expert
    for a in range(n_active):
        most = max(most, expert_start[a + 1] - expert_start[a])
    lim = np.float32(limit)
    act_sums = np.zeros((n_pairs, inter // group) if fmt == 2 and not act_int8 else (n_pairs, 1), np.float32)
    aq = np.empty((n_pairs if act_int8 else 0, inter), np.int8)
    a_scales = np.empty((aq.shape[0], inter // group), np.float32)
    a_qsums = np.empty((aq.shape[0], inter // group), np.int32)
    # gate and up: an item is (expert, a block of `width` intermediate indices), the gate rows and the up rows of the
    # block; then the block's SiLU(gate) x up and, for int weights, its one group of the down projection's inputs
    # (int8-quantised, or its sum), so the down phase starts from finished inputs
    width = group if fmt else ROW_BLOCK
    blocks = (inter + width - 1) // width
    queues = np.zeros(2, np.int64)  # each phase's next item: one thread a worker, each taking items until none are left
    for _ in prange(workers):
        ws = np.empty((hidden // group, TILE_ROWS), np.float32)
        res = np.empty((most + 3, TILE_ROWS), np.float32)
        buf = np.empty(hidden, np.float32)
        dots = np.empty(n_pairs, np.float32)
        few = np.empty((2, FEW), np.float32)
        item = _take(queues, 0)
        while item < n_active * blocks:
            a, block = item // blocks, item % blocks
            e, first, last = expert_ids[a], expert_start[a], expert_start[a + 1]
            i0, i1 = block * width, min(inter, (block + 1) * width)
            if tiles and last - first >= TILE_MIN:
                for half in range(2):  # gate, up
                    for r0 in range(half * inter + i0, half * inter + i1, TILE_ROWS):
                        _tile_rows(w13[e], s13[e], r0, xq, xs, x_qsums, pair_token, first, last, ws, res)
                        for p in range(first, last):
                            for i in range(TILE_ROWS):
                                gu[p, r0 + i] = res[p - first, i]
            elif act_int8 and last - first <= FEW:  # few tokens (every decode token's experts)
                for r in range(i0, i1):  # a gate row and its up row
                    _two_rows_times_few(fmt, w13[e], s13[e], r, inter + r, xq, xs, x_qsums, pair_token, first, last,
                                        few)
                    for p in range(first, last):
                        gu[p, r], gu[p, inter + r] = few[0, p - first], few[1, p - first]
            else:
                for half in range(2):
                    for r in range(half * inter + i0, half * inter + i1):
                        _rows_times(fmt, w13[e, r], s13[e, r] if fmt else s13[0, 0], group, x, x_sums, xq, xs,
                                    x_qsums, pair_token, first, last, buf, dots)
                        for p in range(first, last):
                            gu[p, r] = dots[p]
            for p in range(first, last):  # SiLU(gate) x up, over slices indexed from 0 (see above)
                gates, ups, acts = gu[p, i0:i1], gu[p, inter + i0 : inter + i1], act[p, i0:i1]
                for j in range(i1 - i0):
                    g, u = gates[j], ups[j]
                    if g > lim:  # comparisons, not min/max: a NaN stays NaN
                        g = lim
                    if u > lim:
                        u = lim
                    elif u < -lim:
                        u = -lim
                    acts[j] = g / (np.float32(1.0) + np.exp(-g)) * u
                if act_int8:  # i0..i1 is one group
                    a_scales[p, block], a_qsums[p, block] = _quantize_group(acts, aq[p, i0:i1])
                elif fmt == 2:
                    act_sums[p, block] = acts.sum()
            item = _take(queues, 0)
    pairs = np.arange(n_pairs).astype(np.int32)
    blocks2 = (hidden + ROW_BLOCK - 1) // ROW_BLOCK
    for _ in prange(workers):  # down: an item is a block of output rows, every active expert's rows of it
        buf = np.empty(inter, np.float32)
        dots = np.empty(n_pairs, np.float32)
        ws = np.empty((inter // group, TILE_ROWS), np.float32)
        res = np.empty((most + 3, TILE_ROWS), np.float32)
        few = np.empty((2, FEW), np.float32)
        block = _take(queues, 1)
        while block < blocks2:
            end = min(hidden, (block + 1) * ROW_BLOCK)
            for a in range(n_active):
                e, first, last = expert_ids[a], expert_start[a], expert_start[a + 1]
                if tiles and last - first >= TILE_MIN:
                    for r0 in range(block * ROW_BLOCK, end, TILE_ROWS):
                        _tile_rows(w2[e], s2[e], r0, aq, a_scales, a_qsums, pairs, first, last, ws, res)
                        for p in range(first, last):
                            for i in range(TILE_ROWS):
                                out[pair_token[p], r0 + i] += pair_weight[p] * res[p - first, i]
                    continue
                if act_int8 and last - first <= FEW:  # few tokens (every decode token's experts)
                    for r in range(block * ROW_BLOCK, end, 2):  # rows in twos: hidden, w13's inputs, is groups
                        _two_rows_times_few(fmt, w2[e], s2[e], r, r + 1, aq, a_scales, a_qsums, pairs, first, last,
                                            few)
                        for p in range(first, last):
                            out[pair_token[p], r] += pair_weight[p] * few[0, p - first]
                            out[pair_token[p], r + 1] += pair_weight[p] * few[1, p - first]
                    continue
                for r in range(block * ROW_BLOCK, end):
                    _rows_times(fmt, w2[e, r], s2[e, r] if fmt else s2[0, 0], group, act, act_sums, aq, a_scales,
                                a_qsums, pairs, first, last, buf, dots)
                    for p in range(first, last):
                        out[pair_token[p], r] += pair_weight[p] * dots[p]
            block = _take(queues, 1)


def group_by_expert(ids: np.ndarray, weights: np.ndarray, only: np.ndarray | None = None):
    """ids/weights [T, k] -> pair_token, pair_weight, expert_ids, expert_start (see moe_layer); with `only` (expert
    ids), the pairs of those experts alone. Pairs keep their (token, slot) order within an expert."""
    if ids.size and (ids.min() < 0):
        raise ValueError(f"expert ids must be >= 0, got {ids.min()}")
    only = np.empty(0, np.int64) if only is None else np.asarray(only, np.int64)
    return _group_by_expert(np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(weights, np.float32), only,
                            only.size > 0)


@njit(nogil=True, cache=True)
def _group_by_expert(ids, weights, only, use_only):
    # a counting sort of the pairs by expert (stable: one pass counts, one places)
    n_experts = ids.max() + 1 if ids.size else 0
    kept = np.ones(n_experts, np.bool_)
    if use_only:
        kept[:] = False
        for e in only:
            if e < n_experts:
                kept[e] = True
    counts = np.zeros(n_experts + 1, np.int64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if kept[e]:
                counts[e + 1] += 1
    active = 0
    for e in range(n_experts):
        active += counts[e + 1] > 0
        counts[e + 1] += counts[e]  # counts[e]: where expert e's pairs start
    pairs = counts[n_experts]
    pair_token, pair_weight = np.empty(pairs, np.int32), np.empty(pairs, np.float32)
    expert_ids, expert_start = np.empty(active, np.int32), np.empty(active + 1, np.int32)
    a = 0
    for e in range(n_experts):
        if counts[e + 1] > counts[e]:
            expert_ids[a], expert_start[a] = e, counts[e]
            a += 1
    expert_start[active] = pairs
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if kept[e]:
                pair_token[counts[e]], pair_weight[counts[e]] = t, weights[t, j]
                counts[e] += 1
    return pair_token, pair_weight, expert_ids, expert_start


def moe_forward(fmt: str, group: int, w13, s13, w2, s2, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                threads: int | None = None, act_int8: bool = False, scratch: dict | None = None,
                limit: float | None = None, only: np.ndarray | None = None) -> np.ndarray:
    """x [T, H] fp32, ids/weights [T, k] -> routed-expert output [T, H] fp32 (numba, all cores, no GIL).
    act_int8: int8 activations (int8/int4 weights). scratch, a dict, receives the pairs' gu and act. limit: SwiGLU's
    clamp (GLM-5.3-Flash's swiglu_limit). only: the experts (ids) to compute; the others' pairs are left out."""
    if act_int8 and fmt == "bf16":
        raise ValueError("int8 activations need int8 or int4 weights")
    if threads:
        numba.set_num_threads(threads)
    pair_token, pair_weight, experts, start = group_by_expert(ids, weights, only)
    pairs = len(pair_token)
    gu = np.empty((pairs, w13.shape[1]), np.float32)
    act = np.empty((pairs, w13.shape[1] // 2), np.float32)
    out = np.zeros_like(x)
    # empty scales cannot be indexed; give the bf16 kernel a dummy of the right rank
    s13 = s13 if s13.ndim == 3 else np.zeros((1, 1, 1), np.float32)
    s2 = s2 if s2.ndim == 3 else np.zeros((1, 1, 1), np.float32)
    moe_layer(FORMAT_CODES[fmt], group, w13, s13, w2, s2, x, pair_token, pair_weight, experts, start, gu, act, out,
              numba.get_num_threads(), act_int8, np.inf if limit is None else float(limit))
    if scratch is not None:
        scratch.update(gu=gu, act=act, pair_token=pair_token, pair_weight=pair_weight, experts=experts, start=start)
    return out
