"""router.triton (kernels/router_triton.py) against the reference Router (model/blocks.py) on fresh random inputs, in
Triton's interpreter on the CPU and on the GPU; and the tiny models through it against transformers."""

from types import SimpleNamespace

import pytest
import torch

from glm5_offload.kernels import router_triton
from glm5_offload.loader import load_model
from glm5_offload.model import Router
from glm5_offload.ops.router_triton import TritonRouter
from glm5_offload.rules import load_rules
from glm5_offload.runtime.kv_cache import new_cache

from conftest import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_router(experts, hidden, top_k, n_group, topk_group, norm, dtype, seed):
    config = SimpleNamespace(n_routed_experts=experts, hidden_size=hidden, num_experts_per_tok=top_k, n_group=n_group,
                             topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = Router(config)  # the weight in the compute dtype, the bias fp32: as loaded
    g = torch.Generator().manual_seed(seed)
    router.weight.data = (torch.randn(experts, hidden, generator=g) * hidden**-0.5).to(DEVICE, dtype)
    router.e_score_correction_bias.data = (torch.randn(experts, generator=g) * 0.05).to(DEVICE)
    return router, g


# GLM-5 (256 experts, one group), DeepSeek-V3.2 (8 groups, 4 kept), GLM-5.3-Flash (288: a padded tile), and odd
# ones: groups of 15 experts, a top_k that is no power of two, no normalisation
SHAPES = [(256, 6144, 8, 1, 1, True), (256, 7168, 8, 8, 4, True), (288, 4096, 8, 1, 1, True),
          (60, 200, 6, 4, 2, False)]


@pytest.mark.parametrize("experts, hidden, top_k, n_group, topk_group, norm", SHAPES)
@pytest.mark.parametrize("T", [1, 3, 9, 40])  # registers' sums, fp32 dots, a prefill chunk's fp32 matmul
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_equals_the_reference(experts, hidden, top_k, n_group, topk_group, norm, T, dtype):
    router, g = make_router(experts, hidden, top_k, n_group, topk_group, norm, dtype, seed=T + experts)
    x = torch.randn(T, hidden, generator=g).to(DEVICE, dtype)
    want_ids, want_weights = Router.forward(router, x)
    ids, weights = router_triton.route(x, router.weight, router.e_score_correction_bias, top_k, n_group, topk_group,
                                       norm, 2.5)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)  # the same experts, best first
    assert rel_err(weights, want_weights) < 1e-5


def test_group_limit_excludes_the_best_expert_of_a_dropped_group():
    """The group rule really applies: an expert whose group's two best are weak loses to a kept group's weaker one."""
    router, g = make_router(64, 128, 4, 4, 1, True, torch.float32, seed=1)
    x = torch.randn(1, 128, generator=g).to(DEVICE)
    bias = torch.zeros(64, device=DEVICE)
    bias[0] = 10.0  # group 0's best expert alone is the best choice of all (group score ~11)
    bias[16:18] = 6.0  # group 1 has two strong choices (~13): the one group kept
    router.e_score_correction_bias.data = bias
    ids, _ = router_triton.route(x, router.weight, router.e_score_correction_bias, 4, 4, 1, True, 2.5)
    want, _ = Router.forward(router, x)
    chosen = ids[0].tolist()
    assert torch.equal(ids, want) and sorted(chosen[:2]) == [16, 17] and all(16 <= i < 32 for i in chosen)


def test_nan_hidden_states_still_choose_real_experts():
    """A row gone NaN (an overflowed model) routes to top_k distinct real experts with NaN weights, as the reference
    does; never to an id past the experts."""
    router, g = make_router(256, 512, 8, 8, 4, True, torch.bfloat16, seed=2)
    x = torch.randn(2, 512, generator=g).to(DEVICE, torch.bfloat16)
    x[0] = float("nan")
    x[1, 7] = float("nan")
    ids, weights = router_triton.route(x, router.weight, router.e_score_correction_bias, 8, 8, 4, True, 2.5)
    _, want_weights = Router.forward(router, x)
    assert ((ids >= 0) & (ids < 256)).all() and all(len(set(row)) == 8 for row in ids.tolist())
    assert weights.isnan().all() and want_weights.isnan().all()


def rules(tmp_path, device):
    path = tmp_path / "router.yaml"
    path.write_text(f"""
- default: {{device: {device}}}
- match: {{class: Router}}
  replace: {{op: router.triton, device: {device}}}
""")
    return load_rules(path)


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32"])  # one group; 4 groups of which 2 are kept
def test_tiny_model_through_the_triton_router(hf_checkpoint, tmp_path, arch):
    path, hf = hf_checkpoint(arch)
    model = load_model(path, dtype=torch.float32, rules=rules(tmp_path, DEVICE))
    assert all(type(layer.mlp.gate) is TritonRouter for layer in model.model.layers[1:])
    for n in (3, 40):  # decode's GEMV kernel, then a prefill chunk's matmul
        ids = torch.randint(4, 320, (n,), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            theirs = hf(ids[None]).logits[0]
        ours = model(ids.to(DEVICE), new_cache(model, 64)).cpu()
        assert max(rel_err(ours[i], theirs[i]) for i in range(n)) < 1e-4
