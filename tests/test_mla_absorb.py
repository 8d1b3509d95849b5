"""Absorbed MLA's products with kv_b_proj as stored (kernels/mla_absorb.py) against the reference's dequantised
matmuls (model/mla.py's Attention.absorb_query / absorb_output), in Triton's interpreter on the CPU and on the GPU."""

import pytest
import torch

from glm5_offload.formats import fp8_blocks
from glm5_offload.kernels import mla_absorb

from conftest import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q_nope, o, weight, dtype, nope):
    """Attention's reference: W dense in `dtype`, its slices widened to fp32, two batched matmuls."""
    H = q_nope.shape[1]
    w = weight.view(H, -1, weight.shape[1]).float()
    return (torch.einsum("shd,hdl->shl", q_nope.float(), w[:, :nope]),
            torch.einsum("shl,hvl->shv", o.float(), w[:, nope:]))


# GLM-5's heads (192 + 256 rows of 512) and odd ones: heads that straddle 128-row scale blocks, partial blocks
@pytest.mark.parametrize("H, nope, v, L", [(2, 192, 256, 512), (3, 40, 72, 200)])
@pytest.mark.parametrize("S", [1, 3, 5])  # registers' sums (up to BROADCAST_ROWS rows), then dots
@pytest.mark.parametrize("fmt, dtype", [("fp8", torch.bfloat16), ("fp8", torch.float32), ("dense", torch.bfloat16)])
def test_absorbed_products_equal_the_reference(H, nope, v, L, S, fmt, dtype):
    g = torch.Generator().manual_seed(S + L)
    w = torch.randn(H * (nope + v), L, generator=g) * 0.05
    q_nope = torch.randn(S, H, nope, generator=g).to(dtype)
    o = torch.randn(S, H, L, generator=g)
    if fmt == "fp8":
        w8, scales = fp8_blocks.quantize(w)
        dense = fp8_blocks.dequantize(w8, scales).to(dtype)
        stored = (w8.to(DEVICE), scales.to(DEVICE), dtype)
    else:
        dense = w.to(dtype)
        stored = (dense.to(DEVICE), None, dtype)
    want_q, want_o = reference(q_nope, o, dense, dtype, nope)
    got_q = mla_absorb.absorb_query(q_nope.to(DEVICE), *stored, nope + v)
    got_o = mla_absorb.absorb_output(o.to(DEVICE), *stored, nope, nope + v)
    assert got_q.dtype == got_o.dtype == torch.float32
    assert got_q.shape == want_q.shape and got_o.shape == want_o.shape
    # the same products in fp32, summed in another order
    assert rel_err(got_q.cpu(), want_q) < 1e-6 and rel_err(got_o.cpu(), want_o) < 1e-6
