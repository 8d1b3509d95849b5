"""Rule files: the shipped placements, matching semantics, `glm5 rules show`, and every bad input."""

import functools
import re
from pathlib import Path

import pytest
import torch

from glm5_offload.config import load_config
from glm5_offload.errors import Glm5Error
from glm5_offload.model import Experts, build_model
from glm5_offload.rules import check_devices_present, load_rules, place, shipped_rule_names

from conftest import greedy_steps

SHIPPED = ["glm5.yaml", "glm5-reference.yaml", "glm5-cpu.yaml", "glm5-gpu.yaml"]  # GLM-5, GLM-5.2, DeepSeek-V3.2
FLASH = "glm5-flash.yaml"  # GLM-5.3-Flash


@functools.cache
def meta_model(preset):
    return build_model(load_config(preset))  # placing reads the tree, never changes it


def placement(preset, rules, device=None):
    return place(meta_model(str(preset)), load_rules(rules), device)


def test_shipped_rule_files():
    assert shipped_rule_names() == sorted(SHIPPED + [FLASH])
    for name in SHIPPED + [FLASH]:
        text = (Path(load_rules(name).path)).read_text()
        assert text.lstrip().startswith("#")  # each explains itself


@pytest.mark.parametrize("rules", SHIPPED)
@pytest.mark.parametrize("preset", ["glm-5", "glm-5.2", "deepseek-v3.2"])
def test_shipped_rules_place_every_module_and_use_every_rule(preset, rules):
    p = placement(preset, rules)
    assert p.unmatched == [] and p.unused_rules == []
    on_cpu = {type(s.module) for s in p.slots.values() if s.device == "cpu"}
    if rules.endswith("-cpu.yaml"):
        assert p.devices() == ["cpu"]
    elif rules.endswith("-gpu.yaml"):
        assert p.devices() == ["cuda"]
    else:  # the workstation default: only the routed experts on the CPU
        assert on_cpu == {Experts}
        assert all(s.device == "cuda" for s in p.slots.values() if not isinstance(s.module, Experts))


def test_flash_default_places_every_module_and_uses_every_rule():
    p = placement("glm-5.3-flash", FLASH)
    assert p.unmatched == [] and p.unused_rules == []
    assert {type(s.module) for s in p.slots.values() if s.device == "cpu"} == {Experts}
    ops = {s.op.name for s in p.slots.values()}
    assert {"kda.fla", "pooled_indexer.dsa_triton", "hyper_connection.triton", "attention.dsa_triton"} <= ops
    with pytest.raises(Glm5Error, match="suits glm5_next, not glm_moe_dsa"):
        placement("glm-5", FLASH)


def test_indexshare_shared_layers_have_no_indexer_slot():
    p = placement("glm-5.2", "glm5")
    indexers = [n for n in p.slots if n.endswith(".indexer")]
    assert len(indexers) == 21 and "model.layers.3.self_attn.indexer" not in p.slots


