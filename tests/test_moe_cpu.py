"""The numba MoE kernels against their torch reference on the same packed weights (formats/int_groups.py)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
import torch

from glm5_offload.formats import int_groups
from glm5_offload.kernels import moe_cpu

E, H, I = 8, 256, 128  # experts, hidden, inter (small: many tests; real dims live in bench/)


def layer(fmt, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    v13, s13 = int_groups.quantize(w13, fmt, group)
    v2, s2 = int_groups.quantize(w2, fmt, group)
    return (v13, s13, v2, s2), (w13, w2)


CASES = [("bf16", 128)] + [(f, g) for f in ("int8", "int4") for g in int_groups.GROUP_SIZES]


@pytest.mark.parametrize("fmt, group", CASES)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_kernel_equals_dequantised_reference(fmt, group, tokens):
    (v13, s13, v2, s2), _ = layer(fmt, group)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(tokens)])
    weights = torch.rand(tokens, 4, generator=g)
    ref = moe_cpu.moe_reference(x, int_groups.dequantize(v13, s13, fmt, group), int_groups.dequantize(v2, s2, fmt, group),
                                ids, weights)
    out = moe_cpu.moe_forward(fmt, group, v13, s13, v2, s2, x.numpy(), ids.numpy(), weights.numpy(), threads=2)
    assert np.isfinite(out).all()
    assert (torch.from_numpy(out) - ref).norm() / ref.norm() <= 1e-5


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_swiglu_limit_clamps_as_the_reference(fmt):
    """GLM-5.3-Flash's swiglu_limit: gate <= limit, -limit <= up <= limit, inside the kernel."""
    (v13, s13, v2, s2), _ = layer(fmt, 128)
    g = torch.Generator().manual_seed(7)
    x = 4 * torch.randn(5, H, generator=g)  # large enough that the clamp binds
    ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(5)])
    weights = torch.rand(5, 4, generator=g)
    w13, w2 = int_groups.dequantize(v13, s13, fmt, 128), int_groups.dequantize(v2, s2, fmt, 128)
    ref = moe_cpu.moe_reference(x, w13, w2, ids, weights, limit=1.0)
    assert (ref - moe_cpu.moe_reference(x, w13, w2, ids, weights)).norm() > 0.1 * ref.norm()  # it binds
    out = moe_cpu.moe_forward(fmt, 128, v13, s13, v2, s2, x.numpy(), ids.numpy(), weights.numpy(), threads=2,
                              limit=1.0)
    assert (torch.from_numpy(out) - ref).norm() / ref.norm() <= 1e-5


@pytest.mark.parametrize("fmt, group", CASES[1:])
@pytest.mark.parametrize("tokens", [1, 3, 40])  # 3: experts of 1-3 tokens (two rows a call), 40: tiles
def test_int8_activations_equal_their_reference(fmt, group, tokens):
    """Each projection against torch on the same int8-quantised inputs: gate/up from the quantised x, down
    from the kernel's own SiLU(gate) x up quantised the same way (so that a SiLU rounding one ulp apart
    cannot move an int8 code), <= 1e-5; and the whole layer against the reference."""
    (v13, s13, v2, s2), _ = layer(fmt, group)
    w13, w2 = int_groups.dequantize(v13, s13, fmt, group), int_groups.dequantize(v2, s2, fmt, group)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(tokens)])
    weights = torch.rand(tokens, 4, generator=g)
    scratch = {}
    out = moe_cpu.moe_forward(fmt, group, v13, s13, v2, s2, x.numpy(), ids.numpy(), weights.numpy(), threads=2,
                              act_int8=True, scratch=scratch)
    token = torch.from_numpy(scratch["pair_token"]).long()
    expert = torch.repeat_interleave(torch.from_numpy(scratch["experts"]).long(),
                                     torch.from_numpy(np.diff(scratch["start"])).long())
    xq = int_groups.quantize_activations(x, group)
    want_gu = torch.einsum("prh,ph->pr", w13[expert], xq[token])
    assert (torch.from_numpy(scratch["gu"]) - want_gu).norm() / want_gu.norm() <= 1e-5
    act = int_groups.quantize_activations(torch.from_numpy(scratch["act"]), group)
    want = torch.zeros(tokens, H).index_add_(
        0, token, torch.einsum("phi,pi->ph", w2[expert], act) * torch.from_numpy(scratch["pair_weight"])[:, None])
    assert (torch.from_numpy(out) - want).norm() / want.norm() <= 1e-5
    ref = moe_cpu.moe_reference(x, w13, w2, ids, weights, act_group=group)
    assert (torch.from_numpy(out) - ref).norm() / ref.norm() <= 1e-3  # a SiLU ulp may move a code


