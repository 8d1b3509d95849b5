"""Saved contexts: written after a run, resumed by another engine or process with the tokens a fresh run decodes;
truncated, foreign, corrupt and mismatched files refused in one line with the engine left as it was; chat's /save
and /load and serve's --context-dir keep the cache too."""

import json
import os
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from glm5_offload.chat import Conversation
from glm5_offload.errors import Glm5Error
from glm5_offload.loader import load_model
from glm5_offload.rules import load_rules
from glm5_offload.runtime.engine import Engine
from glm5_offload.runtime.saved_context import load_context, save_context

from conftest import cli_env, glm5

PROMPT = list(range(12, 112))
MORE = PROMPT + list(range(200, 230))


def engine(path, rules="glm5-cpu", max_seq_len=512, **kw):
    model = load_model(path, dtype=torch.float32, rules=load_rules(rules), device="cpu", **kw)
    e = Engine(model, max_seq_len=max_seq_len)
    e.stop_ids = set()
    return e


@pytest.mark.parametrize("rules, tokens, n", [("glm5-cpu", 100, 4), ("glm5", 40, 2)])  # the plain cache; the
def test_a_resumed_context_decodes_what_a_fresh_run_decodes(tiny_dir, tmp_path, rules, tokens, n):  # tiered FP8 one
    """Resumed, an engine decodes what the engine that saved would have; with the plain fp32 operators also what a
    fresh run of the whole prompt does (the fast ones' sums depend on how the prompt is cut into chunks, as any
    prefix reuse's do). Both prompts are longer than the tiny model's index_topk (16): attention is sparse; the fast
    operators' is 40 tokens and n 2 new tokens a turn (Triton's interpreter runs a program per token for the
    router)."""
    path, first_prompt = tiny_dir(), PROMPT[:tokens]
    first = engine(path, rules)
    out = first.generate(first_prompt, n).output_ids
    saved = save_context(first, tmp_path / "ctx.safetensors")
    assert saved == len(first_prompt) + n - 1  # the prompt and every output token but the last (never fed)
    resumed = engine(path, rules)
    assert load_context(resumed, tmp_path / "ctx.safetensors") == saved
    prompt = first_prompt + out + list(range(300, 310))
    got = resumed.generate(prompt, n)
    assert got.reused_tokens == saved
    assert got.output_ids == first.generate(prompt, n).output_ids  # the saving engine going on: the same cache bits
    if rules == "glm5-cpu":  # plain fp32 torch: a fresh run, the whole prompt in one chunk, decodes the same too
        assert got.output_ids == engine(path, rules).generate(prompt, n).output_ids
    again = engine(path, rules)  # a prompt that leaves the saved tokens early reuses what it shares
    load_context(again, tmp_path / "ctx.safetensors")
    assert again.generate(first_prompt + list(range(200, 206)), n).reused_tokens == len(first_prompt)


def test_rows_of_another_placement_resume_with_a_warning(tiny_dir, tmp_path, caplog):
    """The same weights and cache form under another placement (here the routed experts in int8 on numba): the rows
    are resumed, with a warning that they are not what this placement would compute; under the same placement, or
    one that differs in where and when its operators work (threads, cache folder), none."""
    from glm5_offload.rules import resolve_rules_path

    path = tiny_dir()
    numba = tmp_path / "numba.yaml"
    numba.write_text(resolve_rules_path("glm5-cpu").read_text().replace(
        "op: experts.reference", f"op: experts.numba\n    kwargs: {{format: int8, cache_dir: '{tmp_path}'}}"))
    threads = tmp_path / "threads.yaml"
    threads.write_text(numba.read_text().replace("format: int8,", "format: int8, threads: 1,"))
    saver = engine(path)
    saver.generate(PROMPT, 2)
    save_context(saver, tmp_path / "ctx.safetensors")

    def load(placement, name) -> list[str]:
        caplog.clear()
        target = engine(path, placement)
        assert load_context(target, tmp_path / name) == len(PROMPT) + 1
        assert target.generate(target.cache_ids + [5], 1).reused_tokens == len(PROMPT) + 1
        return [r.getMessage() for r in caplog.records if "another placement" in r.getMessage()]

    assert load("glm5-cpu", "ctx.safetensors") == []
    warnings = load(numba, "ctx.safetensors")
    assert len(warnings) == 1 and warnings[0].startswith(f"{tmp_path / 'ctx.safetensors'}: saved under another "
                                                         "placement")
    saver = engine(path, numba)
    saver.generate(PROMPT, 2)
    save_context(saver, tmp_path / "numba.safetensors")
    assert load(threads, "numba.safetensors") == []


