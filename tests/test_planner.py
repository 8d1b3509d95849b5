"""The memory planner against the formulas of GLM5.md, its verdicts, and the engine's refusal."""

import functools
import json

import pytest
import torch

from glm5_offload.config import load_config
from glm5_offload.errors import Glm5Error
from glm5_offload.loader import load_model
from glm5_offload.model import build_model
from glm5_offload.ops.expert_ring import DEPTH
from glm5_offload.planner import PlanError, make_plan
from glm5_offload.rules import load_rules, place, resolve_rules_path
from glm5_offload.util import parse_size

GiB = 2**30


@functools.cache
def meta_model(preset):
    return build_model(load_config(preset))


@functools.cache
def placed(preset, rules="glm5-reference"):
    return load_config(preset), place(meta_model(preset), load_rules(rules))


def plan(preset, n, **kw):
    config, placement = placed(preset)
    budgets = {"cuda": kw.pop("gpu", 24 * GiB), "cpu": kw.pop("host", 512 * GiB)}
    return make_plan(config, placement, n, budgets, **kw)


def device(p, name):
    return next(d for d in p.devices if d.device == name)


def test_glm52_at_1m_tokens_equals_the_glm5_md_formulas():
    p = plan("glm-5.2", 1_000_000, kv_dtype="fp8", expert_format="int4")
    cuda = device(p, "cuda")
    converted = 576 * 2 * 1_000_000  # one buffer: a prefill chunk's FP8 rows converted to bf16 (dsa_triton)
    assert cuda.latent_kv - converted == 78 * 656 * 1_000_000  # "78 x 656 MB = 51 GB"
    assert round((cuda.latent_kv - converted) / 1e9) == 51
    assert cuda.indexer_keys == 21 * 132 * 1_000_000  # "21 x 132 MB = 2.8 GB"
    assert round(cuda.indexer_keys / 1e9, 1) == 2.8
    unshared = plan("glm-5", 1_000_000, kv_dtype="fp8")
    assert round(device(unshared, "cuda").indexer_keys / 1e9, 1) == 10.3  # "10.3 GB without sharing"
    assert p.config.active_expert_weights == 75 * 8 * 3 * 6144 * 2048  # "22.6 G weights"
    assert round(p.config.active_expert_weights / 1e9, 1) == 22.6
    assert round(p.active_expert_bytes / 1e9, 1) == 11.3  # int4
    assert round(plan("glm-5.2", 1_000_000, expert_format="int8").active_expert_bytes / 1e9, 1) == 22.6
    assert device(p, "cpu").latent_kv == 0  # the reference placement keeps attention and its cache on the GPU


