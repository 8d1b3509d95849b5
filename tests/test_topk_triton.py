"""The radix-select top-k kernel against torch.topk (model.mla.topk_indices): the interpreter on the CPU, a 1M-wide
row on the GPU."""

import pytest
import torch

from glm5_offload.kernels import topk_triton
from glm5_offload.model import topk_indices

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def expected(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The documented order, written out: per row the positions above the k-th largest score ascending, then the
    tied ones ascending up to k; -1 for a -inf score."""
    rows = []
    for row in scores:
        kth = row.sort(descending=True).values[min(k, row.numel()) - 1]
        above = (row > kth).nonzero().flatten()
        ties = (row == kth).nonzero().flatten()[: min(k, row.numel()) - above.numel()]
        picked = torch.cat([above, ties])
        rows.append(picked.masked_fill(row[picked] == float("-inf"), -1))
    return torch.stack(rows)


def random_scores(S, T, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(S, T, generator=g) * torch.rand(S, 1, generator=g) * 100
    scores[:, torch.randperm(T, generator=g)[: T // 3]] = float("-inf")  # masked positions (causal, a bucket)
    ties = torch.randperm(T, generator=g)[: T // 5]
    scores[0, ties] = scores[0].sort(descending=True).values[min(20, T - 1)].item()  # row 0: many equal to its k-th
    if S > 1:
        scores[1, : T // 2] = -scores[1, : T // 2].abs()  # negative scores
    return scores


@pytest.mark.parametrize("S, T, k, block", [(3, 5000, 64, 4096), (2, 3000, 700, 256), (4, 200, 300, 64),
                                            (1, 1, 8, 4096)])
def test_topk_equals_torch(monkeypatch, S, T, k, block):
    """Every row: torch.topk's set (by values), in the documented order; many programs a row when the block is
    small (the counts before a program give its offsets); k > T, -inf rows' positions as -1; all ties."""
    monkeypatch.setattr(topk_triton, "BLOCK", block)
    scores = random_scores(S, T, seed=S * T + k)
    got = topk_triton.topk_indices(scores.to(DEVICE), k).cpu()
    want = topk_indices(scores, k)
    assert got.shape == want.shape == (S, min(k, T))
    assert torch.equal(got, expected(scores, k))
    valid = got >= 0
    assert torch.equal(valid.sum(1), (want >= 0).sum(1))
    got_values = torch.where(valid, scores.gather(1, got.clamp(min=0)), float("-inf"))
    assert torch.equal(got_values.sort(1).values, torch.where(want >= 0, scores.gather(1, want.clamp(min=0)),
                                                              float("-inf")).sort(1).values)


def test_all_equal_and_all_masked_rows():
    scores = torch.stack([torch.full((700,), 1.5), torch.full((700,), float("-inf"))])
    got = topk_triton.topk_indices(scores.to(DEVICE), 100).cpu()
    assert torch.equal(got[0], torch.arange(100)) and bool((got[1] == -1).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("S", [1, 16])
def test_a_million_wide_row_on_the_gpu(S):
    """Real sizes: index_topk 2048 of a 2^20 bucket with its last positions masked; a graph replay equals eager."""
    scores = random_scores(S, 1 << 20, seed=S).cuda()
    scores[:, 1_000_000:] = float("-inf")
    got = topk_triton.topk_indices(scores, 2048)
    assert torch.equal(got.cpu(), expected(scores.cpu(), 2048))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = topk_triton.topk_indices(scores, 2048)
    graph.replay()
    assert torch.equal(replayed, got)