def test_a_context_saved_before_any_run_loads_as_an_empty_one(tiny_dir, tmp_path):
    """An engine that never ran has no cache: its saved context holds no rows and loads as none (chat's /save before
    the first turn, then /load)."""
    path = tiny_dir()
    save_context(engine(path), tmp_path / "empty.safetensors")
    target = engine(path)
    target.generate(PROMPT, 2)
    assert load_context(target, tmp_path / "empty.safetensors") == 0 and target.cache_ids == []
    assert target.generate(PROMPT, 1).reused_tokens == 0


def test_a_second_process_resumes_the_context(tiny_dir, tmp_path):
    """On the CPU: generate --save-context, then another process --load-context: cached_tokens in its JSON, and
    the tokens of a fresh run of the same prompt."""
    path, ctx = tiny_dir(), tmp_path / "doc.safetensors"
    common = ["generate", "--model", path, "--rules", "glm5-cpu", "--dtype", "float32", "--max-new-tokens", 6, "--json"]
    first = json.loads(glm5(*common, "--prompt-ids", ",".join(map(str, PROMPT)), "--save-context", ctx).stdout)
    assert first["cached_tokens"] == 0 and ctx.exists()
    prompt = ",".join(map(str, PROMPT + first["output_ids"] + [300, 301]))
    proc = glm5(*common, "--prompt-ids", prompt, "--load-context", ctx)
    resumed = json.loads(proc.stdout)
    assert resumed["cached_tokens"] == len(PROMPT) + 5 and f"resumed {len(PROMPT) + 5} tokens" in proc.stderr
    assert resumed["output_ids"] == json.loads(glm5(*common, "--prompt-ids", prompt).stdout)["output_ids"]


def test_context_flags_are_checked_before_anything_loads(tmp_path, glm5_here):
    for args, message in [(["--save-context", tmp_path], "a folder, not a file"),
                          (["--save-context", tmp_path / "no" / "x.ctx"], "the folder .*/no does not exist"),
                          (["--save-context", "/proc/sys/x.ctx"], "cannot write in /proc/sys \\("),
                          (["--load-context", tmp_path / "missing.ctx"], "not a file \\(missing, or a folder\\)")]:
        proc = glm5_here("generate", "--model", tmp_path / "no-model", "--prompt-ids", "1,2", *args, check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("glm5: error:")]
        assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr
        assert re.search(message, errors[0]), errors[0]