def test_tiered_cache_counts_rows_on_the_host_and_hot_buffers_on_the_gpu():
    """glm5.yaml: FP8 rows of every layer in host memory; per layer an 8 MiB hot buffer (with its LRU tables) and a
    4-byte slot per token on the GPU, plus a prefill staging buffer of 2^18 rows and one of their bf16 conversion
    (budgets, not per token); 132-byte indexer keys."""
    config, placement = placed("glm-5.2", "glm5")
    p = make_plan(config, placement, 1_000_000, {"cuda": 24 * GiB, "cpu": 512 * GiB})
    cpu, cuda = device(p, "cpu"), device(p, "cuda")
    assert cpu.latent_kv == 78 * 656 * 1_000_000
    hot = (8 * 2**20 // 656 + 1) * 656 + (8 * 2**20 // 656 - 512 + 1) * 20  # rows, LRU slots' tables
    assert cuda.latent_kv == 78 * (hot + 4 * 1_000_000) + (656 + 1152) * 2**18
    assert cuda.indexer_keys == 21 * 132 * 1_000_000
    assert [n for n in p.notes if n.startswith("latent KV")] == ["latent KV fp8 (656 B/token/layer)"] and p.fits
    assert cuda.per_token == 78 * 4 + 21 * 132 and cpu.per_token == 78 * 656
    expert = 3 * 6144 * 2048  # gpu_tokens: the ring of DEPTH int4 experts, one expert dequantised to bf16
    assert cuda.workspace == 3 * 2**26 * 4 + DEPTH * (expert // 2 + expert // 128 * 4) + expert * 2
    short = make_plan(config, placement, 4096, {"cuda": 24 * GiB, "cpu": 512 * GiB})
    assert device(short, "cuda").latent_kv == 78 * (hot + 4 * 4096) + (656 + 1152) * 4096  # staging: never above need


def test_gpu_ring_sets_the_experts_held_on_the_gpu(tmp_path):
    """gpu_ring: a whole layer (256 experts) on the GPU takes 256 packed experts' room instead of DEPTH's."""
    text = resolve_rules_path("glm5").read_text().replace("gpu_tokens: 64", "gpu_tokens: 64, gpu_ring: 256")
    (tmp_path / "ring.yaml").write_text(text)
    config = load_config("glm-5.2")
    ring = make_plan(config, place(meta_model("glm-5.2"), load_rules(tmp_path / "ring.yaml")), 1_000_000,
                     {"cuda": 48 * GiB, "cpu": 512 * GiB})
    base = make_plan(*placed("glm-5.2", "glm5"), 1_000_000, {"cuda": 48 * GiB, "cpu": 512 * GiB})
    packed = 3 * 6144 * 2048 // 2 + 3 * 6144 * 2048 // 128 * 4  # one int4/g128 expert
    assert device(ring, "cuda").workspace - device(base, "cuda").workspace == (256 - DEPTH) * packed


@pytest.mark.parametrize("count, stream, planned", [(3, "cuda", 3), ("auto", "cuda", 4), ("auto", "cpu", 0)])
def test_decode_gpu_experts_plan_their_gpu_workspace(tmp_path, count, stream, planned):
    """decode_gpu_experts under the shipped rules (residual stream on the GPU): the plan holds, and the experts'
    operator declares the GPU's fp32 gate, up and SwiGLU rows of those experts and the token's sum (auto: of up to
    half a token's 8; none with the stream on the CPU, --device cpu, where a count is refused)."""
    from glm5_offload.ops.base import Buffer, PlanContext

    text = resolve_rules_path("glm5").read_text()
    assert "decode_gpu_experts: auto" in text
    (tmp_path / "split.yaml").write_text(text.replace("decode_gpu_experts: auto", f"decode_gpu_experts: {count}"))
    config = load_config("glm-5.2")
    placement = place(meta_model("glm-5.2"), load_rules(tmp_path / "split.yaml"), None if stream == "cuda" else stream)
    make_plan(config, placement, 4096, {"cuda": 24 * GiB, "cpu": 512 * GiB})
    slot = next(s for s in placement.slots.values() if s.op is not None and s.op.name == "experts.numba")
    ctx = PlanContext(config, torch.bfloat16, 4096, None, None, 2048, stream)
    on_gpu = [b for b in slot.op.memory(slot, ctx) if b.device == "cuda" and b.shared is None]  # (not the ring)
    assert on_gpu == ([Buffer("cuda", "workspace", 4 * (planned * 3 * 2048 + 6144))] if planned else [])


def test_glm5_fp8_at_200k_tokens():
    p = plan("glm-5-fp8", 200_000, kv_dtype="bf16", expert_format="int8")
    cuda, cpu = device(p, "cuda"), device(p, "cpu")
    assert cuda.latent_kv == 78 * 1152 * 200_000 and cuda.indexer_keys == 78 * 256 * 200_000
    experts = 75 * 256 * 3 * 6144 * 2048
    assert cpu.weights == experts + experts // 128 * 4  # int8 payload + one fp32 scale per 128 weights
    tensors = meta_model("glm-5-fp8").state_dict()
    total = sum(t.numel() for t in tensors.values())
    assert round(total / 1e9) == 744  # "744B params"
    fp32 = sum(t.numel() for n, t in tensors.items() if n.endswith(("e_score_correction_bias", "weights_proj.weight")))
    assert cuda.weights == 2 * (total - experts) + 2 * fp32  # bf16, but fp32 router bias and indexer weights_proj


def test_verdict_and_largest_context():
    p = plan("glm-5.2", 1_000_000, kv_dtype="fp8", expert_format="int4", gpu=80 * GiB)
    cuda = device(p, "cuda")
    largest = p.largest_context
    assert largest == (80 * GiB - cuda.fixed) // cuda.per_token
    assert plan("glm-5.2", largest, kv_dtype="fp8", expert_format="int4", gpu=80 * GiB).fits
    assert not plan("glm-5.2", largest + 1, kv_dtype="fp8", expert_format="int4", gpu=80 * GiB).fits
    assert not plan("glm-5.2", 1000, gpu=24 * GiB).fits  # bf16 reference weights alone exceed 24 GiB
    assert plan("glm-5.2", 1000, gpu=24 * GiB).largest_context == 0


@pytest.mark.parametrize("text, value", [("24GiB", 24 * GiB), ("512G", 512 * GiB), ("80GB", 80 * 10**9),
                                         ("1.5TiB", int(1.5 * 2**40)), ("1024", 1024)])
def test_parse_size(text, value):
    assert parse_size(text, "--gpu-mem") == value


def test_parse_size_rejects():
    with pytest.raises(Glm5Error, match="--host-mem: '12 parsecs' is not a size"):
        parse_size("12 parsecs", "--host-mem")


def test_plan_command(glm5_here):
    proc = glm5_here("plan", "--model", "glm-5.2", "--rules", "glm5-reference", "--max-seq-len", 1000000,
                     "--gpu-mem", "160GiB",
                     "--host-mem", "512GiB", "--kv-dtype", "fp8", "--expert-format", "int4", "--json", check=False)
    assert proc.returncode == 0, proc.stderr
    table, figures = proc.stdout.rsplit("\n", 2)[0], json.loads(proc.stdout.strip().splitlines()[-1])
    assert "latent KV fp8 (656 B/token/layer)" in table and "fits; largest context" in table
    # every layer's FP8 rows, and one buffer of them converted to bf16 for a prefill chunk's sparse MLA
    assert figures["fits"] and figures["devices"]["cuda"]["latent_kv"] == (78 * 656 + 576 * 2) * 1_000_000
    over = glm5_here("plan", "--model", "glm-5.2", "--rules", "glm5-reference", "--max-seq-len", 1000000,
                     "--gpu-mem", "24GiB", "--host-mem", "512GiB", check=False)
    assert over.returncode == 1 and "does NOT fit" in over.stdout and "OVER by" in over.stdout


def test_plan_says_why_no_context_fits(glm5_here):
    small = glm5_here("plan", "--model", "glm-5.2", "--max-seq-len", 4096, "--gpu-mem", "24GiB", "--host-mem", "64GiB",
                      check=False)
    assert small.returncode == 1
    assert "largest context that fits: none: the weights and buffers alone are over the budget of cpu" in small.stdout


def test_plan_flags_are_refused_before_the_model_is_built(monkeypatch, glm5_here):
    """A context beyond the model's positions or a size that is not one: refused before the module tree is built
    (~9 s for GLM-5's on a slow CPU)."""
    import glm5_offload.model

    monkeypatch.setattr(glm5_offload.model, "build_model", lambda config: pytest.fail("the model was built"))
    proc = glm5_here("plan", "--model", "glm-5", "--max-seq-len", "300000", check=False)
    assert proc.returncode == 2 and not proc.stdout and proc.stderr.strip().splitlines()[-1].startswith(
        "glm5: error: --max-seq-len 300000 exceeds the model's max_position_embeddings 202752")
    proc = glm5_here("plan", "--model", "glm-5", "--max-seq-len", "4096", "--gpu-mem", "lots", check=False)
    assert proc.returncode == 2 and "--gpu-mem" in proc.stderr


def test_engine_refuses_up_front_showing_the_plan(tiny_dir, monkeypatch, glm5_here):
    import glm5_offload.loader as loader

    monkeypatch.setattr(loader, "Checkpoint", lambda *a, **k: pytest.fail("the checkpoint was read before the plan"))
    with pytest.raises(PlanError) as e:
        load_model(tiny_dir(), max_seq_len=4096, budgets={"cpu": 2**20})
    assert "cpu needs" in str(e.value) and "of 0.0 GiB" in str(e.value)
    assert "does NOT fit" in e.value.plan.table()
    proc = glm5_here("generate", "--model", tiny_dir(), "--prompt-ids", "1,2", "--host-mem", "1MiB", check=False)
    assert proc.returncode == 2 and "does NOT fit" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("glm5: error: the model does not fit")


def test_engine_runs_when_it_fits(tiny_dir):
    model = load_model(tiny_dir(), max_seq_len=4096, budgets={"cpu": 8 * GiB}, dtype=torch.float32)
    assert model.placement.devices() == ["cpu"]


@pytest.mark.parametrize("preset, tokens", [("glm-5.2", 1048576), ("glm-5-fp8", 202752), ("deepseek-v3.2", 163840)])
def test_the_default_placement_fits_a_24gib_gpu(preset, tokens, glm5_here):
    """No --rules: rules/glm5.yaml, said on stderr; GLM-5.2 at 1M tokens and GLM-5-FP8 at its 202752 fit 24 GiB."""
    proc = glm5_here("plan", "--model", preset, "--max-seq-len", tokens, "--gpu-mem", "24GiB", "--host-mem", "512GiB",
                     "--json", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no --rules given: the default placement glm5" in proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["fits"] and figures["devices"]["cuda"]["total"] <= 23 * GiB  # a GiB of headroom at least
    assert figures["largest_context"] >= tokens


def test_flash_at_1m_tokens_fits_24_gib_with_its_states_and_pooled_keys():
    """glm5-flash.yaml at 1,048,576 tokens: the 11 DSA layers' 528-byte FP8 rows on the host, their hot buffers and
    slots on the GPU; 16 bytes of pooled indexer keys a token; each of the 34 KDA layers a fixed state (fp32 64 x 128
    x 128 and the conv inputs), twice (the resume point)."""
    config, placement = placed("glm-5.3-flash", "glm5-flash")
    n = 1 << 20
    p = make_plan(config, placement, n, {"cuda": 24 * GiB, "cpu": 256 * GiB})
    cpu, cuda = device(p, "cpu"), device(p, "cuda")
    assert p.fits and cuda.total < 24 * GiB
    assert cpu.latent_kv == 11 * 528 * n
    state = 64 * 128 * 128 * 4 + 3 * 3 * 64 * 128 * 2
    hot = (8 * 2**20 // 528 + 1) * 528 + (8 * 2**20 // 528 - 512 + 1) * 20
    assert cuda.latent_kv == 34 * 2 * state + 11 * (hot + 4 * n) + (528 + 512 * 2) * 2**18
    assert cuda.indexer_keys == 11 * 16 * n
