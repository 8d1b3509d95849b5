"""bench/bench_e2e.py: the decode projection (a marginal layer measured below the host-bandwidth bound, the two runs'
noise, is not projected from; nor is a context beyond the target's window), the step in parts (its experts over
every load), decode after a filled context (--filled) and the median of several loads (--repeats), each in a
process of its own."""

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import bench_context  # noqa: E402
import bench_e2e  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from glm5_offload import benchmark  # noqa: E402
from glm5_offload.config import load_config  # noqa: E402
from glm5_offload.errors import Glm5Error  # noqa: E402
from glm5_offload.loader import load_model  # noqa: E402
from glm5_offload.rules import load_rules  # noqa: E402
from glm5_offload.runtime.engine import Engine  # noqa: E402
from glm5_offload.runtime.tiered_kv import TieredLatent  # noqa: E402
from glm5_offload.tiny import make_tiny  # noqa: E402


def test_a_marginal_layer_below_the_bound_falls_back_to_the_whole_step():
    results = [{"context": 4096, "decode_ms_per_token": 6.0}]
    fmt, read = ("int4", 128), [100.0]  # a GLM-5 layer's 8 int4 experts: 161 MB, 1.6 ms at 100 GB/s
    honest = bench_e2e.projection(results, 1, fmt, read, [{"fixed_ms": 1.0, "moe_layer_ms": 3.0}])
    noise = bench_e2e.projection(results, 1, fmt, read, [{"fixed_ms": 4.6, "moe_layer_ms": 1.4}])
    for row in honest:
        assert row["basis"] == "marginal" and row["projected_ms_per_token"] == 1.0 + 75 * 3.0  # 75 MoE layers
        assert 0 < row["of_bound"] < 1
    for row in noise:
        assert row["basis"].startswith("whole step") and row["projected_ms_per_token"] == 6.0 * 75


def test_with_the_gpus_bus_read_a_step_may_beat_the_cores_read_not_both_reads():
    """decode_gpu_experts: the GPU reads some of a token's experts over its bus beside the cores, so a step faster
    than the cores' read is a speed, not noise; faster than the two reads' sum it is still noise."""
    results = [{"context": 4096, "decode_ms_per_token": 6.0}]
    fmt, read, bus = ("int4", 128), [100.0], [50.0]  # the 1.6 ms of a GLM-5 layer's experts at 100 GB/s: 1.07 at 150
    beyond_cores = bench_e2e.projection(results, 1, fmt, read, [{"fixed_ms": 1.0, "moe_layer_ms": 1.4}], bus_gb_s=bus)
    for row in beyond_cores:
        assert row["basis"] == "marginal" and row["projected_ms_per_token"] == pytest.approx(1.0 + 75 * 1.4)
        assert row["of_bound"] > 1 and row["bus_bound_tok_s"] == pytest.approx(row["bound_tok_s"] * 1.5)
    for row in bench_e2e.projection(results, 1, fmt, read, [{"fixed_ms": 1.0, "moe_layer_ms": 1.0}], bus_gb_s=bus):
        assert row["basis"].startswith("whole step") and row["projected_ms_per_token"] == 6.0 * 75
    for row in bench_e2e.projection(results, 1, fmt, read, [{"fixed_ms": 1.0, "moe_layer_ms": 1.4}]):
        assert row["basis"].startswith("whole step") and row["bus_bound_tok_s"] is None  # the cores alone


