"""norm.triton (kernels/rmsnorm_triton.py) against the reference RMSNorm (model/blocks.py) on fresh random inputs, in
Triton's interpreter on the CPU and on the GPU."""

import pytest
import torch

from glm5_offload.kernels import rmsnorm_triton
from glm5_offload.loader import load_model
from glm5_offload.model import RMSNorm
from glm5_offload.ops.norm_triton import TritonRMSNorm
from glm5_offload.rules import load_rules
from glm5_offload.runtime.kv_cache import new_cache

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


# the residual stream's pending addition: an attention's output (one addend), a MoE block's routed sum and its shared
# expert's output (two), either in fp32 (as the routed sum comes back from the host) and each rounded to x's dtype
@pytest.mark.parametrize("rows, dim", [(1, 6144), (7, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("add_dtypes", [("x",), (torch.float32, "x"), ("x", torch.float32)],
                         ids=["attention", "moe", "moe-fp32-shared"])
def test_add_rmsnorm_equals_the_reference_add_then_norm(rows, dim, dtype, add_dtypes):
    norm, g = make_norm(dim, dtype, seed=rows + dim)
    x = (3 * torch.randn(rows, dim, generator=g)).to(DEVICE, dtype)
    adds = tuple(torch.randn(rows, dim, generator=g).to(DEVICE, dtype if d == "x" else d) for d in add_dtypes)
    want_x, want = RMSNorm.add_forward(norm, x, adds)
    got_x, got = rmsnorm_triton.add_rmsnorm(x, adds, norm.weight, norm.eps)
    assert got_x.dtype == x.dtype and got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got_x, want_x)  # each sum rounded to x's dtype in the reference's order: bit for bit
    assert not torch.equal(got_x, x + adds[0].to(dtype)) or len(adds) == 1  # (the second addend is not dropped)
    if dtype == torch.float32:
        assert rel_err(got, want) < 1e-6
    else:
        assert rel_err(got, want) < 4e-3 and (got == want).float().mean() > 0.98


def test_add_rmsnorm_keeps_the_input_and_its_shape_and_a_nan_its_row():
    norm, g = make_norm(64, torch.float32, seed=5)
    x = torch.randn(2, 3, 64, generator=g).to(DEVICE)
    add = torch.randn(2, 3, 64, generator=g).to(DEVICE)
    add[1, 2, 5] = float("nan")
    before = x.clone()
    got_x, got = rmsnorm_triton.add_rmsnorm(x, (add,), norm.weight, norm.eps)
    want_x, want = RMSNorm.add_forward(norm, x, (add,))
    assert torch.equal(x, before) and got.shape == got_x.shape == (2, 3, 64)
    assert got[1, 2].isnan().all() and got_x[1, 2, 5].isnan() and torch.isfinite(got.flatten(0, 1)[:5]).all()
    assert torch.allclose(got.flatten(0, 1)[:5], want.flatten(0, 1)[:5], rtol=1e-5, atol=1e-6)
    assert torch.equal(got_x.nan_to_num(), want_x.nan_to_num())
    with pytest.raises(ValueError, match="one or two addends, not 3"):
        rmsnorm_triton.add_rmsnorm(x, (add, add, add), norm.weight, norm.eps)


def test_the_operator_module_adds_in_the_kernel_and_without_addends_only_norms():
    norm, g = make_norm(128, torch.bfloat16, seed=6)
    x, add = (torch.randn(3, 128, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    want_x, want = RMSNorm.add_forward(norm, x, (add,))
    alone = RMSNorm.forward(norm, x)
    norm.__class__ = TritonRMSNorm
    got_x, got = norm.add_forward(x, (add,))
    assert torch.equal(got_x, want_x) and rel_err(got, want) < 4e-3
    same_x, normed = norm.add_forward(x, ())
    assert same_x is x and rel_err(normed, alone) < 4e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_addend_on_another_device_takes_the_reference_path():
    """A sublayer a rule placed on the CPU (a shared expert's output, fp32) beside the GPU's residual stream: the
    reference's add (each part moved to x's device) and norm, not the kernel, which reads only x's device."""
    norm, g = make_norm(128, torch.bfloat16, seed=7)
    x, on_gpu = (torch.randn(3, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    on_cpu = torch.randn(3, 128, generator=g)
    want_x, want = RMSNorm.add_forward(norm, x, (on_cpu, on_gpu))
    norm.__class__ = TritonRMSNorm
    got_x, got = norm.add_forward(x, (on_cpu, on_gpu))
    assert got_x.device == x.device and torch.equal(got_x, want_x) and torch.equal(got, want)


def test_a_model_whose_norms_add_the_residual_gives_the_reference_logits(tiny_dir):
    """The tiny GLM-5 (a dense layer, MoE layers with a shared expert) with every norm swapped for norm.triton's
    module, which adds each sublayer's pending output (the attention's; the routed experts' and the shared expert's)
    in its kernel: a prompt, then decode steps, give the logits of the reference norms, which add in torch."""
    model = load_model(tiny_dir(), device=DEVICE, rules=load_rules("glm5-cpu"), max_seq_len=64)
    norms = [m for m in model.modules() if type(m) is RMSNorm]
    assert len(norms) >= 2 * len(model.model.layers) + 1

    def logits():
        cache = new_cache(model, 64)
        return torch.cat([model(torch.tensor(ids, device=DEVICE), cache) for ids in ([5, 17, 3, 99, 42], [8], [61])])

    want = logits()
    for norm in norms:
        norm.__class__ = TritonRMSNorm
    assert rel_err(logits(), want) < 1e-5
