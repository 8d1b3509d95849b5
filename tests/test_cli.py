"""The glm5 command: make-tiny, generate (text, ids, JSON, the embedded default) and its one-line errors."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glm5_offload.benchmark import format_table, prefill_projection
from glm5_offload.config import load_config
from glm5_offload.errors import Glm5Error
from glm5_offload.tiny import shaped_config, tiny_config
from glm5_offload.runtime.kv_cache import new_cache

from conftest import cli_env, glm5


def test_make_tiny_writes_a_release_shaped_checkpoint(tmp_path, glm5_here):
    out = tmp_path / "tiny"
    proc = glm5_here("make-tiny", out, "--seed", "3")
    assert "wrote a tiny glm_moe_dsa checkpoint" in proc.stdout
    config = load_config(out)
    assert config.indexer_types == ("full", "full", "shared", "full", "shared")
    assert config.index_topk < 20  # below typical prompts: the indexer really selects
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) == 5 and all((out / s).is_file() for s in shards)  # one shard per layer
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in index["weight_map"]
    assert "model.layers.2.self_attn.indexer.wk.weight" not in index["weight_map"]  # shared layer
    again = tmp_path / "again"
    glm5_here("make-tiny", again, "--seed", "3")
    shard = sorted(shards)[1]
    first, second = load_file(out / shard), load_file(again / shard)
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_make_tiny_never_replaces_a_folder_unasked(tmp_path, glm5_here):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"precious")
    (tmp_path / "afile").write_text("x")
    from glm5_offload.tiny import make_tiny

    for target, error in ((folder, "the folder is not empty; make-tiny writes a new one (--overwrite replaces it)"),
                          (tmp_path / "afile", "exists and is not a folder")):
        with pytest.raises(Glm5Error) as refused:
            make_tiny(target)
        assert str(refused.value) == f"{target}: {error}"
    assert (folder / "weights.bin").read_bytes() == b"precious" and (tmp_path / "afile").read_text() == "x"
    (tmp_path / "link").symlink_to(folder)
    for target, error in ((folder, "holds weights.bin, which is not a checkpoint's file; --overwrite replaces only a "
                                   "folder of checkpoint files"),
                          (tmp_path / "link", "is a link; --overwrite replaces a folder, not what a link points to")):
        # `glm5 make-tiny ~ --overwrite` deletes nothing
        proc = glm5_here("make-tiny", target, "--overwrite", check=False)
        assert proc.returncode == 2 and proc.stderr.strip() == f"glm5: error: {target}: {error}"
    assert (folder / "weights.bin").read_bytes() == b"precious"
    (folder / "weights.bin").unlink()
    (folder / "model.safetensors").write_bytes(b"an older checkpoint")
    (folder / "config.json").write_text("{}")
    glm5_here("make-tiny", folder, "--overwrite")
    assert not (folder / "model.safetensors").exists() and (folder / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("args, error", [
    (["--layers", "3"], "--layers needs --preset (each tiny --arch has its own layers)"),
    (["--layers", "0", "--preset", "glm-5"], "--layers must be from 1 to glm-5's 78 layers, got 0"),
    (["--layers", "79", "--preset", "glm-5"], "--layers must be from 1 to glm-5's 78 layers, got 79"),
])
def test_make_tiny_layers_out_of_range(tmp_path, args, error, glm5_here):
    proc = glm5_here("make-tiny", tmp_path / "out", *args, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == f"glm5: error: {error}"
    assert not (tmp_path / "out").exists()


def test_make_tiny_checks_the_disk_first(tmp_path, monkeypatch):
    import shutil

    from glm5_offload import tiny

    monkeypatch.setattr(tiny.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 10 << 30, 1 << 20))
    with pytest.raises(Glm5Error, match=r"out: the checkpoint needs \d+\.\d\d MiB, its disk has 1\.00 MiB free"):
        tiny.make_tiny(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
    down = "model.layers.1.mlp.experts.0.down_proj.weight"
    assert tiny.stored_bytes(down, (6144, 2048), fp8=True) == 6144 * 2048 + 4 * 48 * 16  # e4m3 + block scales
    assert tiny.stored_bytes(down, (6144, 2048), fp8=False) == 6144 * 2048 * 2
    assert tiny.stored_bytes("model.norm.weight", (6144,), fp8=True) == 6144 * 2


def test_tiny_tokenizer_and_chat_template(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir()), local_files_only=True)
    config = load_config(tiny_dir())
    specials = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>"]
    assert all(len(tok.encode(s, add_special_tokens=False)) == 1 for s in specials)
    assert tok.convert_ids_to_tokens(list(config.eos_token_ids)) == ["<|endoftext|>", "<|user|>", "<|observation|>"]
    text = "Hello, world! def main(): return 42 — ünïcode"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) < len(text.encode())  # byte-level BPE with real merges
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>\n<think>"
    no_think = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|assistant|>\n<think></think>\n")


def test_generate_json_greedy_matches_the_engine(tiny_dir):
    path = tiny_dir()
    proc = glm5("generate", "--model", path, "--prompt", "Hello! How are you", "--max-new-tokens", 6,
                "--temperature", 0, "--json")
    out = json.loads(proc.stdout)
    assert set(out) >= {"prompt_ids", "output_ids", "text", "prefill_tokens_per_s", "decode_tokens_per_s"}
    assert out["random_weights"] is False and out["prefill_tokens_per_s"] > 0
    assert out["output_ids"] == engine_in_a_child(path, "glm5", out["prompt_ids"], 6)  # no --rules: the default
    assert "no --rules given: the default placement glm5" in proc.stderr
    assert isinstance(out["text"], str)


def test_prompt_file_and_stdin_read_the_text(tiny_dir, tmp_path, monkeypatch):
    import io
    from argparse import Namespace

    from glm5_offload.cli import _prompt_text

    text = "Hello! How are you, caf\u00e9 \u2615\n"
    (tmp_path / "prompt.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())  # with a byte-order mark
    assert _prompt_text(Namespace(prompt=None, prompt_file=str(tmp_path / "prompt.txt"))) == text
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert _prompt_text(Namespace(prompt=None, prompt_file="-")) == text
    from transformers import AutoTokenizer

    out = json.loads(glm5("generate", "--model", tiny_dir(), "--prompt-file", tmp_path / "prompt.txt",
                          "--max-new-tokens", 2, "--json").stdout)
    assert out["prompt_ids"] == AutoTokenizer.from_pretrained(str(tiny_dir())).encode(text, add_special_tokens=False)


@pytest.mark.parametrize("args, want", [
    (["--prompt-ids", "5000"], "prompt token id 5000 is outside the vocabulary (0..1023)"),
    (["--prompt-ids", ","], "the prompt is empty"),
    (["--prompt-ids", "1,2", "--max-seq-len", 10, "--max-new-tokens", 20],
     "prompt of 2 tokens + 20 new tokens exceeds max_seq_len 10"),
    (["--prompt", "a b c d e f g h", "--max-seq-len", 6, "--max-new-tokens", 1], "new tokens exceeds max_seq_len 6"),
])
def test_a_prompt_that_cannot_run_is_refused_before_any_weight_is_read(tiny_dir, tmp_path, args, want, glm5_here):
    path = broken_copy(tiny_dir, tmp_path)
    for shard in path.glob("*.safetensors"):  # a weight read would fail on these
        shard.write_bytes(b"")
    proc = glm5_here("generate", "--model", path, *args, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("glm5: error: ")
    assert want in proc.stderr.strip().splitlines()[-1]


def test_prompt_file_errors(tiny_dir, tmp_path, glm5_here):
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    # beyond the 128 KiB Linux allows one command-line argument: read whole, then refused for the tiny model's context
    (tmp_path / "book.txt").write_text("A long document about the lightning indexer, line by line.\n" * 4000)
    for name, needle in (("latin1.txt", "--prompt-file {}: not UTF-8 text (byte 3)"),
                         ("missing.txt", "--prompt-file {}: cannot read it (No such file or directory)"),
                         ("", "--prompt-file {}: cannot read it (Is a directory)"),
                         ("book.txt", "exceeds max_seq_len 4096")):
        proc = glm5_here("generate", "--model", tiny_dir(), "--prompt-file", tmp_path / name, check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("glm5: error:")]
        assert proc.returncode == 2 and len(errors) == 1 and needle.format(tmp_path / name) in errors[0], proc.stderr
    tokens = int(re.search(r"prompt of (\d+) tokens", errors[0]).group(1))
    assert tokens > 40000 and (tmp_path / "book.txt").stat().st_size > 128 << 10
    if Path("/dev/zero").exists():  # endless: read to 64 MiB and refused, not read until memory runs out
        proc = glm5_here("generate", "--model", tiny_dir(), "--prompt-file", "/dev/zero", check=False)
        assert proc.returncode == 2 and "--prompt-file /dev/zero: more than 64 MiB, beyond any model's context" in (
            proc.stderr)


def test_flash_generate_takes_its_family_default_rules(tmp_path):
    path = tmp_path / "flash"
    assert "wrote a tiny glm5_next checkpoint" in glm5("make-tiny", path, "--arch", "glm5_next").stdout
    assert "model.language_model.layers.3.self_attn.indexer.index_kpool_compress_gate" in json.loads(
        (path / "model.safetensors.index.json").read_text())["weight_map"]
    proc = glm5("generate", "--model", path, "--prompt", "Hello! How are you", "--max-new-tokens", 4, "--temperature",
                0, "--json")
    assert "the default placement glm5-flash for glm5_next" in proc.stderr
    out = json.loads(proc.stdout)
    assert out["output_ids"] == engine_in_a_child(path, "glm5-flash", out["prompt_ids"], 4)


def engine_in_a_child(path, rules: str, prompt: list[int], n: int) -> list[int]:
    """The greedy tokens of an Engine under `rules` on the CPU, in a child process computing as a `glm5` child does
    (the GPU operators through their references: Triton's interpreter, which this process runs, is 4x slower)."""
    code = ("import json, sys; from glm5_offload.loader import load_model; from glm5_offload.rules import load_rules;"
            "from glm5_offload.runtime.engine import Engine;"
            f"e = Engine(load_model({str(path)!r}, rules=load_rules({rules!r}), device='cpu'));"
            f"print(json.dumps(e.generate({prompt!r}, {n}).output_ids))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_generate_prompt_ids_with_sampling_seed(tiny_dir):
    args = ["generate", "--model", tiny_dir(), "--prompt-ids", "12,40,77", "--max-new-tokens", 8,
            "--temperature", 0.9, "--top-p", 0.9, "--top-k", 50, "--seed", 5, "--json"]
    a, b = json.loads(glm5(*args).stdout), json.loads(glm5(*args).stdout)
    assert a["prompt_ids"] == [12, 40, 77] and a["output_ids"] == b["output_ids"]


def test_generate_streams_text(tiny_dir):
    proc = glm5("generate", "--model", tiny_dir(), "--prompt", "The quick brown fox", "--max-new-tokens", 6)
    assert proc.stdout.strip() and "prompt tokens at" in proc.stderr


def test_default_model_is_created_on_first_use_and_says_it_is_random(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    proc = glm5("generate", "--prompt", "Hello", "--max-new-tokens", 4, "--json", env=env)
    assert "weights are random" in proc.stderr
    out = json.loads(proc.stdout)
    assert out["random_weights"] is True and len(out["output_ids"]) >= 1
    assert (tmp_path / "glm5-offload" / "tiny-glm5" / "config.json").is_file()


@pytest.mark.parametrize("args, needle", [
    (["generate", "--model", "/nonexistent/model", "--prompt", "x"], "/nonexistent/model: no such model directory"),
    (["generate", "--prompt-ids", "1,x,3"], "--prompt-ids"),
    (["generate", "--prompt-ids", "1,,3"], "--prompt-ids: '1,,3' has an empty entry (entry 2)"),
    (["generate", "--prompt-ids", "1,2,3", "--max-new-tokens", 10, "--max-seq-len", 8], "exceeds max_seq_len 8"),
    (["generate", "--prompt-ids", "1,2,3", "--prefill-chunk", 0], "--prefill-chunk must be >= 1"),
    (["generate", "--prompt-ids", "1,2", "--temperature", "nan"], "temperature must be a number >= 0, got nan"),
    (["generate", "--prompt-ids", "1,2", "--seed", "1180591620717411303424"], "seed must be a 64-bit integer"),
    (["generate", "--prompt-ids", "1,2", "--device", "cuda:x"], "--device: device must be cpu, cuda or cuda:N"),
    (["generate", "--prompt-ids", "1,2", "--device", "tpu"], "--device: device must be cpu, cuda or cuda:N, got 'tpu'"),
    (["generate", "--prompt-ids", "1,2", "--max-new-tokens", -1], "--max-new-tokens must be >= 1, got -1"),
    (["generate", "--prompt-ids", "1,2", "--max-seq-len", 0], "--max-seq-len must be >= 1, got 0"),
    (["generate", "--prompt-ids", "1,2", "--cpu-threads", 100000], "--cpu-threads 100000 is more than the "),
    (["bench", "--context", 0], "--context must be >= 1, got 0"),
    (["bench", "--context", 8, "--new-tokens", 1], "--new-tokens must be >= 2 (the first new token comes from the "
                                                   "prefill; decode is timed from the second), got 1"),
    (["serve", "--port", 99999], "--port must be 0-65535, got 99999"),
    (["serve", "--port=-1"], "--port must be 0-65535, got -1"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle, glm5_here, monkeypatch):
    """A bad flag is refused before any model is read or the default one written (only the prompt's length needs
    the model's config)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    proc = glm5_here(*args, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("glm5: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0]
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "glm5-offload").exists() == ("max_seq_len" in needle)


def test_a_flag_argparse_refuses_is_its_usage_and_exit_2(glm5_here):
    proc = glm5_here("generate", "--prompt-ids", "1", "--max-new-tokens", "many", check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: glm5 generate")
    assert proc.stderr.splitlines()[-1] == "glm5 generate: error: argument --max-new-tokens: invalid int value: 'many'"


def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path):
    """`glm5 generate ... | head -c 1`: the pipe closed under the streamed reply stops the command with SIGPIPE's
    exit status and no traceback (there was one from the reply's print)."""
    proc = subprocess.Popen([sys.executable, "-m", "glm5_offload.cli", "generate", "--prompt-ids", "5,6,7",
                             "--max-new-tokens", "200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=cli_env({"XDG_CACHE_HOME": str(tmp_path)}))
    assert len(proc.stdout.read(1)) == 1
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and "Traceback" not in stderr and "Error" not in stderr, stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_output_to_a_full_disk_is_one_line():
    """`glm5 ... > file` on a full disk (/dev/full): one error line and exit 2, no traceback."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "glm5_offload.cli", "rules", "operators"], stdout=full,
                              stderr=subprocess.PIPE, text=True, env=cli_env())
    assert proc.returncode == 2 and proc.stderr == "glm5: error: cannot write the output: No space left on device\n"


def test_fp8_cache_and_small_prefill_chunks(tmp_path):
    """--kv-dtype fp8 (656 B-form rows, 132 B keys) and --prefill-chunk: the same greedy start as rows in the
    compute dtype (glm5-cpu's: the default rules/glm5.yaml keeps FP8 rows already)."""
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    ids = ",".join(str(i) for i in range(20, 60))
    run = ("generate", "--rules", "glm5-cpu", "--prompt-ids", ids, "--max-new-tokens", 6, "--json")
    base = json.loads(glm5(*run, env=env).stdout)
    fp8 = json.loads(glm5(*run, "--kv-dtype", "fp8", "--prefill-chunk", "7", env=env).stdout)
    assert len(fp8["output_ids"]) == 6 and fp8["output_ids"][0] == base["output_ids"][0]


def test_bench_reports_speed_split_and_memory(tmp_path):
    """`glm5 bench` on the tiny model (figures are not asserted, only their shape and consistency)."""
    proc = glm5("bench", "--context", "40", "--new-tokens", "4", "--json", env={"XDG_CACHE_HOME": str(tmp_path)})
    table, last = proc.stdout.rsplit("\n", 2)[0], proc.stdout.strip().splitlines()[-1]
    r = json.loads(last)
    assert r["context"] == 40 and r["new_tokens"] == 4
    assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 and r["peak_host_bytes"] > 0
    split = r["split_ms_per_token"]
    assert set(split) == {"attention", "experts", "transfers", "dense", "other"} and split["attention"] > 0
    assert split["dense"] > 0  # the tiny model's first layer is dense
    assert split["experts"] > 0 and split["transfers"] == 0  # all on the CPU: nothing crosses to a GPU
    assert r["split_prefilled_tokens"] == 1  # the split run decodes from the cache, it does not prefill
    assert r["cuda_graphs"] is False and r["graph_split_ms_per_token"] is None  # no GPU: eager decode
    assert r["moe_layer_step"] is None and "a MoE layer after another" not in table
    graphed = format_table({**r, "graph_split_ms_per_token": {"experts": 3.0, "gpu wait": 0.4, "other": 0.1},
                            "moe_layer_step": {"layers": 12, "experts_ms": 1.5, "hand_off_ms": 0.15,
                                               "step_over_experts": 1.1}})  # as from a GPU's graphs
    assert ("a MoE layer after another: its CPU experts 1.500 ms, the hand-off before them (the GPU's work since the "
            "last layer's) 0.150 ms: step / experts 1.10x") in graphed
    prefill = r["prefill_split_s"]  # the context prefilled afresh: the indexer is a part of attention
    assert set(prefill) == {"attention", "experts", "transfers", "dense", "other", "of which indexer"}
    assert 0 < prefill["of which indexer"] < prefill["attention"] and prefill["experts"] > 0
    assert "decode step, eager, per token" in table and "of which indexer" in table and "eager)" in table and "peak memory" in table
    bound = r["host_bound"]  # the CPU experts' bytes a token at the host's read bandwidth
    assert bound["expert_bytes_per_token"] > 0 and bound["host_read_gb_s"] > 0 and 0 < bound["of_bound"]
    assert "host-bandwidth bound" in table
    assert bound["gpu_experts"] == 0 and "over its bus" not in table  # no GPU: the cores read every expert
    assert bound["bus_read_gb_s"] is None and bound["bus_bound_tok_s"] is None  # (nor its bus's read timed)
    shared = format_table({**r, "host_bound": {**bound, "gpu_experts": 1, "bus_read_gb_s": 50.0,
                                               "bus_bound_tok_s": 40.0, "of_bus_bound": 0.5}})  # as on a GPU
    assert (f"of each token's {bound['experts_per_token']} experts the GPU read 1 over its bus (decode_gpu_experts): "
            "the bound above is the cores' read alone; with the bus's 50.0 GB/s (a pinned copy) beside it 40.0 tok/s, "
            "decode 50.0% of it") in shared
    assert f"the experts on {bound['experts_threads']} threads (numba's {bound['threading_layer']} layer)" in table
    assert bound["experts_threads"] >= 1 and bound["threading_layer"] in ("omp", "tbb", "workqueue")
    # the tiny model's int4 experts read into memory of their own: its mappings, some of it perhaps in huge pages
    assert bound["experts_mapped_bytes"] > 0 and 0 <= bound["experts_huge_page_bytes"] <= bound["experts_mapped_bytes"]
    assert "the CPU experts' memory" in table
    # the same experts timed alone in that process, every MoE layer's (a tiny model's sit in the cache: its fraction
    # of the read may pass 1)
    assert bound["experts_alone_ms_per_token"] > 0 and bound["experts_alone_of_read"] > 0
    assert "the CPU experts alone (random routing, this process)" in table
    assert bound["experts_replayed_ms_per_token"] > 0 and "the decode's own calls again alone" in table
    saved = r["saved_context"]  # the prefilled context saved and loaded back
    assert saved["tokens"] == 40 and saved["bytes"] > 40 * 5 * 64 and saved["save_s"] > 0 and saved["load_s"] > 0
    assert "context of 40 tokens saved" in table
    assert r["prefill_projection"] == [] and "projected" not in table  # tiny dims: no full model to scale to


def test_experts_alone_needs_cpu_experts():
    from glm5_offload.benchmark import experts_alone, experts_replayed
    assert experts_alone(torch.nn.Sequential(torch.nn.Linear(4, 4))) is None and experts_replayed([]) is None


def test_a_decodes_expert_calls_are_recorded_and_made_again(tmp_path, monkeypatch):
    """bench's replay: each MoE layer's one-token calls of a decode (not the prompt's), with their inputs, made
    again in their order; the layers' own method back afterwards."""
    from glm5_offload import tiny
    from glm5_offload.benchmark import experts_replayed, recorded_experts
    from glm5_offload.loader import load_model
    from glm5_offload.ops.experts_numba import NumbaExperts
    from glm5_offload.rules import load_rules
    from glm5_offload.runtime.engine import Engine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = load_model(tiny.make_tiny(tmp_path / "ckpt"), rules=load_rules("glm5"), device="cpu")
    layers = [m for m in model.modules() if isinstance(m, NumbaExperts)]
    engine = Engine(model, max_seq_len=64)
    engine.stop_ids = set()
    with recorded_experts(model) as calls:
        engine.generate(list(range(12, 24)), 3)  # 12 prompt tokens in one forward, then 2 one-token forwards
    assert [layer for layer, *_ in calls] == layers * 2 and all(len(x) == 1 for _, x, _, _, _ in calls)
    assert all(seconds > 0 for *_, seconds in calls)  # each call's time where it ran
    with recorded_experts(model) as twice:  # a graph bucket's first step: its warm-up, then its replay
        for layer, *inputs, _ in calls[-len(layers):] * 2:
            layer._compute(*inputs)
    assert [layer for layer, *_ in twice] == layers
    assert all("_compute" not in vars(layer) for layer in layers)
    made = []
    monkeypatch.setattr(NumbaExperts, "_compute", lambda self, x, ids, w: made.append((self, x, ids, w)))
    assert experts_replayed(calls) > 0 and made == [call[:4] for call in calls]


def test_prefill_projection_scales_each_part_by_its_layers(tmp_path):
    """A full model's own split projects onto itself unchanged; onto GLM-5 (78 full-indexer layers against
    GLM-5.2's 21, the same layer, MoE and dense counts) only the indexer scales; a checkpoint cut to a few layers
    of GLM-5.2's dims (make-tiny --preset) scales each part by its layers (the dense MLPs by the dense layers);
    other dims project nowhere."""
    split = {"attention": 30.0, "of which indexer": 12.0, "experts": 20.0, "transfers": 5.0, "dense": 4.0,
             "other": 3.0}
    config = load_config("glm-5.2")
    full = config.indexer_types.count("full")
    assert (full, config.num_hidden_layers, len(config.moe_layers)) == (21, 78, 75)
    rows = {p["target"]: p for p in prefill_projection(split, config)}
    assert rows["glm-5.2"]["projected_prefill_s"] == pytest.approx(30 + 20 + 5 + 4 + 3)
    assert rows["glm-5"]["parts_s"] == pytest.approx({"indexer": 12 * 78 / 21, "rest": 21.0, "experts": 25.0,
                                                      "dense": 4.0})
    def written(name, config):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return load_config(tmp_path / name)

    cut = written("cut", shaped_config("glm-5.2", 3))
    full_cut, moe_cut = cut.indexer_types.count("full"), len(cut.moe_layers)
    rows = {p["target"]: p for p in prefill_projection(split, cut)}
    assert rows["glm-5.2"]["parts_s"] == pytest.approx({"indexer": 12 * 21 / full_cut, "rest": 21 * 78 / 3,
                                                        "experts": 25 * 75 / moe_cut, "dense": 4 * 3 / (3 - moe_cut)})
    assert prefill_projection(split, load_config("glm-5.3-flash")) == []  # no DSA kind of its own to scale to
    assert prefill_projection(split, written("tiny", tiny_config("glm_moe_dsa"))) == []  # tiny dims


def test_preset_shaped_checkpoint_keeps_the_real_dims(tmp_path, glm5_here):
    """--preset: the published config's dims cut to a few layers (a small config.json stands in for GLM-5's
    here; its real dims are checked on the config alone), written a layer a shard, loadable and runnable."""
    from glm5_offload.loader import load_model

    real = shaped_config("glm-5", 4)
    assert (real["hidden_size"], real["n_routed_experts"], real["moe_intermediate_size"], real["index_head_dim"],
            real["num_hidden_layers"], real["first_k_dense_replace"], real["vocab_size"]) == (
               6144, 256, 2048, 128, 4, 1, 1024)
    bench = shaped_config("glm-5.2", 2, {"first_k_dense_replace": 2, "indexer_types": ["full", "shared"]})  # bench_tiered's
    assert (bench["first_k_dense_replace"], bench["indexer_types"], bench["hidden_size"]) == (2, ["full", "shared"], 6144)
    small = {**tiny_config(), "hidden_size": 192, "n_routed_experts": 12}
    (tmp_path / "preset").mkdir()
    (tmp_path / "preset" / "config.json").write_text(json.dumps(small))
    out = tmp_path / "shaped"
    proc = glm5_here("make-tiny", out, "--preset", tmp_path / "preset" / "config.json", "--layers", "3", "--fp8")
    assert "-shaped, 3 layers FP8 checkpoint" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["n_routed_experts"], config["num_hidden_layers"]) == (192, 12, 3)
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert sorted(p.name for p in out.glob("*.safetensors")) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    model = load_model(out, dtype=torch.float32)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["MLP", "MoE", "MoE"]
    logits = model(torch.arange(5, 25), new_cache(model, 32))
    assert logits.shape == (20, 1024) and torch.isfinite(logits).all()
    again = tmp_path / "again"  # each tensor from its own seeded stream, on several threads: the same bytes
    glm5("make-tiny", again, "--preset", tmp_path / "preset" / "config.json", "--layers", "3", "--fp8")
    for shard in out.glob("*.safetensors"):
        assert (again / shard.name).read_bytes() == shard.read_bytes()


def test_non_utf8_prompt_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "glm5_offload.cli", "generate", "--prompt", b"caf\xe9 \xff"],
                          capture_output=True, text=True, env=cli_env({"XDG_CACHE_HOME": str(tmp_path)}), timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == "glm5: error: --prompt is not valid UTF-8"


def broken_copy(tiny_dir, tmp_path, config=None, drop_template=False):
    """A make-tiny checkpoint copy with config.json keys changed (or the chat template removed)."""
    import shutil

    path = shutil.copytree(tiny_dir(), tmp_path / "ckpt")
    if config is not None:
        (path / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()), **config}))
    if drop_template:
        tok = json.loads((path / "tokenizer_config.json").read_text())
        tok.pop("chat_template", None)
        (path / "tokenizer_config.json").write_text(json.dumps(tok))
        (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize("config, needle", [({"num_hidden_layers": -1}, "'num_hidden_layers' must be > 0"),
                                            ({"hidden_size": "many"}, "'hidden_size' must be int"),
                                            ({"eos_token_id": "</s>"}, "'eos_token_id' must be an integer"),
                                            ({"n_shared_experts": -1}, "'n_shared_experts' must be >= 0")])
def test_a_bad_config_is_one_line_before_the_tokenizer_loads(tiny_dir, tmp_path, command, config, needle, glm5_here):
    path = broken_copy(tiny_dir, tmp_path, config)
    args = [command, "--model", path] + {"generate": ["--prompt", "hi"], "chat": [], "serve": ["--port", 0]}[command]
    proc = glm5_here(*args, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"glm5: error: {path / 'config.json'}: field")
    assert needle in proc.stderr


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_a_model_without_a_chat_template_is_refused_at_start(tiny_dir, tmp_path, command, glm5_here):
    proc = glm5_here(command, "--model", broken_copy(tiny_dir, tmp_path, drop_template=True),
                     *(["--port", 0] if command == "serve" else []), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "has no chat template" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_a_broken_chat_template_is_refused_at_start(tiny_dir, tmp_path, command, glm5_here):
    """(It was a traceback from jinja2 in chat, and in serve a dropped connection for every request.)"""
    path = broken_copy(tiny_dir, tmp_path, drop_template=True)
    (path / "chat_template.jinja").write_text("{% for m in %}{{ m.content }}{% endfor %}")
    proc = glm5_here(command, "--model", path, *(["--port", 0] if command == "serve" else []), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"glm5: error: {path}: the chat template failed: TemplateSyntaxError: ")


def test_a_rule_that_matches_nothing_is_warned_when_loading(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("- default: {device: cpu}\n- match: {name: 'no_such_module'}\n  replace: {device: cpu}\n")
    proc = glm5("generate", "--prompt-ids", "5,6", "--max-new-tokens", 2, "--rules", rules,
                env={"XDG_CACHE_HOME": str(tmp_path)})
    assert f"{rules}: rule 2 (name~no_such_module) matched no module of this model" in proc.stderr


def test_ctrl_c_during_generate_is_one_line(tmp_path):
    import signal
    import time

    env = cli_env({"XDG_CACHE_HOME": str(tmp_path)})
    glm5("make-tiny", tmp_path / "glm5-offload" / "tiny-glm5", env={"XDG_CACHE_HOME": str(tmp_path)})
    # the installed command, as users press Ctrl-C in it; under `python -m` CPython itself at times ends by SIGINT
    # (returncode -2) after main has printed the one line and returned 130, when the interrupt lands in the first
    # imports of a loaded machine (seen on the 2-core box, session 22; the cause inside CPython not established)
    script = Path(sys.executable).parent / "glm5"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "glm5_offload.cli"]
    proc = subprocess.Popen([*command, "generate", "--prompt-ids", "5,6", "--max-new-tokens", "4000", "--ignore-eos"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a shell's command
    try:
        time.sleep(8)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()  # a no-op once it has exited
    assert proc.returncode == 130 and "Traceback" not in err and err.strip().splitlines()[-1] == "glm5: interrupted"


@pytest.mark.parametrize("args, source", [
    (["generate", "--prompt", "hi", "--max-seq-len", 5000], "--max-seq-len 5000"),
    (["chat", "--max-seq-len", 5000], "--max-seq-len 5000"),
    (["bench", "--context", 5000, "--new-tokens", 2], "--context 5000 + 2 x --new-tokens 2 = 5004"),
])
def test_a_context_beyond_the_models_positions_is_refused_before_any_weight_is_read(tiny_dir, tmp_path, args, source,
                                                                                   glm5_here):
    path = broken_copy(tiny_dir, tmp_path)
    for shard in path.glob("*.safetensors"):  # a weight read would fail on these
        shard.write_bytes(b"")
    proc = glm5_here(args[0], "--model", path, *args[1:], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    want = f"glm5: error: {source} exceeds the model's max_position_embeddings 4096 ({path / 'config.json'})"
    assert proc.stderr.strip().splitlines()[-1] == want