def test_the_marginal_layer_and_each_processs_experts_alone():
    """One more MoE layer from two checkpoints' runs: its step, its experts in the step, their ratio, the fixed rest,
    and each run's experts timed alone in its own process, per MoE layer (a filled run's, or glm5 bench's)."""
    split = lambda experts: {"experts": experts, "gpu wait": 0.5, "other": 0.2}  # noqa: E731
    small = {"context": 4096, "decode_ms_per_token": 3.0, "graph_split_ms_per_token": split(2.0),
             "experts_alone_ms_per_token": 1.8}
    large = {"context": 4096, "decode_ms_per_token": 5.5, "graph_split_ms_per_token": split(4.2),
             "host_bound": {"experts_alone_ms_per_token": 4.4}}
    [row] = bench_e2e.marginal_layer({2: [small], 3: [large]}, {2: 1, 3: 2})
    assert row["moe_layer_ms"] == 2.5 and row["fixed_ms"] == 0.5 and row["moe_layer_experts_ms"] == pytest.approx(2.2)
    assert row["step_over_experts"] == pytest.approx(2.5 / 2.2) and row["experts_alone_ms_per_layer"] == [1.8, 2.2]
    del large["host_bound"]  # a run without CPU experts
    assert bench_e2e.marginal_layer({2: [small], 3: [large]}, {2: 1, 3: 2})[0]["experts_alone_ms_per_layer"] == [1.8,
                                                                                                                None]


def test_the_step_in_parts_takes_the_experts_over_every_load():
    """step_parts: the experts per MoE layer as the median over every load of both checkpoints, the rest from the
    checkpoints' difference; loads whose experts vary as the H200 host's do leave it steady where the difference
    of two median loads swings (the projection's basis 'parts')."""
    def load(n_moe, experts_per_layer, fixed=0.5, rest=0.3):
        return {"context": 4096, "decode_ms_per_token": fixed + n_moe * (experts_per_layer + rest),
                "graph_split_ms_per_token": {"experts": n_moe * experts_per_layer}}
    small = [load(1, e) for e in (2.0, 2.1, 2.4)]
    large = [load(2, e) for e in (1.95, 2.45, 2.05)]
    [row] = bench_e2e.step_parts({2: [small], 3: [large]}, {2: 1, 3: 2})
    assert row["loads"] == 6 and row["experts_ms"] == pytest.approx(2.075)  # median of 2.0 2.1 2.4 1.95 2.45 2.05
    assert row["rest_ms"] == pytest.approx(0.3) and row["fixed_ms"] == pytest.approx(0.5)
    assert row["moe_layer_ms"] == pytest.approx(2.375) and row["step_over_experts"] == pytest.approx(2.375 / 2.075)
    [marginal] = bench_e2e.marginal_layer({2: [small[1]], 3: [large[2]]}, {2: 1, 3: 2})  # the median loads
    assert marginal["moe_layer_ms"] == pytest.approx(5.2 - 2.9)  # 2.3: the two loads' luck
    rows = bench_e2e.projection([small[1]], 1, ("int4", 128), [100.0], [row], "parts")
    assert [r["basis"] for r in rows] == ["parts", "parts"]
    assert rows[0]["projected_ms_per_token"] == pytest.approx(0.5 + 75 * 2.375)
    small[0]["graph_split_ms_per_token"] = None  # a load without CPU experts in its step: no parts
    assert bench_e2e.step_parts({2: [small], 3: [large]}, {2: 1, 3: 2}) is None


def test_a_context_beyond_a_targets_window_is_not_projected_for_it():
    results = [{"context": 4096, "decode_ms_per_token": 6.0}, {"context": 1048448, "decode_ms_per_token": 7.0}]
    rows = bench_e2e.projection(results, 1, ("int4", 128), [100.0, 80.0])
    assert [(r["target"], r["context"]) for r in rows] == [("glm-5", 4096), ("glm-5.2", 4096), ("glm-5.2", 1048448)]
    assert rows[1]["bound_tok_s"] == pytest.approx(rows[2]["bound_tok_s"] * 100 / 80)  # each context's own read


