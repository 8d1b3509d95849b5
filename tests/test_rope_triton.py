"""kernels/rope_triton.py against model/rope.py's apply_rope on fresh random inputs, in Triton's interpreter on the CPU
and on the GPU: the views MLA and the indexer rope (strided query and key parts, queries with a rest copied),
both pair layouts, yarn's scaled angles."""

import pytest
import torch

from glm5_offload.kernels import rope_triton
from glm5_offload.model.rope import apply_rope, cos_sin

from conftest import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def angles(S: int, rope_dim: int, seed: int, scaling: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 1 << 20, (S,), generator=g)  # up to a 1M context's
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    cos, sin = cos_sin(inv_freq, scaling, positions)
    return cos.to(DEVICE), sin.to(DEVICE), g


def reference(x, cos, sin, rope_dim, interleaved):
    rot, rest = x.split([rope_dim, x.shape[-1] - rope_dim], dim=-1)
    return torch.cat([apply_rope(rot, cos, sin, interleaved), rest], dim=-1)


def check(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    if dtype == torch.bfloat16:  # every product and sum rounded as torch rounds it
        assert torch.equal(got, want)
    else:  # the GPU may fuse a product and a difference into one FMA
        assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("S", [1, 3, 70])
def test_mla_query_and_key_parts(S, interleaved, dtype):
    """GLM-5's q_pe: the last 64 of each head's 256 query values (a strided view); k_pe: the last 64 of the 576-wide
    kv_a output."""
    H, nope, R, L = 64, 192, 64, 512
    cos, sin, g = angles(S, R, seed=S, scaling=1.2)
    q = (2 * torch.randn(S, H, nope + R, generator=g)).to(DEVICE, dtype)
    kv = (2 * torch.randn(S, L + R, generator=g)).to(DEVICE, dtype)
    q_pe, k_pe = q[..., nope:], kv[:, L:]
    check(rope_triton.rope(q_pe, cos, sin, R, interleaved), apply_rope(q_pe, cos, sin, interleaved), dtype)
    check(rope_triton.rope(k_pe, cos, sin, R, interleaved), apply_rope(k_pe, cos, sin, interleaved), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
def test_indexer_queries_keep_their_rest(interleaved, dtype):
    """The indexer's [S, 32, 128] queries: the first 64 values roped, the other 64 copied as they are."""
    S, H, D, R = 37, 32, 128, 64
    cos, sin, g = angles(S, R, seed=5)
    q = (3 * torch.randn(S, H, D, generator=g)).to(DEVICE, dtype)
    got = rope_triton.rope(q, cos, sin, R, interleaved)
    check(got, reference(q, cos, sin, R, interleaved), dtype)
    assert torch.equal(got[..., R:], q[..., R:])


def test_more_rows_than_a_program_and_no_rows():
    """Rows past one program's block (a prefill chunk's) are all roped; an empty chunk gives an empty tensor."""
    S, H, R = rope_triton.ROWS // 16 + 3, 16, 16
    cos, sin, g = angles(S, R, seed=7)
    x = torch.randn(S, H, R, generator=g).to(DEVICE, torch.bfloat16)
    check(rope_triton.rope(x, cos, sin, R, False), apply_rope(x, cos, sin, False), torch.bfloat16)
    assert rope_triton.rope(x[:0], cos[:0], sin[:0], R, False).shape == (0, H, R)


def test_a_nan_stays_in_its_row_and_a_bad_rope_dim_is_refused():
    cos, sin, g = angles(4, 64, seed=9)
    x = torch.randn(4, 2, 64, generator=g).to(DEVICE)
    x[1, 0, 3] = float("nan")
    got = rope_triton.rope(x, cos, sin, 64, True)
    assert got[1, 0].isnan().any() and torch.isfinite(got[[0, 2, 3]]).all() and torch.isfinite(got[1, 1]).all()
    with pytest.raises(ValueError, match="rope_dim 48"):
        rope_triton.rope(x, cos[:, :24], sin[:, :24], 48, True)
