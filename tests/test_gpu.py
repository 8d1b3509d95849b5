"""The reference path on CUDA gives the CPU's result (run on a GPU machine: pytest -m gpu)."""

import pytest
import torch

from glm5_offload.loader import load_model
from glm5_offload.runtime.engine import Engine
from glm5_offload.runtime.kv_cache import new_cache

from conftest import rel_err

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def exact_fp32_matmul():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32"])
def test_cuda_reference_matches_cpu_fp32(hf_checkpoint, arch):
    path, _ = hf_checkpoint(arch)
    ids = torch.randint(4, 320, (40,), generator=torch.Generator().manual_seed(0))
    cpu = load_model(path, dtype=torch.float32)
    gpu = load_model(path, device="cuda", dtype=torch.float32)
    assert gpu.device.type == "cuda"
    expected = cpu(ids, new_cache(cpu, 64))
    got = gpu(ids.cuda(), new_cache(gpu, 64)).cpu()
    assert max(rel_err(got[i], expected[i]) for i in range(40)) < 1e-4
    n_new = 24
    cpu_tokens = Engine(cpu).generate(ids.tolist(), n_new).output_ids
    gpu_tokens = Engine(gpu).generate(ids.tolist(), n_new).output_ids
    assert gpu_tokens == cpu_tokens


def test_cuda_reference_bf16_fp8_checkpoint(tiny_dir):
    """bf16 on CUDA is as close to the fp32 result as bf16 on the CPU is."""
    path = tiny_dir("glm_moe_dsa", fp8=True)
    ids = torch.arange(12, 60)
    truth_model, cpu = load_model(path, dtype=torch.float32), load_model(path)
    gpu = load_model(path, device="cuda")
    assert gpu.dtype == cpu.dtype == torch.bfloat16
    truth = truth_model(ids, new_cache(truth_model, 64))

    def median_error(model):
        logits = model(ids.to(model.device), new_cache(model, 64)).cpu()
        return sorted(rel_err(logits[i], truth[i]) for i in range(len(ids)))[len(ids) // 2]

    cpu_error, gpu_error = median_error(cpu), median_error(gpu)
    assert cpu_error < 5e-2
    assert gpu_error <= 1.5 * cpu_error + 5e-3


@pytest.mark.parametrize("rules", ["glm5-reference", "glm5-gpu"])
def test_workstation_placement_matches_cpu(hf_checkpoint, rules):
    """glm5-reference.yaml: experts on the CPU, the rest on the GPU; activations cross between them."""
    from glm5_offload.rules import load_rules

    path, _ = hf_checkpoint("glm_moe_dsa")
    ids = torch.randint(4, 320, (40,), generator=torch.Generator().manual_seed(1))
    cpu = load_model(path, dtype=torch.float32)
    placed = load_model(path, dtype=torch.float32, rules=load_rules(rules))
    experts = placed.model.layers[1].mlp.experts[0].up_proj.weight.device.type
    assert experts == ("cpu" if rules == "glm5-reference" else "cuda")
    assert placed.model.layers[1].self_attn.q_a_proj.weight.device.type == "cuda"
    expected = cpu(ids, new_cache(cpu, 64))
    got = placed(ids, new_cache(placed, 64)).cpu()
    assert max(rel_err(got[i], expected[i]) for i in range(40)) < 1e-4
    assert Engine(placed).generate(ids.tolist(), 24).output_ids == Engine(cpu).generate(ids.tolist(), 24).output_ids


def test_numba_experts_with_router_and_shared_expert_on_the_gpu(tiny_dir, tmp_path):
    """The hidden state crosses to the CPU through pinned buffers once per layer; results match all-CPU."""
    from glm5_offload.ops import experts_numba
    from glm5_offload.ops.experts_numba import NumbaExperts
    from glm5_offload.rules import load_rules

    rules = tmp_path / "numba.yaml"
    rules.write_text(f"""
- default: {{device: cuda}}
- match: {{class: Experts}}
  replace: {{op: experts.numba, device: cpu, kwargs: {{format: int8, group_size: 32, cache_dir: '{tmp_path}'}}}}
  recursive: false
""")
    cpu_rules = tmp_path / "numba-cpu.yaml"
    cpu_rules.write_text(rules.read_text().replace("device: cuda", "device: cpu"))
    path = tiny_dir()
    mixed = load_model(path, dtype=torch.float32, rules=load_rules(rules))
    cpu = load_model(path, dtype=torch.float32, rules=load_rules(cpu_rules))
    experts = mixed.model.layers[1].mlp.experts
    assert isinstance(experts, NumbaExperts) and mixed.model.layers[1].mlp.gate.weight.is_cuda
    ids = torch.arange(12, 60)
    expected = cpu(ids, new_cache(cpu, 64))
    got = mixed(ids.cuda(), new_cache(mixed, 64)).cpu()
    assert max(rel_err(got[i], expected[i]) for i in range(len(ids))) < 1e-4
    assert all(t.is_pinned() for t in experts_numba._pinned.values()) and experts_numba._pinned
    assert Engine(mixed).generate(ids.tolist(), 16).output_ids == Engine(cpu).generate(ids.tolist(), 16).output_ids
