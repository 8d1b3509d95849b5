"""The numba MoE kernels against their torch reference on the same quantised weights."""

import re

import numba
import numpy as np
import pytest
import torch

from glm5_offload.kernels import moe_cpu

E, H, I = 8, 256, 128  # experts, hidden, inter (small: many tests; real dims live in bench/)


def layer(fmt, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    v13, s13 = moe_cpu.quantize(w13, fmt, group)
    v2, s2 = moe_cpu.quantize(w2, fmt, group)
    return (v13, s13, v2, s2), (w13, w2)


CASES = [("bf16", 128)] + [(f, g) for f in ("int8", "int4") for g in moe_cpu.GROUP_SIZES]


@pytest.mark.parametrize("fmt, group", CASES)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_kernel_equals_dequantised_reference(fmt, group, tokens):
    (v13, s13, v2, s2), _ = layer(fmt, group)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(tokens)])
    weights = torch.rand(tokens, 4, generator=g)
    ref = moe_cpu.moe_reference(x, moe_cpu.dequantize(v13, s13, fmt, group), moe_cpu.dequantize(v2, s2, fmt, group),
                                ids, weights)
    out = moe_cpu.moe_forward(fmt, group, v13, s13, v2, s2, x.numpy(), ids.numpy(), weights.numpy(), threads=2)
    assert np.isfinite(out).all()
    assert (torch.from_numpy(out) - ref).norm() / ref.norm() <= 1e-5


@pytest.mark.parametrize("fmt, group, bound", [("bf16", 128, 0.005), ("int8", 32, 0.01), ("int8", 128, 0.01),
                                               ("int4", 32, 0.12), ("int4", 128, 0.14)])
def test_quantisation_error_fits_the_format(fmt, group, bound):
    (v13, s13, _, _), (w13, _) = layer(fmt, group)
    back = moe_cpu.dequantize(v13, s13, fmt, group)
    assert (back - w13).norm() / w13.norm() < bound
    if fmt != "bf16":
        assert s13.shape == (E, 2 * I, H // group) and s13.dtype == np.float32
    assert v13.nbytes == {"bf16": 2, "int8": 1, "int4": 0.5}[fmt] * w13.numel()


def test_int4_packing_layout():
    w = torch.zeros(1, 1, 64)
    w[0, 0, :32] = 7.0  # group 64: inputs 0..31 in the low nibbles, 32..63 in the high ones
    w[0, 0, 32:] = -7.0
    v, s = moe_cpu.quantize(w, "int4", 64)
    assert v.shape == (1, 1, 32) and (v == (15 | (1 << 4))).all() and s[0, 0, 0] == pytest.approx(1.0)


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="group size 96"):
        moe_cpu.quantize(torch.randn(1, 4, 256), "int8", 96)


def test_grouping_keeps_every_pair():
    ids = np.array([[3, 1], [1, 0], [3, 2]])
    weights = np.arange(6, dtype=np.float32).reshape(3, 2)
    token, weight, experts, start = moe_cpu.group_by_expert(ids, weights)
    assert experts.tolist() == [0, 1, 2, 3] and start.tolist() == [0, 1, 3, 4, 6]
    assert sorted(zip(token.tolist(), weight.tolist())) == [(0, 0.0), (0, 1.0), (1, 2.0), (1, 3.0), (2, 4.0), (2, 5.0)]


def test_generated_code_is_vectorised():
    """Vector FMAs on wide registers and widening int8 loads; read off a fresh (uncached) compile."""
    kernel = numba.njit(parallel=True, nogil=True, fastmath=moe_cpu._FASTMATH)(moe_cpu.moe_layer.py_func)
    for fmt, group in (("int8", 64), ("int4", 64)):
        (v13, s13, v2, s2), _ = layer(fmt, group)
        x = np.random.default_rng(0).standard_normal((1, H), np.float32)
        token, weight, experts, start = moe_cpu.group_by_expert(np.array([[0, 1]]), np.ones((1, 2), np.float32))
        kernel(moe_cpu.FORMATS[fmt], group, v13, s13, v2, s2, x, token, weight, experts, start,
               np.empty((2, 2 * I), np.float32), np.empty((2, I), np.float32), np.zeros((1, H), np.float32))
    asm = "\n".join(kernel.inspect_asm().values())
    assert re.search(r"vfmadd\w*ps\s+[^\n]*%[yz]mm", asm)  # packed fp32 FMAs on 256/512-bit registers
    assert "vpmovsxbd" in asm or "vpmovsxbw" in asm  # int8 sign-extended a vector at a time
    assert "vgather" not in asm  # contiguous loads, not gathers
