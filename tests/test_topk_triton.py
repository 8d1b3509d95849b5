"""The radix-select top-k kernel against torch.topk (model.mla.topk_indices), and the top-k of wide rows by a
sample's threshold (topk_triton.topk_sampled): the interpreter on the CPU, 1M-wide rows on the GPU."""

import pytest
import torch

from glm5_offload.formats.kv_rows import quantize_keys
from glm5_offload.kernels import dsa_triton, topk_triton
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


ONE_PROGRAM = {"one program a row": 1 << 15, "passes over many programs": 0}  # topk_triton.ROW_PROGRAM_WIDTH


@pytest.mark.parametrize("width", ONE_PROGRAM.values(), ids=ONE_PROGRAM.keys())
@pytest.mark.parametrize("S, T, k, block", [(3, 5000, 64, 4096), (2, 3000, 700, 256), (4, 200, 300, 64),
                                            (1, 1, 8, 4096), (3, 4000, 2048, 4096), (2, 3000, 700, 4096)])
def test_topk_equals_torch(monkeypatch, S, T, k, block, width):
    """Every row: torch.topk's set (by values), in the documented order; many programs a row when the block is
    small (the counts before a program give its offsets), or one program looping over the row's blocks, or holding
    a row of one block in registers (its passes ending before the fourth digit on these rows; all four where the
    k-th value is tied: the next test); k > T, -inf rows' positions as -1; all ties."""
    monkeypatch.setattr(topk_triton, "BLOCK", block)
    monkeypatch.setattr(topk_triton, "ROW_PROGRAM_WIDTH", width)
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


@pytest.mark.parametrize("width", ONE_PROGRAM.values(), ids=ONE_PROGRAM.keys())
def test_all_equal_and_all_masked_rows(monkeypatch, width):
    monkeypatch.setattr(topk_triton, "ROW_PROGRAM_WIDTH", width)
    scores = torch.stack([torch.full((700,), 1.5), torch.full((700,), float("-inf"))])
    got = topk_triton.topk_indices(scores.to(DEVICE), 100).cpu()
    assert torch.equal(got[0], torch.arange(100)) and bool((got[1] == -1).all())


@pytest.mark.parametrize("width", ONE_PROGRAM.values(), ids=ONE_PROGRAM.keys())
def test_a_top_k_that_fills_the_first_digits_bin(monkeypatch, width):
    """The top 1000 of 4000 scores are the only ones in [2, 4) (the keys' first 8 bits), their least one three
    times: the one-block select stops after its first pass and must still count the k-th value's ties."""
    monkeypatch.setattr(topk_triton, "ROW_PROGRAM_WIDTH", width)
    g = torch.Generator().manual_seed(5)
    scores = torch.rand(1, 4000, generator=g) * 0.49 + 0.5  # [0.5, 1)
    top = torch.randperm(4000, generator=g)[:1000]
    scores[0, top] = torch.rand(1000, generator=g) * 1.9 + 2.05
    scores[0, top[:3]] = 2.0
    got = topk_triton.topk_indices(scores.to(DEVICE), 1000).cpu()
    assert torch.equal(got, expected(scores, 1000)) and torch.equal(got[0, -3:], top[:3].sort().values)


def test_skipped_rows_are_left_as_they_are():
    scores = random_scores(3, 5000, seed=9).to(DEVICE)
    out = torch.full((3, 64), -7, dtype=torch.int64, device=DEVICE)
    topk_triton.topk_indices(scores, 64, out=out, skip=torch.tensor([True, False, True], device=DEVICE))
    assert (out[0] == -7).all() and (out[2] == -7).all()
    assert torch.equal(out[1].cpu(), expected(scores[1:2].cpu(), 64)[0])


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


def check_sampled(scores: torch.Tensor, k: int, monkeypatch) -> list[bool]:
    """topk_triton.topk_sampled's set against the documented one (ties lowest position first); the rows it found
    misled."""
    misled = []
    original = topk_triton.misled_rows
    monkeypatch.setattr(topk_triton, "misled_rows", lambda *a: misled.append(original(*a)) or misled[-1])
    got = topk_triton.topk_sampled(scores.to(DEVICE), k).cpu()
    want = expected(scores.cpu(), k)
    assert got.shape == want.shape and torch.equal(got.sort(1).values, want.sort(1).values)  # (and as many -1s)
    return misled[0].tolist()


@pytest.fixture
def small_sample(monkeypatch):
    """The sampled top-k's sizes cut by 16 (the interpreter is slow; the GPU test below takes the real ones):
    (T, k) with T past the sampled width."""
    monkeypatch.setattr(topk_triton, "SAMPLE", 256)
    monkeypatch.setattr(topk_triton, "CAP", 1024)
    monkeypatch.setattr(topk_triton, "SAMPLED_WIDTH", 4096)
    return 4096 + 1234, 128


def test_topk_sampled_equals_the_scores_top_k(monkeypatch, small_sample):
    """A prefill call's wide rows: random; fewer valid scores than k (causal: every finite score a candidate);
    negative scores; 40 scores tied at the k-th largest (the lowest positions of them taken); a row that ends
    -inf past its middle. No row needs the radix select."""
    T, k = small_sample
    g = torch.Generator().manual_seed(11)
    scores = torch.randn(5, T, generator=g) * 30
    scores[1, 100:] = float("-inf")
    scores[2] = -scores[2].abs() - 5
    ranked = scores[3].sort(descending=True).indices
    scores[3, ranked[k - 20 : k + 20]] = scores[3, ranked[k - 20]].item()
    scores[4, T // 2 :] = float("-inf")
    assert check_sampled(scores, k, monkeypatch) == [False] * 5


def test_rows_the_sample_misleads_are_redone(monkeypatch, small_sample):
    """Row 0 scores every position alike (all pass the threshold: more than CAP; its top-k: the lowest positions);
    row 1 has 60 scores on the sample's stride scaled up (its threshold among them: fewer than k pass); row 2 is
    ordinary."""
    T, k = small_sample
    scores = torch.randn(3, T, generator=torch.Generator().manual_seed(12))
    scores[0] = 0.25
    stride = T // topk_triton.SAMPLE
    scores[1, 3000 // stride * stride :: stride][:60] *= 1e4
    scores[1, 3000 // stride * stride :: stride][:60] += 1e5
    assert check_sampled(scores, k, monkeypatch) == [True, True, False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_topk_sampled_of_a_prefill_call_on_the_gpu(monkeypatch):
    """Real sizes: the scores of 128 queries (one indexer call of a 1M prefill) of 32 heads x 128 over 2^20 FP8
    keys, their positions spread over the context; FP8 queries (the H200's default)."""
    T = 1 << 20
    g = torch.Generator().manual_seed(3)
    q = torch.randn(128, 32, 128, generator=g).to(DEVICE, torch.bfloat16)
    keys, scales = quantize_keys(torch.randn(T, 128, generator=g).to(DEVICE))
    w = torch.rand(128, 32, generator=g).to(DEVICE)
    positions = torch.linspace(1000, T - 1, 128, device="cuda").long()
    scores = dsa_triton.indexer_scores(q, keys, w, positions, key_scales=scales)
    assert check_sampled(scores, 2048, monkeypatch) == [False] * 128
