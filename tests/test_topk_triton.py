"""Exact top-k in Triton against the lowest-index-wins top-k (stable sort), on fresh rows with ties."""

import pytest
import torch

from glm5_offload.kernels import topk_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(scores, k):
    """torch.topk's index set with ties to the lower index (a stable sort), -1 for -inf scores."""
    k = min(k, scores.shape[1])
    values, order = torch.sort(scores, dim=1, descending=True, stable=True)
    order = order[:, :k].clone()
    order[values[:, :k] == float("-inf")] = -1
    return order


def check(rows, n, k, ties, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 40, (rows, n), generator=g).float() if ties else torch.randn(rows, n, generator=g)
    scores[0, n // 2 :] = float("-inf")  # the causal limit: row 0 has fewer valid scores
    scores = scores.to(DEVICE)
    got, want = topk_triton.topk_indices(scores, k), reference(scores, k)
    assert got.shape == want.shape
    for r in range(rows):
        assert sorted(got[r].tolist()) == sorted(want[r].tolist())


@pytest.mark.parametrize("rows, n, k, ties", [(3, 3000, 100, False), (2, 2500, 300, True), (2, 50, 100, False),
                                              (1, 1024, 1024, True)])
def test_topk_equals_the_reference(rows, n, k, ties):
    check(rows, n, k, ties, seed=n + k)


def test_negative_and_extreme_scores():
    scores = torch.tensor([[-3.4e38, -1.0, 0.0, -0.0, 5.0, float("-inf"), 3.4e38, -2.0]]).to(DEVICE)
    assert sorted(topk_triton.topk_indices(scores, 5)[0].tolist()) == sorted(reference(scores, 5)[0].tolist())


@pytest.mark.gpu
def test_one_long_row_on_the_gpu():
    check(1, 1 << 20, 2048, False, seed=1)
    check(4, 200_000, 2048, True, seed=2)
