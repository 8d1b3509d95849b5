"""Decode cut into pieces at the CPU experts (decode_graphs.py): the same logits as the model's forward, on the
CPU with the pieces run eagerly, and on a GPU replayed from CUDA graphs (`gpu` marker)."""

import pytest
import torch

from glm5_offload.benchmark import moe_layer_step
from glm5_offload.config import load_config
from glm5_offload.loader import load_model
from glm5_offload.model import CUT, HostStep, build_model
from glm5_offload.rules import load_rules
from glm5_offload.runtime.decode_graphs import DecodeGraphs, pieces, unsupported
from glm5_offload.runtime.engine import Engine, SamplingParams
from glm5_offload.runtime.kv_cache import new_cache

from conftest import rel_err

ON = [pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else ["cpu"]


def cpu_expert_rules(path, device, attention_kwargs="{}", experts_kwargs=""):
    attention, indexer = ("dsa_triton", "dsa_triton") if device == "cuda" else ("reference", "reference")
    path.write_text(f"""
- default: {{device: {device}}}
- match: {{name: '^model\\.layers\\.\\d+\\.mlp\\.experts$', class: Experts}}
  replace: {{op: experts.numba, device: cpu, kwargs: {{format: int8, group_size: 32{experts_kwargs}}}}}
  recursive: false
- match: {{class: Attention}}
  replace: {{op: attention.{attention}, kwargs: {attention_kwargs}}}
- match: {{class: Indexer}}
  replace: {{op: indexer.{indexer}}}
""")
    return load_rules(path)


@pytest.mark.parametrize("device", ON)
@pytest.mark.parametrize("offload", [False, True], ids=["plain", "tiered"])
@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32"])
def test_pieces_match_the_forward(hf_checkpoint, tmp_path, device, offload, arch):
    """14 teacher-forced steps from position 56 cross the buckets 64 and 128 (the keys read up to the bucket,
    masked past the position); the tiered cache's hot buffer (24 rows) is far smaller than the context. GLM-5
    (IndexShare) and DeepSeek-V3.2 (an indexer a layer)."""
    path, _ = hf_checkpoint(arch)
    kwargs = "{kv_offload: true, hot_budget: 4608, window: 4}" if offload else "{}"
    model = load_model(path, dtype=torch.float32, rules=cpu_expert_rules(tmp_path / "rules.yaml", device, kwargs))
    prompt = torch.randint(4, 320, (56,), generator=torch.Generator().manual_seed(5)).to(device)
    tokens = torch.randint(4, 320, (14,), generator=torch.Generator().manual_seed(6)).tolist()
    eager, pieces = new_cache(model, 128), new_cache(model, 128)
    model(prompt, eager)
    model(prompt, pieces)
    graphs = DecodeGraphs(model, pieces, capture=device == "cuda", min_bucket=16)
    for token in tokens:
        want = model(torch.tensor([token], device=device), eager)[-1]
        got = graphs.step(token)
        assert rel_err(got, want) < 1e-5 and got.argmax() == want.argmax()
    assert sorted(graphs.buckets) == [64, 128] and pieces.length == eager.length == 70
    assert graphs.steps == 12  # the two buckets' first steps are not counted
    if device == "cuda":  # the routed experts run in the host's step between the graphs
        assert graphs.seconds["experts"] > 0
    # each step's MoE layers after its first: their experts and the hand-offs before them (benchmark.moe_layer_step)
    moe = len(load_config(path).moe_layers)
    assert moe >= 2 and graphs.later_layers == graphs.steps * (moe - 1)
    assert 0 < graphs.seconds["later experts"] <= graphs.seconds["experts"] and graphs.seconds["hand-offs"] > 0
    layer = moe_layer_step(graphs.seconds, dict.fromkeys(graphs.seconds, 0.0), graphs.later_layers)
    assert layer["layers"] == graphs.later_layers and layer["step_over_experts"] > 1
    assert layer["hand_off_ms"] == pytest.approx(graphs.seconds["hand-offs"] / graphs.later_layers * 1e3)
    if offload:
        assert pieces.offload_stats()["misses"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_the_query_beside_the_fetch_changes_no_bit(hf_checkpoint, tmp_path, monkeypatch, kv_dtype):
    """A decode step computes its attention's query on a side stream (model/mla.py's Beside), beside the cache's
    write, the indexer and the tiered fetch: replayed from graphs and run eagerly, the same logits bit for bit as
    with every kernel in order on one stream (BESIDE_ROWS 0), over a context far larger than the hot buffer."""
    from glm5_offload.model import mla

    path, _ = hf_checkpoint("glm_moe_dsa")
    row = 32 + 4 + 16 * 2 if kv_dtype == "fp8" else 48 * 4  # bytes of one latent row (fp32 model): 24 hot rows
    kwargs = f"{{kv_offload: true, hot_budget: {24 * row}, window: 4, kv_dtype: {kv_dtype}}}"
    model = load_model(path, dtype=torch.float32, rules=cpu_expert_rules(tmp_path / "rules.yaml", "cuda", kwargs))
    prompt = torch.randint(4, 320, (90,), generator=torch.Generator().manual_seed(5)).cuda()
    tokens = torch.randint(4, 320, (20,), generator=torch.Generator().manual_seed(6)).tolist()

    def decode(beside_rows: int):
        monkeypatch.setattr(mla, "BESIDE_ROWS", beside_rows)
        eager, pieces = new_cache(model, 128), new_cache(model, 128)
        model(prompt, eager)
        model(prompt, pieces)
        graphs = DecodeGraphs(model, pieces, capture=True, min_bucket=16)
        out = [(graphs.step(token), model(torch.tensor([token], device="cuda"), eager)[-1]) for token in tokens]
        assert pieces.offload_stats()["misses"] > 0
        return torch.stack([g for g, _ in out]), torch.stack([e for _, e in out])

    in_order, beside = decode(0), decode(16)
    assert torch.equal(beside[0], in_order[0]) and torch.equal(beside[1], in_order[1])


def test_the_forward_steps_cut_at_each_moe_layers_host_work(tiny_dir):
    """The model's own steps, cut as the graphs take them: per MoE layer a piece up to its routing (the host's
    wait covers it), the shared expert (and in a full layer with IndexShare layers above it, their rows' fetch: off
    the path from the experts' end to the next layer, queued first on a side stream and joined last, so that it runs
    beside the shared expert and the GPU's experts), then the host's experts; the final piece ends with the logits."""
    model = build_model(load_config(tiny_dir()))
    cut = pieces(model.steps())
    hosts = [i for i, piece in enumerate(cut) if piece.host is not None]
    assert len(hosts) == len(model.config.moe_layers) == 4
    fetching = [bool(model.shared_after.get(layer)) for layer in model.config.moe_layers]
    assert any(fetching) and not all(fetching)
    for i, fetches in zip(hosts, fetching):
        assert cut[i - 1].cut and cut[i - 1].host is None and len(cut[i].steps) == 1 + 2 * fetches and not cut[i].cut
        if fetches:
            fork, join = cut[i].steps[0].__qualname__, cut[i].steps[-1].__qualname__
            assert fork.endswith("prefetch.<locals>.run") and join.endswith("prefetch.<locals>.join")
    assert len(cut) == 2 * len(hosts) + 1 and cut[-1].host is None and not cut[-1].cut
    assert sum(len(piece.steps) for piece in cut) == len([s for s in model.steps() if s is not CUT
                                                          and not isinstance(s, HostStep)])


def test_only_cpu_experts_on_a_gpu_model_decode_from_graphs(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("glm_moe_dsa")
    model = load_model(path, dtype=torch.float32, rules=cpu_expert_rules(tmp_path / "rules.yaml", "cpu"))
    assert "not on a GPU" in unsupported(model)
    assert Engine(model).use_graphs is False


def test_auto_gpu_experts_under_a_stream_on_the_cpu_lock_and_time_nothing(hf_checkpoint, tmp_path):
    """decode_gpu_experts: auto (as the shipped rules say) where the rules keep the residual stream on the CPU
    (--device cpu): planned and built as 0, on a machine with a GPU as without: no page-locking, no timing."""
    path, _ = hf_checkpoint("glm_moe_dsa")
    rules = cpu_expert_rules(tmp_path / "rules.yaml", "cpu", experts_kwargs=", decode_gpu_experts: auto")
    model = load_model(path, dtype=torch.float32, rules=rules, max_seq_len=128)
    moe = [model.model.layers[i].mlp.experts for i in model.config.moe_layers]
    assert [(experts.decode_gpu_experts, experts.gpu_matrices) for experts in moe] == [(0, None)] * len(moe)


@pytest.mark.gpu
def test_a_decode_tokens_gpu_slots_from_graphs_match_the_forward(hf_checkpoint, tmp_path):
    """decode_gpu_experts: 1 of the tiny model's 2 slots, read by the GPU from the page-locked experts: steps from
    graphs equal the model's forward (split the same way), whose logits equal those of both slots on the cores."""
    path, _ = hf_checkpoint("glm_moe_dsa")
    split = load_model(path, dtype=torch.float32, rules=cpu_expert_rules(tmp_path / "split.yaml", "cuda",
                                                                         experts_kwargs=", decode_gpu_experts: 1"))
    cores = load_model(path, dtype=torch.float32, rules=cpu_expert_rules(tmp_path / "cores.yaml", "cuda"))
    moe = [split.model.layers[i].mlp.experts for i in split.config.moe_layers]
    assert all(experts.gpu_matrices is not None for experts in moe)
    prompt = torch.randint(4, 320, (40,), generator=torch.Generator().manual_seed(7)).cuda()
    caches = [new_cache(model, 128) for model in (split, split, cores)]
    for model, cache in zip((split, split, cores), caches):
        model(prompt, cache)
    graphs = DecodeGraphs(split, caches[1], capture=True, min_bucket=16)
    for token in torch.randint(4, 320, (8,), generator=torch.Generator().manual_seed(8)).tolist():
        eager = split(torch.tensor([token], device="cuda"), caches[0])[-1]
        on_cores = cores(torch.tensor([token], device="cuda"), caches[2])[-1]
        got = graphs.step(token)
        assert rel_err(got, eager) < 1e-5 and rel_err(eager, on_cores) < 1e-4
        assert got.argmax() == on_cores.argmax()


@pytest.mark.gpu
def test_engine_decodes_the_same_tokens_from_graphs(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("glm_moe_dsa")
    model = load_model(path, dtype=torch.float32, rules=cpu_expert_rules(tmp_path / "rules.yaml", "cuda"))
    first = list(range(10, 50))
    results = []
    for graphs in (False, True):
        engine = Engine(model, max_seq_len=256, cuda_graphs=graphs)
        engine.stop_ids = set()
        out = engine.generate(first, 40).output_ids
        second = first + out[:20] + list(range(60, 70))  # a chat's next turn: the cache rewinds to a prefix
        sampled = engine.generate(first, 20, SamplingParams(temperature=1.0, top_p=0.95, seed=3)).output_ids
        results.append((out, engine.generate(second, 30).output_ids, sampled))  # (a seed's draws on the GPU)
        assert (engine.graphs is not None) == graphs
    assert results[0] == results[1]


@pytest.mark.gpu
def test_a_module_off_the_gpu_keeps_decode_eager(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("glm_moe_dsa")
    rules = tmp_path / "rules.yaml"
    cpu_expert_rules(rules, "cuda")
    rules.write_text(rules.read_text() + "- match: {class: Router}\n  replace: {op: router.reference, device: cpu}\n")
    model = load_model(path, dtype=torch.float32, rules=load_rules(rules))
    assert "mlp.gate" in unsupported(model) and Engine(model).use_graphs is False
    engine = Engine(model, max_seq_len=128)
    assert len(engine.generate(list(range(10, 30)), 4).output_ids) == 4