def test_int8_activations_stay_close_to_fp32_ones():
    (v13, s13, v2, s2), _ = layer("int8", 128)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1)).numpy()
    ids, weights = np.array([[0, 1, 2, 3]] * 5), np.full((5, 4), 0.25, np.float32)
    exact = moe_cpu.moe_forward("int8", 128, v13, s13, v2, s2, x, ids, weights)
    quant = moe_cpu.moe_forward("int8", 128, v13, s13, v2, s2, x, ids, weights, act_int8=True)
    assert np.linalg.norm(quant - exact) / np.linalg.norm(exact) < 0.02
    with pytest.raises(ValueError, match="int8 activations need int8 or int4 weights"):
        moe_cpu.moe_forward("bf16", 128, *layer("bf16", 128)[0], x, ids, weights, act_int8=True)


@numba.njit(parallel=True)
def _queue_drained(items, workers):
    counters, taken = np.zeros(2, np.int64), np.zeros(items, np.int64)
    for _ in numba.prange(workers):
        item = moe_cpu._take(counters, 1)
        while item < items:
            taken[item] += 1
            item = moe_cpu._take(counters, 1)
    return counters, taken


def test_the_work_queue_gives_each_item_once():
    """Every thread of a parallel region takes items until none are left: each item once, whatever the threads."""
    for workers in (1, numba.get_num_threads(), 4 * numba.get_num_threads()):
        counters, taken = _queue_drained(100_000, workers)
        assert (taken == 1).all() and counters.tolist() == [0, 100_000 + workers]


def test_grouping_keeps_every_pair():
    ids = np.array([[3, 1], [1, 0], [3, 2]])
    weights = np.arange(6, dtype=np.float32).reshape(3, 2)
    token, weight, experts, start = moe_cpu.group_by_expert(ids, weights)
    assert experts.tolist() == [0, 1, 2, 3] and start.tolist() == [0, 1, 3, 4, 6]
    assert sorted(zip(token.tolist(), weight.tolist())) == [(0, 0.0), (0, 1.0), (1, 2.0), (1, 3.0), (2, 4.0), (2, 5.0)]


@pytest.mark.parametrize("only", [False, True])
def test_grouping_is_a_stable_sort_by_expert(only):
    """The counting sort against numpy's stable argsort, on random routes (an expert repeated across tokens, some
    experts idle); `only` keeps the pairs of half of the experts."""
    rng = np.random.default_rng(1)
    ids, weights = rng.integers(0, 40, (300, 8)), rng.standard_normal((300, 8)).astype(np.float32)
    kept = np.sort(rng.choice(40, 20, replace=False)) if only else None
    flat, tokens, pair_weights = ids.reshape(-1), np.arange(ids.size) // 8, weights.reshape(-1)
    if only:
        mask = np.isin(flat, kept)
        flat, tokens, pair_weights = flat[mask], tokens[mask], pair_weights[mask]
    order = np.argsort(flat, kind="stable")
    experts, counts = np.unique(flat[order], return_counts=True)
    token, weight, got_experts, start = moe_cpu.group_by_expert(ids, weights, kept)
    assert token.tolist() == tokens[order].tolist() and weight.tolist() == pair_weights[order].tolist()
    assert got_experts.tolist() == experts.tolist() and start.tolist() == [0, *np.cumsum(counts).tolist()]