def write(tmp_path, text, name="rules.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_first_match_wins_and_children_inherit_the_device(tmp_path):
    path = write(tmp_path, """
- default: {device: cuda}
- match: {name: '^model\\.layers\\.1$'}
  replace: {device: cpu}
- match: {class: Attention}
  replace: {op: attention.reference, device: cuda:1}
- match: {class: Attention}
  replace: {device: cpu}
""")
    p = placement("glm-5", path)
    assert p.slots["model.layers.1.mlp"].device == "cpu" and p.slots["model.layers.1.mlp"].rule == 2
    assert p.slots["model.layers.1.input_layernorm"].device == "cpu"
    assert p.slots["model.layers.1.self_attn"].device == "cuda:1"  # its own rule, matched before rule 4
    assert p.slots["model.layers.1.self_attn.indexer"].device == "cuda:1"  # inherits its attention's
    assert p.slots["model.layers.0.mlp"].device == "cuda" and p.slots["model.layers.0.mlp"].rule is None
    assert [r.index for r in p.unused_rules] == [4]
    assert "model.layers.0.mlp" in p.unmatched


def test_a_rule_file_names_the_model_families_it_suits(tmp_path):
    path = write(tmp_path, "- default: {device: cpu, models: [deepseek_v32]}\n- match: {class: Experts}\n  replace: {device: cpu}\n")
    assert load_rules(path).models == ("deepseek_v32",) and placement("deepseek-v3.2", path).slots
    with pytest.raises(Glm5Error) as e:
        placement("glm-5", path)
    assert str(e.value) == f"{path}: the rule file suits deepseek_v32, not glm_moe_dsa"
    assert all(load_rules(name).models == ("glm_moe_dsa", "deepseek_v32") for name in SHIPPED)


def test_linear_is_a_slot_a_rule_can_place(tmp_path):
    """Each projection is its own slot (linear.reference), delegated by its attention, indexer or MLP; its weights
    are its own, no longer its parent's."""
    path = write(tmp_path, "- default: {device: cuda}\n- match: {name: 'kv_b_proj$', class: Linear}\n"
                           "  replace: {op: linear.reference, device: cpu}\n")
    p = placement("glm-5", path)
    kv_b, attention = p.slots["model.layers.3.self_attn.kv_b_proj"], p.slots["model.layers.3.self_attn"]
    assert (kv_b.op.name, kv_b.device, kv_b.rule) == ("linear.reference", "cpu", 2)
    assert kv_b.parent is attention and attention.children["kv_b_proj"] is kv_b
    assert attention.own_tensors() == {}  # its norms are slots too (norm.reference by default)
    assert attention.children["q_a_layernorm"].op.name == "norm.reference"
    assert p.slots["model.layers.3.self_attn.q_a_proj"].device == "cuda"  # its siblings stay with the attention
    assert p.slots["model.layers.3.mlp.shared_experts.down_proj"].op.name == "linear.reference"
    assert "model.layers.3.mlp.experts.0.down_proj" not in p.slots  # the experts operator owns its subtree
    assert re.search(r"model\.layers\.\{0-77\}\.self_attn\.kv_b_proj +linear\.reference +cpu +bf16 +2\.13 GiB +rule 2",
                     p.table(torch.bfloat16))
    assert re.search(r"self_attn\.indexer\.weights_proj +linear\.reference +cuda +fp32 ",
                     placement("glm-5", "glm5-reference").table(torch.bfloat16))
    assert re.search(r"self_attn\.indexer\.weights_proj +linear\.triton +cuda +fp32 ",  # kept fp32 by the fast one too
                     placement("glm-5", "glm5").table(torch.bfloat16))


def test_linear_rules_leave_the_logits_unchanged(tiny_dir, tmp_path):
    from glm5_offload.loader import load_model
    from glm5_offload.runtime.kv_cache import new_cache

    path = write(tmp_path, Path(load_rules("glm5-cpu").path).read_text()
                 + "- match: {class: Linear}\n  replace: {op: linear.reference, device: cpu}\n")
    ids = torch.arange(12, 40)
    ours = load_model(tiny_dir(), dtype=torch.float32, rules=load_rules(path))
    plain = load_model(tiny_dir(), dtype=torch.float32)
    assert ours.placement.slots["model.layers.1.self_attn.o_proj"].rule == 10
    assert torch.equal(ours(ids, new_cache(ours, 64)), plain(ids, new_cache(plain, 64)))


def test_recursive_false_owns_the_subtree(tmp_path):
    path = write(tmp_path, """
- match: {name: '^model\\.layers\\.2\\.self_attn$'}
  replace: {op: attention.reference, device: cuda}
  recursive: false
- match: {class: Indexer}
  replace: {device: cpu}
""")
    p = placement("glm-5", path)
    assert p.slots["model.layers.2.self_attn.indexer"].device == "cuda"  # not visited by rule 2
    assert p.slots["model.layers.5.self_attn.indexer"].device == "cpu"


def test_command_line_device_overrides_the_file_default(tmp_path):
    path = write(tmp_path, "- default: {device: cuda}\n- match: {class: Experts}\n  replace: {device: cpu}\n")
    assert placement("glm-5", path).slots["model.norm"].device == "cuda"
    assert placement("glm-5", path, "cpu").slots["model.norm"].device == "cpu"


def test_device_cpu_runs_a_gpu_placement_through_the_references(tmp_path, monkeypatch):
    """--device cpu moves what the rules put on a GPU to the CPU; an operator that cannot run there becomes its
    class's reference operator with the kwargs they share."""
    import dataclasses

    from glm5_offload import ops

    cuda_only = dataclasses.replace(ops.REGISTRY["attention.dsa_triton"], devices=("cuda",))
    monkeypatch.setitem(ops.REGISTRY, "attention.dsa_triton", cuda_only)
    p = placement("glm-5.2", "glm5", "cpu")
    assert p.devices() == ["cpu"]
    attention = p.slots["model.layers.0.self_attn"]
    assert attention.op.name == "attention.reference" and attention.kwargs["kv_offload"] is True
    assert attention.kwargs["hot_budget"] == 8 << 20 and attention.kwargs["window"] == 512
    assert p.slots["model.layers.0.self_attn.q_b_proj"].op.name == "linear.triton"  # runs on the CPU itself
    with pytest.raises(Glm5Error, match=r"rules.yaml: rule 3: operator attention.dsa_triton runs on cuda, not cpu"):
        placement("glm-5.2", write(tmp_path, Path(load_rules("glm5").path).read_text().replace("device: cuda\n",
                                                                                                 "device: cpu\n")))
    assert placement("glm-5.2", "glm5", "cuda:1").slots["model.layers.0.self_attn"].device == "cuda:1"
    assert placement("glm-5.2", "glm5", "cuda:1").slots["model.layers.3.mlp.experts"].device == "cpu"


def test_group_sizes_that_do_not_divide_are_chosen_or_refused(tmp_path):
    config = write(tmp_path, (Path(load_config("glm-5").path)).read_text().replace('"moe_intermediate_size": 2048',
                                                                                   '"moe_intermediate_size": 2112'),
                   "config.json")
    p = placement(config, "glm5")  # 2112 = 64 x 33: the experts take groups of 64
    assert p.slots["model.layers.3.mlp.experts"].op.format(p.slots["model.layers.3.mlp.experts"], None) == "int4/g64"
    shipped = Path(load_rules("glm5").path).read_text()
    kwargs = "kwargs: {format: int4, activations: int8, gpu_tokens: 64, decode_gpu_experts: auto}"
    assert kwargs in shipped
    asked = write(tmp_path, shipped.replace(kwargs,
                                            "kwargs: {format: int4, group_size: 128}"), "asked.yaml")
    with pytest.raises(Glm5Error, match=r"asked.yaml: rule 2: experts.numba on model.layers.3.mlp.experts: group_size "
                                        r"128 does not divide the inputs \(6144, 2112\): use group_size 64 or 32, or "
                                        "leave group_size out"):
        placement(config, asked)
    router = "\n\n- match:\n    class: Router"
    text = Path(load_rules("glm5").path).read_text()
    int4 = write(tmp_path, text.replace("{format: fp8}" + router, "{format: int4, group_size: 128}" + router),
                 "int4.yaml")
    assert placement("glm-5", int4).slots["model.layers.0.self_attn.o_proj"].op.format(
        placement("glm-5", int4).slots["model.layers.0.self_attn.o_proj"], torch.bfloat16) == "int4/g128"


def test_rules_show_on_shared_configs(tmp_path, glm5_here):
    for preset in ("glm-5", "glm-5.2", "glm-5-fp8", "deepseek-v3.2"):
        table = placement(preset, "glm5-reference").table(torch.bfloat16)
        assert "experts.reference" in table and "total on cpu" in table and "total on cuda" in table
        assert "warning" not in table
    out = glm5_here("rules", "show", "--model", "glm-5.2", "--rules", "glm5-reference").stdout
    assert "model.layers.{3-77}.mlp.experts" in out and "model.layers.{0-2,6,10," in out
    assert "total on cpu: 1350.00 GiB" in out  # 75 x 256 x 3 x 6144 x 2048 bf16 weights
    assert "latent KV of layers {0-77}: bf16 rows on cuda" in out
    tiered = placement("glm-5.2", "glm5").table(torch.bfloat16)
    assert ("latent KV of layers {0-77}: FP8 rows (656 B) in pinned host memory, a 8.00 MiB hot "
            "buffer on cuda (the last 512 tokens + recently selected rows)") in tiered
    flagged = write(tmp_path, "- match: {class: Experts}\n  replace: {device: cpu}\n"
                              "- match: {name: 'no_such_module'}\n  replace: {device: cpu}\n")
    table = placement("glm-5", flagged).table(torch.bfloat16)
    assert "warning: no rule matched model.layers.{0-77}.self_attn: default operator on cpu" in table
    assert "warning: rule 2 (name~no_such_module) matched nothing" in table


def test_rules_operators_lists_what_a_rule_can_name(glm5_here):
    from glm5_offload.ops import REGISTRY

    lines = glm5_here("rules", "operators").stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(REGISTRY)
    numba = next(line for line in lines if line.startswith("experts.numba "))
    assert "replaces Experts" in numba and " on cpu " in numba and "kwargs: format, group_size, threads" in numba


BAD = {
    "malformed": ("- match: {class: Experts}\n  replace: [device: cpu\n", r"rules.yaml:3: malformed YAML"),
    "unknown_key": ("- match: {class: Experts}\n  replace: {device: cpu}\n  recursve: false\n",
                    "rule 1: unknown key 'recursve' in a rule"),
    "unknown_match_key": ("- match: {klass: Experts}\n  replace: {device: cpu}\n", "rule 1: unknown key 'klass' in match"),
    "unknown_op": ("- match: {class: Experts}\n  replace: {op: experts.turbo}\n",
                   "rule 1: unknown operator 'experts.turbo' (registered: attention.dsa_triton, attention.reference,"),
    "op_for_other_class": ("- match: {class: Attention}\n  replace: {op: experts.reference}\n",
                           "rule 1: operator experts.reference replaces Experts, not Attention"),
    "bad_regex": ("- default: {device: cpu}\n- match: {name: 'layers.(\\d+'}\n  replace: {device: cpu}\n",
                  "rule 2: invalid regex 'layers.(\\\\d+' in match.name"),
    "bad_device": ("- match: {class: Experts}\n  replace: {device: gpu0}\n", "rule 1: device must be cpu, cuda or cuda:N"),
    "kwargs": ("- match: {class: Experts}\n  replace: {op: experts.reference, kwargs: {threads: 8}}\n",
               "rule 1: operator experts.reference takes no kwarg 'threads' (it takes none)"),
    "empty": ("# nothing but a comment\n", "empty rule file"),
    "not_a_list": ("match: {class: Experts}\n", "a rule file is a YAML list of rules"),
    "unknown_class": ("- match: {class: Expert}\n  replace: {device: cpu}\n", "rule 1: unknown class 'Expert'"),
    "no_match": ("- replace: {device: cpu}\n", "rule 1: a rule needs 'match' and 'replace'"),
    "unknown_family": ("- default: {device: cpu, models: [glm6]}\n- match: {class: Experts}\n  replace: {device: cpu}\n",
                       "rule 1 (default): models must list model families among glm_moe_dsa, deepseek_v32, glm5_next, got ['glm6']"),
    # aliases of aliases: a few lines that build a billion values, which an error message's repr wrote out
    "billion_laughs": ("- match: {class: Attention}\n  replace:\n    op: attention.dsa_triton\n    kwargs:\n"
                       "      hot_budget: [&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol], "
                       + ", ".join(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)) + "]\n",
                       "rules.yaml:5: malformed YAML (an alias (*a0): rule files take none, write the value out)"),
    "families_not_a_list": ("- default: {device: cpu, models: glm_moe_dsa}\n- match: {class: Experts}\n  replace: {device: cpu}\n",
                            "rule 1 (default): models must list model families"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_rule_file_is_one_line(tmp_path, case):
    text, needle = BAD[case]
    path = write(tmp_path, text)
    with pytest.raises(Glm5Error) as e:
        load_rules(path)
    assert needle in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_rule_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"# caf\xe9\n- match: {class: Experts}\n  replace: {device: cpu}\n")
    with pytest.raises(Glm5Error) as e:
        load_rules(path)
    assert str(e.value) == f"{path}: not UTF-8 text (byte 5)"


def test_bad_rule_file_on_the_command_line_exits_2_without_traceback(tmp_path, glm5_here):
    path = write(tmp_path, BAD["unknown_op"][0])
    proc = glm5_here("rules", "show", "--model", "glm-5", "--rules", path, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("glm5: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "unknown operator 'experts.turbo'" in errors[0]
    assert "Traceback" not in proc.stderr
    proc = glm5_here("rules", "show", "--model", "glm-5", "--rules", tmp_path / "missing.yaml", check=False)
    assert proc.returncode == 2 and "no such rule file" in proc.stderr
    from glm5_offload.rules import resolve_rules_path

    for path, what in ((tmp_path, "a folder, not a rule file"), ("/dev/null", "not a rule file")):
        with pytest.raises(Glm5Error, match=f"^{path}: {what} \\(shipped: glm5-cpu.yaml, "):
            resolve_rules_path(path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_not_present(tiny_dir, tmp_path, glm5_here):
    with pytest.raises(Glm5Error, match=r"glm5.yaml: rule \d+: device cuda is not present on this machine"):
        check_devices_present(placement(tiny_dir() / "config.json", "glm5"))
    proc = glm5_here("generate", "--model", tiny_dir(), "--rules", "glm5", "--prompt-ids", "1,2", check=False)
    assert proc.returncode == 2 and "device cuda is not present" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32"])
def test_every_shipped_rule_file_runs_the_embedded_tiny_model_on_the_cpu(tiny_dir, arch):
    """--device cpu: each shipped placement loads and decodes the tiny model (GLM-5's, and DeepSeek-V3.2's: the
    files serve both) without a GPU (its GPU operators through Triton's interpreter here, their references
    elsewhere); the reference, CPU and GPU placements give the same logits, the default one (FP8 projections, int4
    experts, the tiered FP8 cache) logits of the same model."""
    from glm5_offload.loader import load_model
    from glm5_offload.runtime.kv_cache import new_cache

    ids = torch.arange(12, 44)  # past the tiny model's index_topk (16): sparse attention
    logits = {}
    for name in SHIPPED:
        model = load_model(tiny_dir(arch), dtype=torch.float32, rules=load_rules(name), device="cpu")
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        cache = new_cache(model, 128)
        logits[name] = model(ids, cache, logits_for="last")[0]
        greedy_steps(model, cache, logits[name])
    for name in ("glm5-reference.yaml", "glm5-gpu.yaml"):
        assert torch.allclose(logits[name], logits["glm5-cpu.yaml"], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(logits["glm5.yaml"]).all()
    assert torch.corrcoef(torch.stack([logits["glm5.yaml"], logits["glm5-cpu.yaml"]]))[0, 1] > 0.5


def test_rules_show_counts_weights_where_they_live():
    """embedding.host runs for the GPU with its table in host memory: `rules show` says so and totals it on the cpu,
    as the planner does."""
    from glm5_offload.planner import make_plan
    from glm5_offload.util import human_bytes

    p = placement("glm-5.2", "glm5")
    table = p.table(torch.bfloat16)
    assert re.search(r"model\.embed_tokens +embedding\.host +cuda \(weights on cpu\) +bf16 +1\.77 GiB", table)
    plan = make_plan(load_config("glm-5.2"), p, 4096, {})
    cuda = next(d for d in plan.devices if d.device == "cuda")
    assert f"total on cuda: {human_bytes(cuda.weights)}" in table
