"""kernels/host_stage.py: the CPU experts' inputs written to the host by one kernel, byte for byte torch's copies
(x.float(), ids, weights.float()): on the GPU into pinned buffers (in the interpreter on the CPU into plain ones),
eagerly and replayed from a CUDA graph with new inputs."""

import pytest
import torch

from glm5_offload.kernels import host_stage

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter's on the CPU


def inputs(T, N, K, device, x_dtype, w_dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(T, N, generator=g, device=device) * 3).to(x_dtype)
    ids = torch.randint(0, 1 << 40, (T, K), generator=g, device=device)  # past 32 bits: int64 kept whole
    w = torch.rand(T, K, generator=g, device=device).to(w_dtype)
    return x, ids, w


def host_buffers(T, N, K, pin):
    return (torch.full((T, N), float("nan"), pin_memory=pin), torch.full((T, K), -1, dtype=torch.int64, pin_memory=pin),
            torch.full((T, K), float("nan"), pin_memory=pin))


def check(x, ids, w, host):
    assert torch.equal(host[0], x.float().cpu()) and torch.equal(host[1], ids.cpu())
    assert torch.equal(host[2], w.float().cpu())


@pytest.mark.parametrize("T, N, x_dtype, w_dtype", [(1, 6144, torch.bfloat16, torch.float32),
                                                    (3, 9000, torch.float32, torch.bfloat16)])
def test_stage_writes_torchs_copies(T, N, x_dtype, w_dtype):
    x, ids, w = inputs(T, N, 8, DEVICE, x_dtype, w_dtype, T)
    host = host_buffers(T, N, 8, DEVICE == "cuda")
    host_stage.stage(x, ids, w, *host)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    check(x, ids, w, host)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stage_into_pinned_memory_from_a_graph():
    x, ids, w = inputs(1, 6144, 8, "cuda", torch.bfloat16, torch.float32, 0)
    host = host_buffers(1, 6144, 8, True)
    host_stage.stage(x, ids, w, *host)
    torch.cuda.synchronize()
    check(x, ids, w, host)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        host_stage.stage(x, ids, w, *host)
    for seed in (1, 2):
        fresh = inputs(1, 6144, 8, "cuda", torch.bfloat16, torch.float32, seed)
        for t, new in zip((x, ids, w), fresh):
            t.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        check(*fresh, host)