def test_a_save_interrupted_mid_write_leaves_no_file(tiny_dir, tmp_path, monkeypatch):
    from glm5_offload.runtime import saved_context

    saver = engine(tiny_dir())
    saver.generate(PROMPT, 2)
    write = saved_context._write_safetensors

    def interrupted(path, arrays, metadata):  # as Ctrl-C, or SIGTERM through glm5's handler, lands mid-write
        write(path, arrays, metadata)
        raise KeyboardInterrupt

    monkeypatch.setattr(saved_context, "_write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_context(saver, tmp_path / "x.ctx")
    assert list(tmp_path.iterdir()) == []


def test_bad_files_are_refused_and_the_engine_keeps_its_state(tiny_dir, tmp_path):
    path = tiny_dir()
    saver = engine(path)
    saver.generate(PROMPT, 4)
    good = tmp_path / "good.safetensors"
    save_context(saver, good)
    data = good.read_bytes()
    target = engine(path)
    target.generate(MORE, 2)
    state = (list(target.cache_ids), target.cache.length)

    def refused(content: bytes, message: str, name="bad.safetensors"):
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(Glm5Error, match=message):
            load_context(target, bad)
        assert (target.cache_ids, target.cache.length) == state

    refused(data[:-100], "truncated or corrupt safetensors file")
    refused(data[:5], "truncated safetensors file")
    flipped = bytearray(data)
    flipped[-50] ^= 0xFF  # in the last tensor's data
    refused(bytes(flipped), "is corrupt \\(its CRC-32 differs")
    refused((path / "model.safetensors").read_bytes() if (path / "model.safetensors").exists()
            else next(path.glob("*.safetensors")).read_bytes(), "not a saved glm5-offload context")
    with pytest.raises(Glm5Error, match="cannot read the context"):
        load_context(target, tmp_path / "missing.safetensors")
    foreign = engine(tiny_dir(fp8=True))  # another model (its config says FP8)
    foreign.generate(PROMPT, 2)
    save_context(foreign, tmp_path / "foreign.safetensors")
    refused((tmp_path / "foreign.safetensors").read_bytes(), "saved with another model's config.json")
    copy = shutil.copytree(path, tmp_path / "copy")  # the same config, weights written again since
    shard = next(copy.glob("*.safetensors"))
    os.utime(shard, (shard.stat().st_atime, shard.stat().st_mtime + 60))
    retouched = engine(copy)
    retouched.generate(PROMPT, 2)
    save_context(retouched, tmp_path / "retouched.safetensors")
    refused((tmp_path / "retouched.safetensors").read_bytes(), "saved with other weights")
    fp8 = engine(path, kv_dtype="fp8")  # the same model, its cache in the FP8 forms
    fp8.generate(PROMPT, 2)
    save_context(fp8, tmp_path / "fp8.safetensors")
    refused((tmp_path / "fp8.safetensors").read_bytes(), "saved with another cache form")
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"]["identity"] = "[" * 100000 + "]" * 100000  # nested past Python's stack
    nested = json.dumps(header).encode()
    refused(len(nested).to_bytes(8, "little") + nested + data[8 + n :], "corrupt context metadata")
    assert load_context(target, good) == len(PROMPT) + 3  # and a good one still loads


def test_chat_save_and_load_keep_the_cache(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    path = tiny_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    talk = Conversation(engine(path), tokenizer, max_new_tokens=6, system="Be brief.")
    first = talk.ask("Hello there, tell me about the weather today.")
    talk.save(str(tmp_path / "talk.json"))
    assert (tmp_path / "talk.json.context").exists()
    fresh = Conversation(engine(path), tokenizer, max_new_tokens=6)
    cached = len(first.result.prompt_ids) + len(first.result.output_ids) - 1
    assert fresh.load(str(tmp_path / "talk.json")) == f"{cached} cached tokens resumed"
    turn = fresh.ask("And tomorrow?")
    assert turn.result.reused_tokens == cached  # the first turn is not prefilled again
    context = tmp_path / "talk.json.context"
    context.write_bytes(context.read_bytes()[:-10])  # damaged: the conversation still loads, without its cache
    other = Conversation(engine(path), tokenizer, max_new_tokens=6)
    note = other.load(str(tmp_path / "talk.json"))
    assert note.startswith("its cache was not loaded (") and "truncated" in note
    assert other.messages == fresh.messages[:3] and other.engine.cache is None
    empty = Conversation(engine(path), tokenizer, max_new_tokens=6)  # /save before the first turn, then /load
    empty.save(str(tmp_path / "empty.json"))
    assert empty.load(str(tmp_path / "empty.json")) == "0 cached tokens resumed" and empty.messages == []
    assert len(empty.ask("Hello again.").result.output_ids) == 6
    if Path("/dev/zero").exists():  # endless: refused after 256 MiB, not read until memory runs out
        with pytest.raises(Glm5Error, match="/dev/zero: cannot read a saved conversation \\(more than 256 MiB\\)"):
            empty.load("/dev/zero")


def post(port, body):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())


def test_serve_keeps_its_context_across_restarts(tiny_dir, tmp_path):
    import threading

    from transformers import AutoTokenizer

    from glm5_offload.server import make_server

    path = tiny_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    document = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(120))
    messages = [{"role": "user", "content": document}]
    usages = []
    for _ in range(2):  # a server, stopped, then another one on the same --context-dir
        server = make_server(engine(path, max_seq_len=4096), tokenizer, "tiny", port=0, max_new_tokens=4,
                             context_dir=tmp_path / "ctx")
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        reply = post(server.server_address[1], {"messages": messages, "max_tokens": 4, "temperature": 0})
        usages.append(reply["usage"])
        server.shutdown()
        server.server_close()
    assert usages[0]["prompt_tokens"] >= 1024 and usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == usages[0]["prompt_tokens"] - 1


def test_serve_stopped_by_sigterm_keeps_its_context(tiny_dir, tmp_path):
    """As systemd or docker stop a service: SIGTERM, after which the context is on disk (its cleanup ran); a second
    SIGTERM right after it (`timeout` forwards the one it gets, as `pkill -f "glm5 serve"` sends one to both) does
    not cut the cleanup short."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "glm5_offload.cli", "serve", "--model", str(tiny_dir()), "--port",
                             "0", "--context-dir", str(tmp_path / "ctx")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", proc.stdout.readline()).group(1))
        reply = post(port, {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 3, "temperature": 0})
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    cached = reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"] - 1  # the last token not yet fed
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-2000:]
    assert f"glm5 serve: kept {cached} cached tokens in {tmp_path / 'ctx' / 'context.safetensors'}" in out
    assert (tmp_path / "ctx" / "context.safetensors").is_file()


def test_a_context_dir_that_is_a_file_or_not_writable_is_refused(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    from glm5_offload.server import make_server

    (tmp_path / "afile").write_text("x")
    with pytest.raises(Glm5Error, match="--context-dir .*afile: not a folder"):
        make_server(engine(tiny_dir()), AutoTokenizer.from_pretrained(str(tiny_dir())), "tiny", port=0,
                    context_dir=tmp_path / "afile")
    # a folder no file can be made in, even by root (a read-only folder would not stop root)
    with pytest.raises(Glm5Error, match=r"--context-dir /proc/sys: cannot write there \("):
        make_server(engine(tiny_dir()), AutoTokenizer.from_pretrained(str(tiny_dir())), "tiny", port=0,
                    context_dir="/proc/sys")
