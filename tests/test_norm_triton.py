"""norm.triton (kernels/rmsnorm_triton.py) against the reference RMSNorm (model/blocks.py) on fresh random inputs, in
Triton's interpreter on the CPU and on the GPU."""

import pytest
import torch

from glm5_offload.kernels import rmsnorm_triton
from glm5_offload.model import RMSNorm
from glm5_offload.ops.norm_triton import TritonRMSNorm

from conftest import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_norm(dim: int, dtype, seed: int) -> tuple[RMSNorm, torch.Generator]:
    norm = RMSNorm(dim, 1e-6)
    g = torch.Generator().manual_seed(seed)
    norm.weight.data = (1 + 0.5 * torch.randn(dim, generator=g)).to(DEVICE, dtype)
    return norm, g


# GLM-5's hidden, q_lora and kv_lora widths, DeepSeek-V3.2's hidden, a width that is no power of two
@pytest.mark.parametrize("rows, dim", [(1, 6144), (3, 2048), (40, 512), (2, 7168), (5, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_equals_the_reference(rows, dim, dtype):
    norm, g = make_norm(dim, dtype, seed=rows * dim)
    x = (3 * torch.randn(rows, dim, generator=g)).to(DEVICE, dtype)
    want = RMSNorm.forward(norm, x)
    got = rmsnorm_triton.rmsnorm(x, norm.weight, norm.eps)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        assert rel_err(got, want) < 1e-6
    else:  # the normalised row is rounded to bf16 before the weight: a sum in another order may move one ulp
        assert rel_err(got, want) < 4e-3 and (got == want).float().mean() > 0.98


def test_a_strided_and_a_batched_input():
    """MLA's kv_a norm takes a column slice of [c | k_pe] (rows 576 apart); a [S, H, D] input keeps its shape."""
    norm, g = make_norm(512, torch.bfloat16, seed=1)
    packed = torch.randn(7, 576, generator=g).to(DEVICE, torch.bfloat16)
    c = packed[:, :512]
    assert rel_err(rmsnorm_triton.rmsnorm(c, norm.weight, norm.eps), RMSNorm.forward(norm, c)) < 4e-3
    norm, g = make_norm(64, torch.float32, seed=2)
    x = torch.randn(3, 4, 64, generator=g).to(DEVICE)
    got = rmsnorm_triton.rmsnorm(x, norm.weight, norm.eps)
    assert got.shape == (3, 4, 64) and rel_err(got, RMSNorm.forward(norm, x)) < 1e-6
    assert rmsnorm_triton.rmsnorm(x[:0], norm.weight, norm.eps).shape == (0, 4, 64)


def test_a_nan_row_stays_its_own_and_huge_values_stay_finite():
    """A NaN poisons its row only, as in the reference; a row of values near 1e18 (its squares' sum near fp32's
    largest) normalises as the reference does."""
    norm, g = make_norm(256, torch.float32, seed=3)
    x = torch.randn(4, 256, generator=g)
    x[1, 17] = float("nan")
    x[2] *= 1e18
    x = x.to(DEVICE)
    got, want = rmsnorm_triton.rmsnorm(x, norm.weight, norm.eps), RMSNorm.forward(norm, x)
    assert got[1].isnan().all() and torch.isfinite(got[[0, 2, 3]]).all()
    assert torch.allclose(got[[0, 2, 3]], want[[0, 2, 3]], rtol=1e-5, atol=1e-6)


def test_the_operator_module_runs_the_kernel_and_keeps_the_weight():
    norm, g = make_norm(128, torch.float32, seed=4)
    x = torch.randn(2, 128, generator=g).to(DEVICE)
    want = RMSNorm.forward(norm, x)
    norm.__class__ = TritonRMSNorm  # what the operator's build does to the loaded module
    assert rel_err(norm(x), want) < 1e-6
