"""hyper_connection.triton (kernels/hyper_connection_triton.py) against the reference HyperConnection
(model/glm5_next.py) on fresh random inputs, in Triton's interpreter on the CPU and on the GPU."""

from types import SimpleNamespace

import pytest
import torch

from glm5_offload.kernels import hyper_connection_triton
from glm5_offload.model import HyperConnection

from conftest import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_hc(M: int, D: int, iters: int, dtype, seed: int) -> tuple[HyperConnection, torch.Generator]:
    """A HyperConnection of M streams of D values with random weights in `dtype` (as the loader keeps them)."""
    config = SimpleNamespace(hc_mult=M, hidden_size=D, hc_sinkhorn_iters=iters, hc_eps=1e-6, rms_norm_eps=1e-5)
    hc = HyperConnection(config)
    g = torch.Generator().manual_seed(seed)
    n = (2 + M) * M
    hc.fn.data = (torch.randn(n, M * D, generator=g) * (M * D) ** -0.5).to(DEVICE, dtype)
    hc.base.data = torch.randn(n, generator=g).to(DEVICE, dtype)
    hc.scale.data = (1 + 0.3 * torch.randn(3, generator=g)).to(DEVICE, dtype)
    return hc, g


# GLM-5.3-Flash's 4 streams of 4096 (a decode step), 3 streams (M padded to 4) of a width that is no power of two,
# a prefill chunk past DECODE_ROWS (its logits by one fp32 matmul)
@pytest.mark.parametrize("S, M, D", [(1, 4, 4096), (3, 3, 200), (40, 4, 96)])
@pytest.mark.parametrize("iters", [20, 1])  # Flash's Sinkhorn steps; none after the first column normalisation
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mix_and_merge_equal_the_reference(S, M, D, iters, dtype):
    hc, g = make_hc(M, D, iters, dtype, seed=S * M * D + iters)
    streams = (3 * torch.randn(S, M, D, generator=g)).to(DEVICE, dtype)
    post, comb, h = hc(streams)
    got = hyper_connection_triton.mix(streams, hc.fn, hc.base, hc.scale, iters, hc.eps, hc.norm_eps)
    assert [t.dtype for t in got] == [torch.float32, torch.float32, dtype]
    assert [t.shape for t in got] == [post.shape, comb.shape, h.shape]
    assert rel_err(got[0], post) < 1e-5 and rel_err(got[1], comb) < 1e-5  # fp32 from the same inputs
    assert rel_err(got[2], h) < (1e-6 if dtype == torch.float32 else 4e-3)

    out = torch.randn(S, D, generator=g).to(DEVICE, dtype)
    new = hyper_connection_triton.merge(streams, out, post, comb)
    want = hc.merge(streams, out, post, comb)
    assert new.dtype == dtype and new.shape == (S, M, D)
    exact = post.double()[..., None] * out.double()[:, None, :] + comb.double().transpose(-1, -2) @ streams.double()
    if dtype == torch.float32:
        assert rel_err(new, want) < 1e-6
    else:  # rounded once where the reference rounds three times: at least as close to the exact sum
        assert rel_err(new, exact) <= rel_err(want, exact) + 1e-4 and rel_err(new, want) < 4e-3


@pytest.mark.parametrize("programs", [50, 200])  # 43 partial sums (two loads, the second masked); 128 of them
def test_the_logits_split_over_many_programs(monkeypatch, programs):
    """On a GPU the logits' GEMV splits its inputs over every SM (the interpreter runs one program): the mix kernel
    adds the partial sums SPLITS_BLOCK at a time."""
    from glm5_offload.kernels import router_triton

    monkeypatch.setattr(router_triton, "programs_wanted", lambda device: programs)
    hc, g = make_hc(4, 4096, 20, torch.float32, seed=programs)
    streams = torch.randn(1, 4, 4096, generator=g).to(DEVICE)
    assert router_triton.logits_parts(streams.view(1, -1), hc.fn).shape[0] == {50: 43, 200: 128}[programs]
    got, want = hyper_connection_triton.mix(streams, hc.fn, hc.base, hc.scale, 20, hc.eps, hc.norm_eps), hc(streams)
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_merge_rounds_its_terms_as_the_reference(dtype):
    """post, comb and the sublayer's output (fp32 where an MoE's sum is) rounded to the streams' dtype before their
    fp32 products, as the reference rounds them: each term alone (the other zero) equals the reference's to the bit;
    fp16 streams (--dtype float16) through the kernels' fp16 rounding."""
    hc, g = make_hc(4, 1024, 20, dtype, seed=16)
    streams = (3 * torch.randn(4, 4, 1024, generator=g)).to(DEVICE, dtype)
    post, comb, h = hc(streams)
    got = hyper_connection_triton.mix(streams, hc.fn, hc.base, hc.scale, 20, hc.eps, hc.norm_eps)
    assert got[2].dtype == dtype and rel_err(got[2], h) < 4e-3
    out = torch.randn(4, 1024, generator=g).to(DEVICE)
    for p, c in ((post, torch.zeros_like(comb)), (torch.zeros_like(post), comb)):  # post * out; comb^T streams
        new, want = hyper_connection_triton.merge(streams, out, p, c), hc.merge(streams, out, p, c)
        assert new.dtype == dtype and (new == want).float().mean() > 0.99