def test_decode_after_a_filled_context_prefills_one_token(tiny_dir):
    """--filled: the cache holds a context of random rows (the tiered latent's host tier included) and decode starts
    after it with one token prefilled, its window rows brought to the hot tier, every logit finite. The timed run
    continues the first (one token prefilled again, no rewind), within bench_context's max_seq_len."""
    model = load_model(tiny_dir(), device="cpu", rules=load_rules("glm5"), max_seq_len=155)
    engine = Engine(model, max_seq_len=155)  # bench_context's for a context of 150 and 2 new tokens
    engine.stop_ids = set()
    result = bench_e2e.decode_filled(engine, 150, 2)
    assert result["prefilled_tokens"] == 1 and result["decode_ms_per_token"] > 0
    assert result["experts_replayed_ms_per_token"] > 0  # the timed run's expert calls, again alone
    moe_layers = len(model.config.moe_layers)  # its one-token prefill and one decode step
    assert result["call_by_call"]["calls"] == 2 * moe_layers and result["call_by_call"]["ratio_quartiles"][0] > 0
    assert engine.cache.length == 150 + 2 * 2 and len(engine.cache_ids) == 154
    tiered = [store for store in engine.cache.latent if isinstance(store, TieredLatent)]
    assert tiered and all(store.end == 154 for store in tiered)
    logits = engine.model(torch.tensor([1]), engine.cache, logits_for="last")
    assert torch.isfinite(logits).all()


