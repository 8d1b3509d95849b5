"""glm5 chat driven through a pseudo-terminal, as a person would use it."""

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glm5_offload.chat import ReplyStream

from conftest import cli_env

STATS = re.compile(r"\[prefill (\d+) tok at [\d.]+ tok/s · decode (\d+) tok at [\d.]+ tok/s · context (\d+)/(\d+)\]")


class Terminal:
    """A child process on a pty: type into it, wait for what it prints."""
    started: list["Terminal"] = []  # killed when the test ends (no_chat_left)

    def __init__(self, *args, env=None):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: Ctrl-C as at a shell's prompt, even where this suite runs with it ignored
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # (a background job of a non-interactive shell)
            os.execvpe(sys.executable, [sys.executable, "-m", "glm5_offload.cli", *map(str, args)],
                       cli_env({**(env or {}), "TERM": "dumb"}))
        self.output = ""
        Terminal.started.append(self)

    def expect(self, pattern, timeout=120.0):
        """Read until pattern matches the output after what was already consumed; return the match."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.output)
            if match:
                self.output = self.output[match.end():]
                return match
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {pattern!r}; output so far:\n{self.output[-2000:]}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:
                    data = b""
                if not data:
                    raise AssertionError(f"the chat exited while waiting for {pattern!r}:\n{self.output[-2000:]}")
                self.output += data.decode(errors="replace")

    def send(self, text: str):
        os.write(self.fd, text.encode())

    def quit(self) -> int:
        """At the prompt, Ctrl-D; the exit code."""
        self.expect(r"\n> ")
        self.send("\x04")
        return self.wait()

    def wait(self, timeout=60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                Terminal.started.remove(self)  # reaped: its pid may be another process's by the test's end
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            if select.select([self.fd], [], [], 0.1)[0]:
                try:
                    self.output += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:  # the child closed its side of the terminal
                    time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError("the chat did not exit")


@pytest.fixture(autouse=True)
def no_chat_left():
    """A test that fails mid-reply leaves its chat generating (3000 tokens: a core for the rest of the suite)."""
    yield
    while Terminal.started:
        term = Terminal.started.pop()
        os.kill(term.pid, signal.SIGKILL)
        os.waitpid(term.pid, 0)
        os.close(term.fd)


def suffix_tokens(tiny_dir, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    return len(tok.encode(f"<|user|>\n{text}<|assistant|>\n<think>", add_special_tokens=False))


def test_two_turns_save_and_load(tiny_dir, tmp_path):
    path = tiny_dir()
    term = Terminal("chat", "--model", path, "--temperature", 0, "--max-new-tokens", 8, "--system", "Be brief.")
    term.expect(r"glm5 chat: .*thinking max")
    term.expect(r"\n> ")
    term.send("Hello there\r")
    term.expect("\x1b\\[2m")  # thinking is on: its text comes dimmed
    first = term.expect(STATS)
    term.expect(r"\n> ")
    term.send("And again\r")
    second = term.expect(STATS)
    assert int(first.group(1)) > 10  # system + first message, all new
    new = suffix_tokens(path, "And again")
    assert int(second.group(1)) in (new, new + 1)  # + the last reply token, which was sampled but never run
    assert int(second.group(3)) > int(first.group(3))
    term.expect(r"\n> ")
    saved = tmp_path / "conversation.json"
    term.send(f"/save {saved}\r")
    term.expect(r"saved 5 messages")
    messages = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[3]["content"] == "And again"
    term.send("/reset\r")
    term.expect("conversation cleared")
    term.send(f"/load {saved}\r")
    term.expect(r"loaded 5 messages")
    term.send("/stats\r")
    term.expect(r"turns 2, prefilled \d+ tokens, generated \d+ tokens")
    term.send("/load /nonexistent.json\r")
    term.expect(r"error: /nonexistent.json: cannot read a saved conversation \(No such file or directory\)\r?\n")
    assert term.quit() == 0


def test_flash_second_turn_continues_the_kda_state(tmp_path):
    """GLM-5.3-Flash (make-tiny --arch glm5_next, its default rules on the CPU): the second turn extends the cached
    conversation, so its KDA states go on from where the first turn left them: only the new message is prefilled."""
    from glm5_offload.tiny import make_tiny

    path = make_tiny(tmp_path / "flash", arch="glm5_next")
    term = Terminal("chat", "--model", path, "--temperature", 0, "--max-new-tokens", 8, "--system", "Be brief.")
    term.expect(r"\n> ")
    term.send("Hello there\r")
    first = term.expect(STATS)
    term.expect(r"\n> ")
    term.send("And again\r")
    second = term.expect(STATS)
    new = suffix_tokens(path, "And again")
    assert int(first.group(1)) > 10 and int(second.group(1)) in (new, new + 1)
    assert term.quit() == 0


def test_ctrl_c_in_a_flash_reply_keeps_what_was_shown(tiny_dir):
    """Ctrl-C inside a pass of a GLM-5.3-Flash reply: the KDA states go back to the resume point (the cache holds
    less than the conversation), the reply shown so far stays in the conversation, and the next turn runs on it."""
    from transformers import AutoTokenizer

    from glm5_offload.chat import Conversation
    from glm5_offload.loader import load_model
    from glm5_offload.model.kda import KDA
    from glm5_offload.runtime.engine import Engine, SamplingParams

    path = tiny_dir("glm5_next")
    model, tokenizer = load_model(path), AutoTokenizer.from_pretrained(str(path))

    engine = Engine(model, max_seq_len=512, cuda_graphs=False)
    engine.stop_ids = set()
    chat = Conversation(engine, tokenizer, SamplingParams(temperature=0), max_new_tokens=24, thinking=False)
    shown = []

    def cut(module, args):  # Ctrl-C inside a decode step's pass, in its second KDA layer, once two pieces are shown
        if len(shown) >= 2:
            raise KeyboardInterrupt

    hook = [m for m in model.modules() if isinstance(m, KDA)][1].register_forward_pre_hook(cut)
    try:
        turn = chat.ask("Tell me a story", on_text=lambda piece, reasoning: shown.append(piece))
    finally:
        hook.remove()
    assert turn.interrupted and turn.content == "".join(shown).lstrip("\n") and len(shown) == 2
    said = turn.result.prompt_ids + turn.result.output_ids
    assert chat.history_ids == said and len(engine.cache_ids) < len(turn.result.prompt_ids)  # at the resume point
    second = chat.ask("Go on").result  # (that it decodes a fresh engine's tokens: test_glm5_next's cut passes)
    assert second.prompt_ids[: len(said)] == said and len(second.output_ids) == 24


def test_ctrl_c_stops_the_reply_and_keeps_the_session(tiny_dir):
    term = Terminal("chat", "--model", tiny_dir(), "--temperature", 0, "--max-new-tokens", 3000, "--ignore-eos",
                    "--no-think")
    term.expect(r"\n> ")
    term.send("Tell me a long story\r")
    term.expect(r"long story\r?\n[^\[]{12}")  # the reply is streaming (3000 tokens take far longer)
    term.send("\x03")  # Ctrl-C
    stats = term.expect(r"\[interrupted\]\r?\n" + STATS.pattern)
    assert 0 < int(stats.group(2)) < 3000
    term.expect(r"\n> ")
    term.send("/stats\r")
    term.expect(r"turns 1,")
    assert term.quit() == 0


def test_hide_think_shows_no_thinking(tiny_dir):
    term = Terminal("chat", "--model", tiny_dir(), "--temperature", 0, "--max-new-tokens", 6, "--hide-think")
    term.expect(r"\n> ")
    term.send("Hi\r")
    reply = term.expect(r"Hi\r?\n((?s:.)*?)\[prefill")
    assert "\x1b[2m" not in reply.group(1)  # the random model never closes </think>: nothing is shown
    assert term.quit() == 0


def test_no_think_turns_thinking_off(tiny_dir):
    term = Terminal("chat", "--model", tiny_dir(), "--temperature", 0, "--max-new-tokens", 4, "--no-think")
    term.expect(r"thinking off")
    term.expect(r"\n> ")
    term.send("Hi\r")
    term.expect(STATS)
    assert term.quit() == 0


def test_bad_save_and_load_keep_the_session(tiny_dir, tmp_path):
    """/save where it cannot write, /load of a file that is not UTF-8, not JSON, nested past Python's stack, names an
    unknown role or holds a lone surrogate: one error line each, in our words, and the conversation goes on."""
    (tmp_path / "latin1.json").write_bytes(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}')
    (tmp_path / "role.json").write_text(json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}))
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)  # nested past Python's stack
    (tmp_path / "notjson.json").write_text('{"messages": }')
    (tmp_path / "surrogate.json").write_text('{"messages": [{"role": "user", "content": "hi"}, '
                                             '{"role": "assistant", "content": "x \\ud800"}]}')
    term = Terminal("chat", "--model", tiny_dir(), "--temperature", 0, "--max-new-tokens", 3, "--no-think")
    term.expect(r"\n> ")
    term.send("Hi\r")
    term.expect(STATS)
    for command, error in ((f"/save {tmp_path}/no/such/dir/x.json", r"cannot write the conversation"),
                           (f"/save {tmp_path}", r"cannot write the conversation \(Is a directory\)"),
                           (f"/load {tmp_path}/latin1.json", r"cannot read a saved conversation \(not UTF-8 text: "
                                                              r"byte 46\)"),
                           (f"/load {tmp_path}/notjson.json", r"cannot read a saved conversation \(not JSON: "
                                                               r"Expecting value at line 1 column 14\)"),
                           (f"/load {tmp_path}/deep.json", r"cannot read a saved conversation \(JSON nested too "
                                                            r"deeply\)"),
                           (f"/load {tmp_path}/role.json", r"role one of system, user, assistant"),
                           (f"/load {tmp_path}/surrogate.json", r"messages\[1\]\.content is not valid Unicode")):
        term.expect(r"\n> ")
        term.send(command + "\r")
        term.expect(r"error: .*" + error)
    term.expect(r"\n> ")
    term.send("/stats\r")
    term.expect(r"turns 1,")
    assert term.quit() == 0


def test_a_turn_the_chat_template_refuses_keeps_the_session(tiny_dir, tmp_path):
    """A template's own raise_exception for one turn's messages: one error line, the conversation as it was."""
    import shutil

    path = shutil.copytree(tiny_dir(), tmp_path / "ckpt")
    template = path / "chat_template.jinja"
    template.write_text("{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no boom') }}"
                        "{% endif %}{% endfor %}" + template.read_text())
    done = subprocess.run([sys.executable, "-m", "glm5_offload.cli", "chat", "--model", str(path), "--temperature",
                           "0", "--max-new-tokens", "3", "--no-think"], input=b"boom\nHi\n/stats\n/quit\n",
                          capture_output=True, env=cli_env({}), timeout=300)
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert "error: the chat template failed: TemplateError: no boom" in out and "turns 1," in out


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_a_piped_line_without_an_end_is_refused(tiny_dir):
    """Standard input that never ends its line (/dev/zero): one error line and exit 2 once a line passes 64 Mi
    characters, not a read until memory runs out."""
    with open("/dev/zero", "rb") as zero:
        done = subprocess.run([sys.executable, "-m", "glm5_offload.cli", "chat", "--model", str(tiny_dir())],
                              stdin=zero, capture_output=True, env=cli_env({}), timeout=300)
    errors = [line for line in done.stderr.decode().splitlines() if line.startswith("glm5: error:")]
    assert done.returncode == 2 and errors == ["glm5: error: standard input: a line of more than 64 Mi characters "
                                               "(chat takes a message a line)"]


def test_piped_lines_that_are_not_utf8_or_beyond_the_context(tiny_dir):
    """Input from a pipe (no terminal, no readline), one session: a line that is not UTF-8 gets one error line; a turn
    beyond --max-seq-len says so and that /reset starts a new conversation; after /reset the chat goes on; /save
    without a file says what it needs; /quit ends the session (the line after it is not read as a turn)."""
    done = subprocess.run([sys.executable, "-m", "glm5_offload.cli", "chat", "--model", str(tiny_dir()),
                           "--temperature", "0", "--max-new-tokens", "8", "--no-think", "--max-seq-len", "60"],
                          input=b"caf\xe9 au lait\nHi\n" + b"the quick brown fox " * 12
                          + b"\n/reset\nHi\n/stats\n/save\n/quit\nnever read\n",
                          capture_output=True, env=cli_env({}), timeout=300)
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert "error: the line is not valid UTF-8 (at character 4); nothing was sent" in out
    assert re.search(r"error: the conversation would be \d+ tokens and the reply up to 8: more than the context of 60 "
                     r"tokens \(--max-seq-len\); /reset starts a new one", out), out
    # the turn before /reset and the one after; none for the line after /quit (it ended the session)
    assert len(STATS.findall(out)) == 2 and "turns 2," in out
    assert "/save needs a FILE: /save FILE" in out


def test_reasoning_streams_without_waiting_on_a_think_end_that_is_not_starting():
    """ReplyStream hands on each reasoning piece as it decodes, holding back only text that may begin </think> (a
    reasoning stream used to trail by seven characters); </think> split over tokens still ends the reasoning."""
    pieces = ["Let", " me", " think", " a<", "/", "th", "ink>", "\n", "Yes", " </b>"]

    class Tokenizer:
        def decode(self, ids):
            return "".join(pieces[i] for i in ids)

    shown = []
    stream = ReplyStream(Tokenizer(), stop_ids=set(), thinking=True,
                         on_text=lambda text, reasoning: shown.append((text, reasoning)))
    seen = []
    for i in range(len(pieces)):
        stream(i)
        seen.append("".join(text for text, _ in shown))
    stream.flush()
    assert seen[:3] == ["Let", "Let me", "Let me think"]  # at once: nothing there could begin </think>
    assert seen[3:6] == ["Let me think a"] * 3  # "<", "</", "</th" wait
    assert shown[-2:] == [("Yes", False), (" </b>", False)]  # the reply, its newline after </think> dropped
    assert "".join(t for t, r in shown if r) == "Let me think a" and "".join(t for t, r in shown if not r) == "Yes </b>"
