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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("S", [1, 5])
def test_the_query_and_its_rope_part_in_one_launch(S, interleaved, dtype):
    """absorb_query over q_b_proj's output split as MLA splits it (strided views): q_lat as without rope, and the rope
    part rotated as rope_triton rotates it (bit for bit in bf16, every op rounded as torch's; fp32 to an FMA)."""
    from glm5_offload.model.rope import apply_rope, cos_sin

    H, nope, R, v, L = 3, 40, 16, 72, 200
    g = torch.Generator().manual_seed(S + 11)
    w8, scales = fp8_blocks.quantize(torch.randn(H * (nope + v), L, generator=g) * 0.05)
    q = (2 * torch.randn(S, H, nope + R, generator=g)).to(DEVICE, dtype)
    q_nope, q_pe = q.split([nope, R], dim=-1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, R, 2) / R))
    cos, sin = cos_sin(inv_freq, 1.0, torch.randint(0, 1 << 20, (S,), generator=g))
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    stored = (w8.to(DEVICE), scales.to(DEVICE), dtype, nope + v)
    q_lat, pe = mla_absorb.absorb_query(q_nope, *stored, rope=(q_pe, cos, sin, interleaved))
    assert torch.equal(q_lat, mla_absorb.absorb_query(q_nope.contiguous(), *stored))
    # in bf16 (what sparse MLA reads on a GPU): the same fp32 sums, rounded as torch's cast rounds them
    q_bf16, pe_too = mla_absorb.absorb_query(q_nope, *stored, rope=(q_pe, cos, sin, interleaved),
                                             out_dtype=torch.bfloat16)
    assert q_bf16.dtype == torch.bfloat16 and torch.equal(q_bf16, q_lat.to(torch.bfloat16)) and torch.equal(pe_too, pe)
    want = apply_rope(q_pe, cos, sin, interleaved)
    assert pe.shape == want.shape and pe.dtype == dtype and pe.is_contiguous()
    if dtype == torch.bfloat16 or DEVICE == "cpu":
        assert torch.equal(pe, want)
    else:
        assert rel_err(pe, want) < 1e-6
    with pytest.raises(ValueError, match="strides"):
        mla_absorb.absorb_query(q_nope, *stored, rope=(q_pe.contiguous(), cos, sin, interleaved))


def test_narrower_tiles_take_their_scale_blocks_and_wider_ones_are_refused():
    """Tiles of 64 and 32 columns (a sweep's shapes) over odd heads read each row's scale of the 128-column block they
    lie in (and write bf16 as torch's cast of their fp32 sums); a tile past one block (its columns would need two
    scales a row) and an output dtype other than fp32 and bf16 are refused before any launch."""
    H, nope, v, L = 3, 40, 72, 200
    g = torch.Generator().manual_seed(5)
    w8, scales = fp8_blocks.quantize(torch.randn(H * (nope + v), L, generator=g) * 0.05)
    q_nope, o = torch.randn(1, H, nope, generator=g).to(torch.bfloat16), torch.randn(1, H, L, generator=g)
    want_q, want_o = reference(q_nope, o, fp8_blocks.dequantize(w8, scales).to(torch.bfloat16), torch.bfloat16, nope)
    stored = (w8.to(DEVICE), scales.to(DEVICE), torch.bfloat16)
    got_q = mla_absorb.absorb_query(q_nope.to(DEVICE), *stored, nope + v, block_c=64, block_d=16)
    got_o = mla_absorb.absorb_output(o.to(DEVICE), *stored, nope, nope + v, block_v=32, block_l=32)
    assert rel_err(got_q.cpu(), want_q) < 1e-6 and rel_err(got_o.cpu(), want_o) < 1e-6
    o_bf16 = mla_absorb.absorb_output(o.to(DEVICE), *stored, nope, nope + v, block_v=32, block_l=32,
                                      out_dtype=torch.bfloat16)
    assert o_bf16.dtype == torch.bfloat16 and torch.equal(o_bf16, got_o.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out_dtype must be float32 or bfloat16, not torch.float16"):
        mla_absorb.absorb_output(o.to(DEVICE), *stored, nope, nope + v, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="block_c must be a power of two up to 128, got 256"):
        mla_absorb.absorb_query(q_nope.to(DEVICE), *stored, nope + v, block_c=256)
    with pytest.raises(ValueError, match="block_l must be a power of two up to 128, got 96"):
        mla_absorb.absorb_output(o.to(DEVICE), *stored, nope, nope + v, block_l=96)
