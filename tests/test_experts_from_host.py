"""kernels/experts_from_host.py: a decode token's last routed slots computed from packed weights where they lie,
against int_groups.dequantize, model.swiglu and int_groups.quantize_activations in plain torch. On the CPU under
the interpreter (the weights in plain memory); on a GPU from page-locked host memory, eagerly and replayed from a
CUDA graph with a new token's choice."""

import mmap

import numpy as np
import pytest
import torch

from glm5_offload.formats import int_groups
from glm5_offload.kernels.experts_from_host import GraphedSlots, host_matrices, routed_from_host
from glm5_offload.model import swiglu
from glm5_offload.ops.expert_ring import page_locked

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, K = 6, 8  # experts, slots a token routes to


def packed_experts(fmt, group, hidden, inter, seed):
    """w13, s13, w2, s2 as the CPU holds them; on a GPU page-locked, as the engine's (the interpreter reads any)."""
    g = torch.Generator().manual_seed(seed)
    w13 = int_groups.quantize(torch.randn(E, 2 * inter, hidden, generator=g) / hidden**0.5, fmt, group)
    w2 = int_groups.quantize(torch.randn(E, hidden, inter, generator=g) / inter**0.5, fmt, group)
    return tuple(locked(a) if DEVICE == "cuda" and a.size else a for a in (*w13, *w2))


def token(hidden, seed, device, w_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, hidden, generator=g) * 2
    ids = torch.cat([torch.randperm(E, generator=g), torch.randperm(E, generator=g)])[None, :K]
    return x.to(device), ids.to(device), torch.rand(1, K, generator=g).to(w_dtype).to(device)


def reference(x, ids, weights, first, arrays, fmt, group, act_int8, limit):
    w13, s13, w2, s2 = arrays
    up_gate, down = int_groups.dequantize(w13, s13, fmt, group), int_groups.dequantize(w2, s2, fmt, group)
    x = x.float().cpu()
    x = int_groups.quantize_activations(x, group) if act_int8 else x
    out = torch.zeros_like(x)
    for s in range(first, K):
        e = int(ids[0, s])
        gu = x @ up_gate[e].T
        act = swiglu(*gu.chunk(2, dim=1), limit)
        act = int_groups.quantize_activations(act, group) if act_int8 else act
        out += weights[0, s].float().cpu() * (act @ down[e].T)
    return out


def close(got, want):
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("fmt, group, hidden, inter", [("int4", 32, 352, 96), ("int4", 128, 384, 256),
                                                       ("int8", 32, 352, 96), ("int8", 128, 256, 128),
                                                       ("bf16", 128, 352, 96)])
@pytest.mark.parametrize("act_int8, limit, first", [(False, None, 5), (True, None, 3), (False, 1.5, 0)])
def test_the_last_slots_equal_the_reference(fmt, group, hidden, inter, act_int8, limit, first):
    """Row counts past a program's block and group counts past a span's (masked); the bf16 format has no integer
    activations."""
    if act_int8 and fmt == "bf16":
        pytest.skip("int8 activations need an integer format")
    arrays = packed_experts(fmt, group, hidden, inter, hidden + inter)
    x, ids, weights = token(hidden, first, DEVICE, torch.bfloat16 if first == 3 else torch.float32)
    got = routed_from_host(x, ids, weights, first, host_matrices(*arrays), fmt, group, act_int8, limit)
    close(got, reference(x, ids, weights, first, arrays, fmt, group, act_int8, limit))


def test_a_nan_input_gives_nan_as_the_reference_does_and_bad_calls_say_what():
    arrays = packed_experts("int4", 32, 352, 96, 0)
    x, ids, weights = token(352, 0, DEVICE)
    x[0, 7] = float("nan")
    got = routed_from_host(x, ids, weights, 6, host_matrices(*arrays), "int4", 32, False, None)
    assert torch.isnan(got).all() and torch.isnan(reference(x, ids, weights, 6, arrays, "int4", 32, False, None)).all()
    with pytest.raises(ValueError, match="format must be one of bf16, int8, int4, got 'fp8'"):
        routed_from_host(x, ids, weights, 6, host_matrices(*arrays), "fp8", 32, False, None)
    with pytest.raises(ValueError, match="one token and a slot of its 8 to start from, got x \\(1, 352\\), first 8"):
        routed_from_host(x, ids, weights, 8, host_matrices(*arrays), "int4", 32, False, None)


def locked(array: np.ndarray) -> np.ndarray:
    """A copy of array in an anonymous mapping of its own, page-locked for the GPU (kernels read it in place)."""
    region = mmap.mmap(-1, array.nbytes)
    out = np.frombuffer(region, array.dtype, array.size).reshape(array.shape)
    out[...] = array
    assert page_locked(out)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_from_page_locked_host_memory_in_a_graph():
    """Eagerly, then as GraphedSlots (a CUDA graph over static inputs) replayed for two new tokens."""
    arrays = packed_experts("int4", 128, 512, 256, 1)
    x, ids, weights = token(512, 0, "cuda")
    got = routed_from_host(x, ids, weights, 5, host_matrices(*arrays), "int4", 128, True, None)
    close(got, reference(x, ids, weights, 5, arrays, "int4", 128, True, None))
    slots = GraphedSlots(host_matrices(*arrays), "int4", 128, True, None, K, K - 5)
    for seed in (1, 2):
        x, ids, weights = token(512, seed, "cpu")
        slots.choose(x.numpy(), ids.numpy(), weights.numpy())
        out = slots.replay()
        torch.cuda.synchronize()
        close(out, reference(x, ids, weights, 5, arrays, "int4", 128, True, None))
