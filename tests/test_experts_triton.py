"""The routed experts' GPU kernels against their references (interpreter on the CPU): dequantisation against
int_groups.dequantize, SwiGLU against model.swiglu and int_groups.quantize_activations."""

import pytest
import torch

from glm5_offload.formats import int_groups
from glm5_offload.kernels import experts_triton
from glm5_offload.model import swiglu

from conftest import assert_bf16_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("fmt, group", [("int8", 32), ("int8", 128), ("int4", 32), ("int4", 128)])
def test_dequantize_equals_the_reference(fmt, group):
    w = torch.randn(1, 77, 256, generator=torch.Generator().manual_seed(group)) * 3  # 77 rows: a partial block
    values, scales = int_groups.quantize(w, fmt, group)
    want = int_groups.dequantize(values, scales, fmt, group)[0]
    out = torch.full((77, 256), float("nan"), device=DEVICE)  # poisoned: every element must be written
    experts_triton.dequantize(torch.from_numpy(values[0]).to(DEVICE), torch.from_numpy(scales[0]).to(DEVICE), fmt,
                              group, out=out)
    assert torch.equal(out.cpu(), want)  # q x scale in fp32: exact
    assert_bf16_of(experts_triton.dequantize(torch.from_numpy(values[0]).to(DEVICE),
                                             torch.from_numpy(scales[0]).to(DEVICE), fmt, group), want)
    with pytest.raises(ValueError, match="int8 or int4"):
        experts_triton.dequantize(torch.from_numpy(values[0]), torch.from_numpy(scales[0]), "bf16", group)



@pytest.mark.parametrize("limit", [None, 2.0])
@pytest.mark.parametrize("group, quantize", [(32, True), (128, True), (32, False)])
def test_swiglu_equals_the_reference(group, quantize, limit):
    """The GPU path's SwiGLU (and, with int8 activations, the down projection's inputs rounded as the CPU rounds
    them) against swiglu then int_groups.quantize_activations: 75 rows (a partial block), one group all zeros (scale
    0), up values of 1e30 in another (huge, finite products). Every value to exp's rounding in fp32, to one bf16 step in
    bf16 (computed in fp32 from the bf16 inputs, rounded once); where that rounding moves a value across a tie of the
    int8 rounding, one int8 step (amax / 127) at a few values (0.1% at most)."""
    g = torch.Generator().manual_seed(group + int(quantize))
    gu = torch.randn(75, 2 * 256, generator=g) * 3
    gu[5, :group] = 0.0  # gate 0: silu 0, a group of zeros
    gu[9, 256 : 256 + group] = 1e30
    for dtype, close, share in ((torch.float32, 1e-5, 0.999 if quantize else 1.0), (torch.bfloat16, 2**-7, 0.999)):
        x = gu.to(dtype)
        want = swiglu(x[:, :256].float(), x[:, 256:].float(), limit)
        step = 0.0
        if quantize:
            want = int_groups.quantize_activations(want, group)
            step = want.abs().reshape(75, -1, group).amax(-1, keepdim=True).expand(-1, -1, group).reshape(75, 256) / 127
        got = experts_triton.swiglu(x.to(DEVICE), limit, group, quantize).cpu()
        assert got.shape == want.shape and got.dtype == dtype and torch.isfinite(got).all()
        assert torch.equal(got[5, :group].float(), torch.zeros(group))
        error, rounding = (got.float() - want).abs(), close * want.abs() + 1e-30
        assert (error <= rounding).float().mean() >= share
        assert (error <= rounding + step * 1.001).all()


@pytest.mark.parametrize("group", [32, 128])
def test_rounded_activations_equal_the_reference(group):
    """The GPU path's rounding of a chunk's inputs against int_groups.quantize_activations: 70 rows (a partial block),
    a group of zeros, one of 1e30 and one with a NaN (its group's values NaN, as the reference's); fp32 bit for bit,
    bf16 within a bf16 step (the interpreter rounds toward zero)."""
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(group)) * 4
    x[3, :group], x[7, group : 2 * group], x[11, 5] = 0.0, 1e30, float("nan")
    want = int_groups.quantize_activations(x, group)
    got = experts_triton.round_activations(x.to(DEVICE), group).cpu()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert got.isnan().sum() == group and torch.equal(got[3, :group], torch.zeros(group))
    x16 = x.bfloat16()
    got16 = experts_triton.round_activations(x16.to(DEVICE), group).cpu()
    want16 = int_groups.quantize_activations(x16.float(), group)
    assert got16.dtype == torch.bfloat16 and torch.equal(got16.isnan(), want16.isnan())
    ok = want16.isfinite()
    assert ((got16.float() - want16).abs()[ok] <= want16.abs()[ok] * 2**-7).all()
