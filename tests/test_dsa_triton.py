"""The DSA Triton kernels against their torch references (interpreter on the CPU, real sizes on the GPU)."""

import pytest
import torch

from glm5_offload.kernels import dsa_triton
from glm5_offload.loader import load_model
from glm5_offload.model import indexer_scores, sparse_mla, topk_indices
from glm5_offload.rules import load_rules

from conftest import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check_indexer(S, H, D, T, start, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, H, D, generator=g).to(DEVICE, dtype)
    keys = torch.randn(T, D, generator=g).to(DEVICE, dtype)
    w = torch.randn(S, H, generator=g).to(DEVICE)
    out = torch.full((S, T), float("nan"), device=DEVICE)  # poisoned: every element must be written
    got = dsa_triton.indexer_scores(q, keys, w, start, out=out)
    ref = indexer_scores(q, keys, w, start)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite)  # the causal limit, and nothing left unwritten
    assert rel_err(got[finite], ref[finite]) < 1e-5
    k = min(64, T)
    assert torch.equal(topk_indices(got, k).sort(-1).values, topk_indices(ref, k).sort(-1).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S, H, T, start", [(1, 8, 300, 299), (7, 8, 389, 382), (5, 16, 129, 100)])
def test_indexer_scores(dtype, S, H, T, start):
    check_indexer(S, H, 32, T, start, dtype, seed=S * 1000 + T)


def check_mla(S, H, L, R, T, K, dtype, seed, splits=None):
    g = torch.Generator().manual_seed(seed)
    q_lat = torch.randn(S, H, L, generator=g).to(DEVICE, dtype)
    q_pe = torch.randn(S, H, R, generator=g).to(DEVICE, dtype)
    latent = torch.randn(T, L + R, generator=g).to(DEVICE, dtype)
    indices = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(S)]).to(DEVICE)
    indices[0, K // 3 :] = -1  # padding: fewer valid rows than K
    out = torch.full((S, H, L), float("nan"), device=DEVICE)
    lse = torch.full((S, H), float("nan"), device=DEVICE)
    o, lse = dsa_triton.sparse_mla(q_lat, q_pe, latent, indices, L, 0.07, out=out, lse=lse, splits=splits)
    ref = sparse_mla(q_lat, q_pe, latent, indices, L, 0.07)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert rel_err(o, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    scores = torch.einsum("shl,tl->sht", q_lat.float(), latent[:, :L].float()) + torch.einsum(
        "shr,tr->sht", q_pe.float(), latent[:, L:].float())
    mask = torch.zeros(S, T, dtype=torch.bool, device=DEVICE)
    mask.scatter_(1, indices.clamp(min=0), indices >= 0)
    want = (scores * 0.07).masked_fill(~mask[:, None], float("-inf")).logsumexp(-1)
    assert rel_err(lse, want) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S, H, K", [(1, 16, 48), (3, 20, 130)])  # heads and rows not multiples of the blocks
@pytest.mark.parametrize("splits", [1, 3])  # 3: rows split over programs, combined by log-sum-exp; row 0's last
def test_sparse_mla(dtype, S, H, K, splits):  # split holds only -1 padding
    check_mla(S, H, 64, 16, 300, K, dtype, seed=S + H + K, splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("S", [1, 32])
def test_real_sizes_on_the_gpu(S):
    check_indexer(S, 32, 128, 131072, 131072 - S, torch.bfloat16, seed=S)
    check_mla(S, 64, 512, 64, 65536, 2048, torch.bfloat16, seed=S)


def dsa_rules(tmp_path, device):
    path = tmp_path / "dsa.yaml"
    path.write_text(f"""
- default: {{device: {device}}}
- match: {{class: Attention}}
  replace: {{op: attention.dsa_triton, device: {device}}}
- match: {{class: Indexer}}
  replace: {{op: indexer.dsa_triton, device: {device}}}
""")
    return load_rules(path)


ON = [pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else ["cpu"]  # cpu: interpreter


@pytest.mark.parametrize("device", ON)
def test_tiny_model_through_the_triton_operator(hf_checkpoint, tmp_path, device):
    """Parity with the reference path (and so with transformers), IndexShare included."""
    from glm5_offload.attention_triton import TritonAttention, TritonIndexer

    path, hf = hf_checkpoint("glm_moe_dsa")
    ids = torch.randint(4, 320, (28,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    model = load_model(path, dtype=torch.float32, rules=dsa_rules(tmp_path, device))
    layers = model.model.layers
    assert all(type(layer.self_attn) is TritonAttention for layer in layers)
    assert type(layers[0].self_attn.indexer) is TritonIndexer and layers[1].self_attn.indexer is None
    ours = model(ids.to(device), model.new_cache(64)).cpu()
    assert max(rel_err(ours[i], theirs[i]) for i in range(len(ids))) < 1e-4