def test_a_flash_context_is_filled_too(tiny_dir):
    """--filled for GLM-5.3-Flash: its DSA layers' rows and the pooled indexers' group keys (one a complete group of
    index_kpool tokens, random; the KDA states empty), and decode after them gives finite logits."""
    model = load_model(tiny_dir("glm5_next"), device="cpu", rules=load_rules("glm5-flash"), max_seq_len=64)
    engine = Engine(model, max_seq_len=64)
    bench_context.fill(engine, 50)
    kpool = model.config.index_kpool
    pooled = list(engine.cache.index_keys.values())
    assert pooled and all(k.groups[: 50 // kpool].abs().sum(-1).gt(0).all() for k in pooled)
    assert all((k.groups[50 // kpool :] == 0).all() for k in pooled)
    assert engine.cache.length == 50
    logits = engine.model(torch.tensor([1]), engine.cache, logits_for="last")
    assert torch.isfinite(logits).all()


def test_call_by_call_pairs_each_call_in_the_step_with_itself_alone(monkeypatch):
    """Ten calls of 1 s alone (a clock each call advances by its x), nine of them 1.1 s in the step and one 3 s:
    the ratio's quartiles are 1.1x and that one call carries 2 s of the 2.9 s excess; two layers taking turns, the
    second's calls 1.5 s in the step: each layer's median ratio in the order a step calls them."""
    clock = [0.0]
    monkeypatch.setattr(benchmark.time, "perf_counter", lambda: clock[0])

    class Layer:
        def _compute(self, x, ids, weights):
            clock[0] += x

    layer = Layer()
    calls = [(layer, 1.0, None, None, 1.1)] * 4 + [(layer, 1.0, None, None, 3.0)] + [(layer, 1.0, None, None, 1.1)] * 5
    alone = benchmark.replayed_seconds(calls)
    assert alone == pytest.approx([1.0] * 10)
    c = bench_e2e.call_by_call(calls, alone)
    assert c["calls"] == 10 and c["ratio_quartiles"] == pytest.approx([1.1] * 3)
    assert c["slowest_tenth_share"] == pytest.approx(2.0 / 2.9) and clock[0] == 10.0
    assert c["median_ratio_by_layer"] == pytest.approx([1.1])
    second = Layer()
    turns = [(layer, 1.0, None, None, 1.1), (second, 1.0, None, None, 1.5)] * 3
    c = bench_e2e.call_by_call(turns, benchmark.replayed_seconds(turns))
    assert c["median_ratio_by_layer"] == pytest.approx([1.1, 1.5])
    assert bench_e2e.call_by_call([], []) is None


def test_a_load_measures_the_host_read_after_its_decode(tiny_dir, monkeypatch, capsys):
    """bench_context: each load's bound is the host's read measured in its own process after its decode, printed
    beside what its CPU experts read in the step and how much of their memory is in huge pages (the step's split
    faked here: there are no CUDA graphs); glm5 bench's own read where it took one. (It failed at times: the tiny
    model's first decoded token an end-of-text one, the run had no decode to time.)"""
    import dataclasses

    from glm5_offload.formats.int_groups import nbytes

    filled = bench_e2e.decode_filled
    monkeypatch.setattr(bench_e2e, "decode_filled", lambda *a: {**filled(*a), "graph_split_ms_per_token":
                                                                 {"experts": 0.01, "gpu wait": 0.5}})
    monkeypatch.setattr(bench_e2e, "read_bandwidth_gb_s", lambda: 40.0)

    def every_token_ends_the_text(*a, **k):  # (no GPU here) a token the model ends on must not cut the decode short
        model = load_model(*a, device="cpu", **k)
        model.config = dataclasses.replace(model.config, eos_token_ids=tuple(range(model.config.vocab_size)))
        return model

    monkeypatch.setattr(bench_e2e, "load_model", every_token_ends_the_text)
    result, fmt = bench_e2e.bench_context(tiny_dir(), load_rules("glm5"), 150, 2, 64, filled=True)
    assert result["read_gb_s"] == 40.0 and fmt is not None
    gb_s = nbytes(load_config(tiny_dir()).active_expert_weights, *fmt) / 0.01 / 1e6
    line = f"host read after the decode 40 GB/s; the experts in the step read {gb_s:.0f} GB/s, {gb_s / 40:.0%} of it"
    assert re.search(re.escape(line) + r" \(\d+% of their memory in huge pages\)\n", capsys.readouterr().out)
    # glm5 bench's measurement (not --filled) has read the host already: that read is the load's, none taken again
    monkeypatch.setattr(bench_e2e, "run_benchmark", lambda engine, context, new_tokens: {
        "context": context, "graph_split_ms_per_token": None, "host_bound": {"host_read_gb_s": 55.0}})
    monkeypatch.setattr(bench_e2e, "read_bandwidth_gb_s", lambda: pytest.fail("the host read measured twice"))
    result, _ = bench_e2e.bench_context(tiny_dir(), load_rules("glm5"), 150, 2, 64)
    assert result["read_gb_s"] == 55.0


def test_repeats_keep_the_median_load_whole(capsys):
    """--repeats: of several loads the median one's figures, its split with its total (not a mix of loads)."""
    trials = [({"decode_ms_per_token": ms, "graph_split_ms_per_token": {"experts": ms - 1}}, ("int4", 128))
              for ms in (3.4, 2.9, 3.1, 5.0)]
    result, fmt = bench_e2e.median_trial(trials)
    assert result == {"decode_ms_per_token": 3.1, "graph_split_ms_per_token": {"experts": 2.1}} and fmt == ("int4", 128)
    prefill = bench_e2e.median_trial([({"prefill_split_s": {"indexer": s, "experts": 1.0}}, None)
                                      for s in (4.0, 2.0, 3.0)])
    assert bench_e2e.trial_ms(prefill[0]) == 4000.0
    with pytest.raises(SystemExit):
        bench_e2e.main(["--dir", "unused", "--repeats", "0"])
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_e2e.main(["--dir", "unused", "--decode-gpu-experts", "fast"])
    assert "--decode-gpu-experts: a number of experts or auto, got 'fast'" in capsys.readouterr().err


def test_a_bad_preset_is_one_line(tmp_path):
    """The engine's errors (here the config's; a load's plan refusal arrives the same way from its process) end the
    script with one line, not a traceback."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(bench_e2e.__file__).parent.parent), "bench"])}
    proc = subprocess.run([sys.executable, bench_e2e.__file__, "--dir", str(tmp_path / "g"), "--preset", "nonsense"],
                          env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("bench_e2e: nonsense: no such config file (or preset: ") and \
        proc.stderr.count("\n") == 1, proc.stderr


def test_each_load_runs_in_a_process_of_its_own():
    """in_own_process: a fresh process each call (no caches or maps of an earlier load), its result or its error
    brought back."""
    child = bench_e2e.in_own_process(os.getpid)
    assert child != os.getpid() and bench_e2e.in_own_process(os.getpid) != child
    with pytest.raises(ValueError, match="invalid literal"):
        bench_e2e.in_own_process(int, "not a number")


def fake_checkpoints(tmp_path, monkeypatch, experts, shared_rest=None, bus=None, preset="glm-5"):
    """The configs of a 2- and a 3-layer cut of the preset (1 and 2 MoE layers; with shared_rest, a 3-layer one whose
    last layer is an IndexShare shared layer: all main reads of them) and bench_context faked: each load's step is
    0.5 ms + per MoE layer its experts (the next of `experts`) + 0.3 ms of rest (a shared layer's: shared_rest), and
    its host read after the decode 90, 100, 140, 100, 95, 130 GB/s in turn (bus: the GPU's pinned copy GB/s, where
    it read some experts)."""
    import json

    cuts = {"2-layers": 2, "3-layers": 3} | ({"3-layers-shared": 3} if shared_rest is not None else {})
    for name, n in cuts.items():
        shared = {"indexer_types": ["full", "full", "shared"]} if name.endswith("shared") else None
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "config.json").write_text(json.dumps(bench_e2e.shaped_config(preset, n, shared)))
    experts, reads = iter(experts), itertools.cycle([90.0, 100.0, 140.0, 100.0, 95.0, 130.0])

    def fake_load(fn, model_dir, rules, context, *rest):
        e = next(experts)
        layers = [0.3] if model_dir.name == "2-layers" else [0.3, shared_rest if model_dir.name.endswith("shared")
                                                                 else 0.3]
        return ({"context": context, "decode_ms_per_token": 0.5 + sum(e + r for r in layers),
                 "graph_split_ms_per_token": {"experts": len(layers) * e},
                 "experts_alone_ms_per_token": len(layers) * 1.9, "read_gb_s": next(reads),
                 "bus_read_gb_s": bus}, ("int4", 128))

    monkeypatch.setattr(bench_e2e, "in_own_process", fake_load)


def test_main_projects_from_the_step_in_parts(tmp_path, monkeypatch, capsys):
    """bench_e2e's two-checkpoint decode run as printed and saved: every load's figures kept, the step in parts and
    the projection from it, the difference of the median loads beside it (the loads faked: no GPU here)."""
    import json

    fake_checkpoints(tmp_path, monkeypatch, [2.0, 2.1, 2.4, 1.95, 2.45, 2.05])  # per MoE layer, load by load
    bench_e2e.main(["--dir", str(tmp_path), "--layers", "2,3", "--contexts", "4096", "--filled", "--repeats", "3",
                    "--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    assert "| 4096 | full | 6 | 2.08 | 0.30 | 2.38 | 1.14x | 0.50 |" in out
    assert "| glm-5.2 | 4096 | 2.90 | parts | 179 | 5.60 |" in out and "| glm-5.2 | 4096 | 2.90 | marginal |" in out
    saved = json.loads((tmp_path / "out.json").read_text())
    assert [len(loads) for loads in saved["loads"].values()] == [1, 1] and len(saved["loads"]["2"][0]) == 3
    assert saved["step_parts"]["full"][0]["moe_layer_ms"] == pytest.approx(2.375)
    assert saved["read_gb_s"] == [100.0] and "host read (the median of the loads') 100 GB/s" in out  # of the six


def test_main_prints_the_bound_with_the_gpus_bus_read_where_the_gpu_read_experts(tmp_path, monkeypatch, capsys):
    """A step faster than the cores' read (1.2 + 0.3 ms a GLM-5 layer against 1.61 ms at 100 GB/s) is projected where
    the GPU read experts over its bus (60 GB/s: the bytes may come in 1.0 ms), beside both bounds; without the bus
    it is the runs' noise."""
    fake_checkpoints(tmp_path, monkeypatch, [1.2] * 6, bus=60.0)
    bench_e2e.main(["--dir", str(tmp_path), "--layers", "2,3", "--contexts", "4096", "--filled", "--repeats", "3"])
    out = capsys.readouterr().out
    assert "; the GPU's bus (pinned copy) 60 GB/s" in out and "| bound with the GPU's bus read tok/s | of it |" in out
    bound = 100e9 / bench_e2e.nbytes(bench_e2e.load_config("glm-5").active_expert_weights, "int4", 128)
    ms = 0.5 + 75 * 1.5
    assert (f"| glm-5 | 4096 | 2.00 | parts | {ms:.0f} | {1e3 / ms:.2f} | {bound:.1f} | {1e3 / ms / bound:.0%} | "
            f"{bound * 1.6:.1f} | {1e3 / ms / bound / 1.6:.0%} |") in out
    fake_checkpoints(tmp_path / "cores", monkeypatch, [1.2] * 6)
    bench_e2e.main(["--dir", str(tmp_path / "cores"), "--layers", "2,3", "--contexts", "4096", "--filled"])
    out = capsys.readouterr().out
    assert "| glm-5 | 4096 | 2.00 | whole step (parts below the bound: noise) |" in out and "bus" not in out


def test_indexshare_projects_glm52s_shared_layers_from_their_own_step(tmp_path, monkeypatch, capsys):
    """--indexshare: a third cut whose last layer is a shared layer gives the step of a MoE layer that reuses the
    selection below it; GLM-5.2's 57 shared MoE layers take that step, its 18 full ones the full layers' (GLM-5's
    75 are all full)."""
    import json

    fake_checkpoints(tmp_path, monkeypatch, [2.0] * 6, shared_rest=0.1, preset="glm-5.2")
    shared = tmp_path / "3-layers-shared"
    (shared / "config.json").unlink()  # written from the full cut (cut_from, faked here: its own test is below)
    derived = []

    def fake_cut_from(base, out, config, keep):
        derived.append((base.name, out, config["indexer_types"]))
        out.mkdir(exist_ok=True)
        (out / "config.json").write_text(json.dumps(config))

    monkeypatch.setattr(bench_e2e, "cut_from", fake_cut_from)
    bench_e2e.main(["--dir", str(tmp_path), "--preset", "glm-5.2", "--layers", "2,3", "--indexshare", "--contexts",
                    "4096", "--filled", "--repeats", "2"])
    out = capsys.readouterr().out
    assert "| 4096 | full | 4 | 2.00 | 0.30 | 2.30 | 1.15x | 0.50 |" in out
    assert "| 4096 | shared | 4 | 2.00 | 0.10 | 2.10 | 1.05x | 0.70 |" in out
    assert f"| glm-5.2 | 4096 | 2.80 | parts, IndexShare | {0.5 + 18 * 2.3 + 57 * 2.1:.0f} |" in out
    assert f"| glm-5 | 4096 | 2.80 | parts | {0.5 + 75 * 2.3:.0f} |" in out
    assert derived == [("3-layers", shared, ["full", "full", "shared"])]
    with pytest.raises(SystemExit):
        bench_e2e.main(["--dir", str(tmp_path), "--preset", "glm-5", "--layers", "2,3", "--indexshare"])
    assert "--indexshare: glm-5 has no IndexShare shared layers" in capsys.readouterr().err


def test_cuts_are_written_from_the_largest_and_share_its_converted_experts(tmp_path, monkeypatch):
    """write_cuts: make_tiny writes the largest cut, the others are cut from it (cut_from) holding what make_tiny
    writes for them (config, every tensor and the index's sizes; shards fully kept hard-linked); link_experts enters
    the experts converted for one cut in the others' caches: their loads convert nothing and give the logits of
    make_tiny's own cut converted afresh."""
    from safetensors.torch import load_file

    from glm5_offload.ops import experts_numba
    from glm5_offload.runtime.kv_cache import new_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    preset = str(make_tiny(tmp_path / "tiny") / "config.json")
    cuts = [("2-layers", 2, {"indexer_types": ["full"] * 2}), ("3-layers", 3, {"indexer_types": ["full"] * 3}),
            ("3-layers-shared", 3, {"indexer_types": ["full", "full", "shared"]})]
    bench_e2e.write_cuts(tmp_path, preset, True, cuts)
    base = tmp_path / "3-layers"
    wanted = {}
    for name, layers, overrides in cuts[::2]:
        got = tmp_path / name
        want = wanted[name] = make_tiny(tmp_path / f"want-{name}", preset=preset, layers=layers, fp8=True,
                                        overrides=overrides)
        assert bench_e2e.json_object(got / "config.json") == bench_e2e.json_object(want / "config.json")
        index, want_index = (bench_e2e.json_object(d / bench_e2e.INDEX_FILE) for d in (got, want))
        assert index["metadata"] == want_index["metadata"]
        assert index["weight_map"].keys() == want_index["weight_map"].keys()
        tensors, want_tensors = ({k: v for f in set(i["weight_map"].values()) for k, v in load_file(d / f).items()}
                                 for d, i in ((got, index), (want, want_index)))
        assert all(torch.equal(tensors[k].view(torch.uint8), v.view(torch.uint8)) for k, v in want_tensors.items())
        shards = set(index["weight_map"].values())
        assert sum((got / f).stat().st_ino == (base / f).stat().st_ino for f in shards) == len(shards) - 1
    names = [bench_e2e.json_object(tmp_path / cut / bench_e2e.INDEX_FILE)["weight_map"]
             for cut in ("3-layers", "3-layers-shared")]
    assert [any(".2.self_attn.indexer." in k for k in n) for n in names] == [True, False]
    text = Path(load_rules("glm5-cpu").path).read_text()
    (tmp_path / "numba.yaml").write_text(text.replace(
        "op: experts.reference", "op: experts.numba\n    kwargs: {format: int4, group_size: 32, threads: 2}"))
    rules = load_rules(tmp_path / "numba.yaml")
    load_model(base, rules=rules, dtype=torch.float32)  # converts the base's experts
    bench_e2e.link_experts(base, [tmp_path / name for name, _, _ in cuts[::2]], ("int4", 32))
    ids = torch.arange(12, 40)
    fresh = {name: load_model(want, rules=rules, dtype=torch.float32) for name, want in wanted.items()}
    monkeypatch.setattr(experts_numba, "convert_layer", lambda *a: pytest.fail("converted again"))
    for name, want in fresh.items():
        linked = load_model(tmp_path / name, rules=rules, dtype=torch.float32)
        assert isinstance(linked.model.layers[1].mlp.experts, experts_numba.NumbaExperts)
        assert torch.equal(linked(ids, new_cache(linked, 64)), want(ids, new_cache(want, 64)))


def test_a_cut_left_by_an_earlier_run_with_other_settings_is_refused(tmp_path):
    """write_cuts keeps a cut that exists only if it holds the config it would write: one with other overrides (a
    run with fewer routed experts) or without FP8 is refused in one line naming the folder and the key, not measured
    as this cut, as is a truncated config.json; so is a single checkpoint of other layers."""
    import json

    preset = str(make_tiny(tmp_path / "tiny") / "config.json")
    shared = {"indexer_types": ["full", "full", "shared"]}
    bench_e2e.write_cuts(tmp_path, preset, True, [("3-layers-shared", 3, {**shared, "n_routed_experts": 4})])
    bench_e2e.write_cuts(tmp_path, preset, True, [("3-layers-shared", 3, {**shared, "n_routed_experts": 4})])  # kept
    experts = load_config(preset).n_routed_experts
    with pytest.raises(Glm5Error, match=rf"3-layers-shared: an earlier cut with other settings \(n_routed_experts 4, "
                                        rf"here {experts}\): remove it"):
        bench_e2e.write_cuts(tmp_path, preset, True, [("3-layers-shared", 3, shared)])
    with pytest.raises(Glm5Error, match="3-layers-shared: an earlier cut with FP8 projections, here without"):
        bench_e2e.write_cuts(tmp_path, preset, False, [("3-layers-shared", 3, {**shared, "n_routed_experts": 4})])
    (tmp_path / "3-layers-shared" / "config.json").write_text('{"num_hidden_layers": 3, "n_rout')  # truncated
    with pytest.raises(Glm5Error, match=r"3-layers-shared/config.json: not valid JSON"):
        bench_e2e.write_cuts(tmp_path, preset, True, [("3-layers-shared", 3, shared)])
    one = tmp_path / "one"  # one layer count: the checkpoint is --dir itself
    one.mkdir()
    (one / "config.json").write_text(json.dumps(bench_e2e.shaped_config("glm-5", 3)))
    with pytest.raises(Glm5Error, match=r"one: an earlier cut with other settings \(.* here .*\): remove it"):
        bench_e2e.main(["--dir", str(one), "--layers", "2", "--contexts", "4096"])