def test_grouping_refuses_a_negative_expert_id():
    with pytest.raises(ValueError, match="expert ids must be >= 0, got -1"):
        moe_cpu.group_by_expert(np.array([[0, -1]]), np.ones((1, 2), np.float32))


@numba.njit
def _two_rows_three_vectors(w, s, vq, vs, vsum):
    return moe_cpu._row_dots_u4q((w[0], w[1]), (s[0], s[1]), (vq[0], vq[1], vq[2]), (vs[0], vs[1], vs[2]),
                                 (vsum[0], vsum[1], vsum[2]))


@pytest.mark.parametrize("group", [32, 128])
def test_row_dots_take_rows_and_vectors(group):
    """_row_dots_u4q with two int4 rows and three int8 vectors: six dots, row major, against integer dots in numpy
    scaled per group (a line a step for groups of 128, 16 bytes a step for 32)."""
    rng = np.random.default_rng(group)
    groups = 3
    w = rng.integers(0, 256, (2, group // 2 * groups), dtype=np.uint8)
    s = rng.random((2, groups), dtype=np.float32)
    vq = rng.integers(-127, 128, (3, group * groups), dtype=np.int8)
    vs = rng.random((3, groups), dtype=np.float32)
    vsum = vq.reshape(3, groups, group).sum(-1).astype(np.int32)
    nibbles = w.reshape(2, groups, group // 2)
    weights = np.concatenate([nibbles & 15, nibbles >> 4], axis=2).astype(np.int64) - 8  # [2, G, group]
    dots = np.einsum("rgk,vgk->rvg", weights, vq.reshape(3, groups, group).astype(np.int64))
    want = (dots * s[:, None, :] * vs[None]).sum(-1).reshape(-1)
    got = np.array(_two_rows_three_vectors(w, s, vq, vs, vsum))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("first, last", [(0, 21), (2, 11), (3, 7), (5, 6), (0, 8)])
def test_a_tile_equals_exact_integer_dots(first, last):
    """_tile_rows: 16 int4 rows (groups of 128, from row 2 of 20) times int8 vectors chosen through `which`, by tiles of
    8 vectors then 4 (the last padded with repeats), against integer dots in numpy scaled per group. Where the CPU
    lacks VNNI the tile's quads are widened to int32 instead: the same sums."""
    rng = np.random.default_rng(first * 31 + last)
    groups, n = 3, 21
    w = rng.integers(0, 256, (20, 64 * groups), dtype=np.uint8)
    s = rng.random((20, groups), dtype=np.float32)
    vq = rng.integers(-127, 128, (n, 128 * groups), dtype=np.int8)
    vs = rng.random((n, groups), dtype=np.float32)
    vsum = vq.reshape(n, groups, 128).sum(-1).astype(np.int32)
    which = rng.permutation(n).astype(np.int32)
    res = np.full((n + 3, 16), np.nan, np.float32)
    moe_cpu._tile_rows(w, s, 2, vq, vs, vsum, which, first, last, np.empty((groups, 16), np.float32), res)
    nibbles = w[2:18].reshape(16, groups, 64)
    weights = np.concatenate([nibbles & 15, nibbles >> 4], axis=2).astype(np.int64) - 8  # [16, G, 128]
    chosen = which[first:last]
    dots = np.einsum("rgk,tgk->trg", weights, vq[chosen].reshape(-1, groups, 128).astype(np.int64))
    want = (dots * s[2:18][None] * vs[chosen][:, None, :]).sum(-1)
    assert np.abs(res[: last - first] - want).max() <= 1e-5 * np.abs(want).max()


def test_generated_code_is_vectorised():
    """Vector FMAs on wide registers, widening int8 loads, int4 weights prefetched ahead of their loads (near into
    every cache; far into L2 where a step is a line); read off a fresh (uncached) compile."""
    kernel = numba.njit(parallel=True, nogil=True, fastmath=moe_cpu._FASTMATH)(moe_cpu.moe_layer.py_func)
    for fmt, group in (("int8", 64), ("int4", 64)):
        (v13, s13, v2, s2), _ = layer(fmt, group)
        x = np.random.default_rng(0).standard_normal((1, H), np.float32)
        token, weight, experts, start = moe_cpu.group_by_expert(np.array([[0, 1]]), np.ones((1, 2), np.float32))
        for act_int8 in (False, True):
            kernel(moe_cpu.FORMAT_CODES[fmt], group, v13, s13, v2, s2, x, token, weight, experts, start,
                   np.empty((2, 2 * I), np.float32), np.empty((2, I), np.float32), np.zeros((1, H), np.float32),
                   numba.get_num_threads(), act_int8)
    asm = "\n".join(kernel.inspect_asm().values())
    assert re.search(r"vfmadd\w*ps\s+[^\n]*%[yz]mm", asm)  # packed fp32 FMAs on 256/512-bit registers
    assert "vpmovsxbd" in asm or "vpmovsxbw" in asm  # int8 sign-extended a vector at a time
    assert "vgather" not in asm  # contiguous loads, not gathers
    # the line PREFETCH_AHEAD bytes on, as an immediate displacement; where LLVM folded every distance into the
    # loop's registers (AVX2 on an AMD EPYC: `prefetcht0 (%r12,%r10)`) only the prefetches can be seen
    displaced = re.findall(r"prefetcht0\s+(-?\d+)\(", asm)
    assert str(moe_cpu.PREFETCH_AHEAD) in displaced if displaced else re.search(r"prefetcht0\s+\(", asm)
    # int8 activations: widening multiply-adds, int16 pairs into int32 (vpdpwssd where AVX512-VNNI is there)
    assert re.search(r"(vpmaddwd|vpdpwssd)\s+[^\n]*%[yz]mm", asm)
    if moe_cpu._has_vnni():  # int4 nibbles straight into u8 x s8 quads; a tile's inputs broadcast from memory
        assert re.search(r"vpdpbusd\s+[^\n]*%zmm", asm)
        assert re.search(r"vpdpbusd\s+[^\n]*\{1to16\}", asm)
        assert re.search(rf"prefetcht2\s+{moe_cpu.PREFETCH_FAR}\(", asm)  # a line a step: the one PREFETCH_FAR on


def test_int8_activations_without_vnni(tmp_path):
    """The portable path (vpmaddwd pairs, no vpdpbusd), compiled fresh in a process that may not use VNNI; where the
    CPU has no VNNI, every test here runs that path already."""
    if not moe_cpu._has_vnni():
        pytest.skip("no AVX512-VNNI here: the other tests run the portable path")
    code = """
import numpy as np, torch
from glm5_offload.formats import int_groups
from glm5_offload.kernels import moe_cpu
import test_moe_cpu as t
assert not moe_cpu._has_vnni()
for fmt, group in (("int4", 32), ("int4", 128), ("int8", 64)):
    (v13, s13, v2, s2), _ = t.layer(fmt, group)
    x = torch.randn(3, t.H, generator=torch.Generator().manual_seed(0))
    ids, w = np.array([[0, 1], [2, 3], [1, 5]]), np.full((3, 2), 0.5, np.float32)
    out = moe_cpu.moe_forward(fmt, group, v13, s13, v2, s2, x.numpy(), ids, w, act_int8=True)
    ref = moe_cpu.moe_reference(x, int_groups.dequantize(v13, s13, fmt, group), int_groups.dequantize(v2, s2, fmt, group),
                                torch.from_numpy(ids), torch.from_numpy(w), act_group=group)
    assert (torch.from_numpy(out) - ref).norm() / ref.norm() <= 1e-3, fmt
print("ok")
"""
    env = {**os.environ, "GLM5_NO_VNNI": "1", "NUMBA_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
