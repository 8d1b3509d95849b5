"""Token-exact parity with transformers' own implementation, on checkpoints transformers saved."""

import pytest
import torch

from glm5_offload.loader import load_model
from glm5_offload.runtime.engine import Engine
from glm5_offload.runtime.kv_cache import new_cache

from conftest import build_hf_model, rel_err

ARCHS = ["glm_moe_dsa", "deepseek_v32"]
PROMPT_LEN = 28  # > index_topk (8): the indexer selects a strict subset


def prompt(seed=1):
    return torch.randint(4, 320, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed))


def per_position_rel_err(ours, theirs):
    return max(rel_err(ours[i], theirs[i]) for i in range(theirs.shape[0]))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_every_position(hf_checkpoint, arch):
    path, hf = hf_checkpoint(arch)
    ids = prompt()
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    model = load_model(path, dtype=torch.float32)
    ours = model(ids, new_cache(model, 64))
    assert per_position_rel_err(ours, theirs) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_with_latent_cache_matches_full_forward(hf_checkpoint, arch):
    path, hf = hf_checkpoint(arch)
    ids = prompt(2)
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    model = load_model(path, dtype=torch.float32)
    cache = new_cache(model, 64)
    steps = [model(ids[:10], cache)] + [model(ids[i : i + 1], cache) for i in range(10, PROMPT_LEN)]
    assert cache.length == PROMPT_LEN
    assert per_position_rel_err(torch.cat(steps), theirs) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_identical(hf_checkpoint, arch):
    path, hf = hf_checkpoint(arch)
    ids = prompt(3)
    n_new = 32
    with torch.no_grad():
        out = hf.generate(ids[None], max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                          attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.long))
    theirs = out[0, PROMPT_LEN:].tolist()
    engine = Engine(load_model(path, dtype=torch.float32))
    engine.stop_ids = set()  # transformers was told to generate all n_new tokens
    ours = engine.generate(ids.tolist(), n_new).output_ids
    assert len(theirs) == n_new
    assert ours == theirs


def test_shared_layers_own_no_indexer_or_cache(hf_checkpoint):
    path, hf = hf_checkpoint("glm_moe_dsa")
    model = load_model(path, dtype=torch.float32)
    assert model.config.indexer_types == ("full", "shared", "shared", "shared", "full")
    assert [layer.self_attn.indexer is not None for layer in model.model.layers] == [True, False, False, False, True]
    cache = new_cache(model, 32)
    assert sorted(cache.index_keys) == [0, 4]
    assert all(t.shape == (32, model.config.latent_dim) for t in cache.latent)


def test_bf16_checkpoint_agrees_within_bf16_tolerance(tmp_path):
    """Ours in bf16 against transformers in fp32 on the same bf16 weights (the truth bf16 approximates).

    Per position the error is bf16 rounding (~1e-2); a rare position can differ by more where a
    router or indexer choice is within rounding of a tie, which transformers' bf16 run shows too.
    """
    hf = build_hf_model("glm_moe_dsa", initializer_range=0.05).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    ids = prompt(4)
    with torch.no_grad():
        truth = hf.float()(ids[None]).logits[0]
    model = load_model(tmp_path)
    assert model.dtype == torch.bfloat16
    ours = model(ids, new_cache(model, 64))
    errors = sorted(rel_err(ours[i], truth[i]) for i in range(PROMPT_LEN))
    assert errors[PROMPT_LEN // 2] < 2e-2
    assert (ours.argmax(-1) == truth.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("arch", ARCHS)
def test_make_tiny_checkpoint_loads_in_transformers_with_same_logits(tiny_dir, arch):
    from transformers import AutoModelForCausalLM

    path = tiny_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(12, 1024, (40,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    model = load_model(path, dtype=torch.float32)
    assert per_position_rel_err(model(ids, new_cache(model, 64)), theirs) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_parity_unchanged_when_placed_by_the_cpu_rule_file(hf_checkpoint, arch, rules="glm5-cpu"):
    from glm5_offload.rules import load_rules

    path, hf = hf_checkpoint(arch)
    ids = prompt(6)
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
        greedy = hf.generate(ids[None], max_new_tokens=24, min_new_tokens=24, do_sample=False,
                             attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.long))[0, PROMPT_LEN:].tolist()
    model = load_model(path, dtype=torch.float32, rules=load_rules(rules))
    assert model.placement.unmatched == [] and model.placement.devices() == ["cpu"]
    assert per_position_rel_err(model(ids, new_cache(model, 64)), theirs) < 1e-4
    engine = Engine(model)
    engine.stop_ids = set()
    assert engine.generate(ids.tolist(), 24).output_ids == greedy
