"""A chat conversation over the engine, and `glm5 chat`, its terminal front end.

The model directory's own chat template (through transformers) renders the turns. Each turn sends the
model the tokens it already saw (its prompts and its own replies, as generated) plus the template's
text for what is new, so the engine's cache is reused and a turn prefills only its new tokens.
"""

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import Glm5Error
from .runtime.engine import Engine, GenerationResult, SamplingParams
from .runtime.saved_context import load_context, save_context

THINK_END = "</think>"
ROLES = ("system", "user", "assistant", "tool", "observation")
CONTEXT_SUFFIX = ".context"  # /save FILE writes the cached context beside the conversation, at FILE.context
DIM, RESET = "\x1b[2m", "\x1b[0m"
HELP = """commands:
  /help          this text
  /reset         forget the conversation (and its cache)
  /save FILE     write the conversation as JSON, and its cache to FILE.context
  /load FILE     read a conversation written by /save (and its cache: the next turn is not prefilled again)
  /stats         tokens and speeds so far
  /exit, /quit   end the session (as Ctrl-D)
  Ctrl-C stops a reply and keeps the session; Ctrl-D exits."""


@dataclass
class Turn:
    reasoning: str
    content: str
    result: GenerationResult
    interrupted: bool = False


def apply_template(tokenizer, messages: list[dict], **kwargs) -> str:
    """The model's chat template (through transformers) applied to messages, as text. One that fails (broken, or
    refusing these messages by its own raise_exception) is a Glm5Error of one line."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # jinja2's TemplateError, and whatever the template's own code raises
        why = (str(e).splitlines() or [""])[0]
        raise Glm5Error(f"the chat template failed: {type(e).__name__}: {why}") from None


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    """Generated text -> (reasoning, answer): with thinking on, the reasoning runs up to </think>."""
    if not thinking:
        return "", text
    reasoning, sep, content = text.partition(THINK_END)
    return (reasoning, content.lstrip("\n")) if sep else (text, "")


MAX_CONVERSATION_BYTES = 256 << 20  # a saved conversation of a million-token context is a few MiB


@dataclass
class Conversation:
    engine: Engine
    tokenizer: object
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 1024
    system: str | None = None
    thinking: bool = True
    reasoning_effort: str = "max"
    messages: list[dict] = field(default_factory=list)
    history_ids: list[int] = field(default_factory=list)  # what the model saw: prompts and replies as generated
    rendered: str = ""  # the template's text for `messages`, to find what a new turn adds

    def __post_init__(self):
        if not self.messages and self.system:
            self.messages = [{"role": "system", "content": self.system}]

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return apply_template(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                              enable_thinking=self.thinking, reasoning_effort=self.reasoning_effort)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_for(self, messages: list[dict]) -> list[int]:
        full = self.render(messages, add_generation_prompt=True)
        if self.history_ids and full.startswith(self.rendered):
            return self.history_ids + self.encode(full[len(self.rendered):])
        return self.encode(full)

    def ask(self, user_text: str, on_text=None) -> Turn:
        """One turn: the reply streams to on_text(piece, is_reasoning); Ctrl-C ends it early, kept."""
        messages = self.messages + [{"role": "user", "content": user_text}]
        prompt = self.prompt_for(messages)
        limit = self.engine.max_seq_len
        if len(prompt) + self.max_new_tokens > limit:
            hint = "; /reset starts a new one" if any(m["role"] == "assistant" for m in self.messages) else ""
            raise Glm5Error(f"the conversation would be {len(prompt)} tokens and the reply up to {self.max_new_tokens}: "
                            f"more than the context of {limit} tokens (--max-seq-len){hint}")
        stream = ReplyStream(self.tokenizer, self.engine.stop_ids, self.thinking, on_text)
        shown = []  # the reply's tokens as they came

        def on_token(token_id):
            shown.append(token_id)
            return stream(token_id)

        interrupted = False
        started = time.perf_counter()
        try:
            result = self.engine.generate(prompt, self.max_new_tokens, self.params, on_token=on_token)
            stream.flush()
        except KeyboardInterrupt:  # the reply so far stays in the conversation; the cache keeps what it can
            interrupted = True
            result = GenerationResult(prompt_ids=prompt, output_ids=shown, stop_reason="interrupted",
                                      decode_seconds=time.perf_counter() - started)
        reply = [t for t in result.output_ids if t not in self.engine.stop_ids]
        reasoning, content = split_reasoning(self.tokenizer.decode(reply), self.thinking)
        self.messages = messages + [{"role": "assistant", "content": content, "reasoning_content": reasoning}]
        self.history_ids = prompt + reply
        self.rendered = self.render(self.messages, add_generation_prompt=False)
        return Turn(reasoning, content, result, interrupted)

    def reset(self):
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.history_ids, self.rendered = [], ""
        self.engine.reset()

    def save(self, path: str):
        """The conversation as JSON at path, and the engine's context (its cached rows) at path + .context."""
        try:
            with open(path, "w") as f:
                json.dump({"messages": self.messages, "thinking": self.thinking,
                           "reasoning_effort": self.reasoning_effort, "history_ids": self.history_ids}, f, indent=2)
        except OSError as e:
            raise Glm5Error(f"{path}: cannot write the conversation ({e.strerror})") from None
        save_context(self.engine, path + CONTEXT_SUFFIX)

    def load(self, path: str) -> str:
        """The conversation saved at path, and its cache beside it where this engine can resume it; what became of
        the cache, in words."""
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_CONVERSATION_BYTES + 1)
            if len(raw) > MAX_CONVERSATION_BYTES:  # (/dev/zero: read whole, it would take all memory)
                raise Glm5Error(f"{path}: cannot read a saved conversation (more than "
                                f"{MAX_CONVERSATION_BYTES >> 20} MiB)")
            data = json.loads(raw.decode("utf-8"))
        except OSError as e:
            raise Glm5Error(f"{path}: cannot read a saved conversation ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise Glm5Error(f"{path}: cannot read a saved conversation (not UTF-8 text: byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise Glm5Error(f"{path}: cannot read a saved conversation (not JSON: {e.msg} at line {e.lineno} column "
                            f"{e.colno})") from None
        except RecursionError:
            raise Glm5Error(f"{path}: cannot read a saved conversation (JSON nested too deeply)") from None
        messages = data.get("messages") if isinstance(data, dict) else None
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages):
            raise Glm5Error(f"{path}: 'messages' must be a list of {{role, content}} objects, role one of "
                            f"{', '.join(ROLES)}")
        for i, m in enumerate(messages):
            try:
                m["content"].encode("utf-8")
            except UnicodeEncodeError:  # JSON's \ud800 escapes: text no tokenizer takes
                raise Glm5Error(f"{path}: messages[{i}].content is not valid Unicode (a lone surrogate)") from None
        context = Path(path + CONTEXT_SUFFIX)
        history = data.get("history_ids")
        self.history_ids, self.rendered, self.messages = [], "", messages
        if not context.exists():
            return "no cache beside it: the next turn prefills the conversation"
        try:  # checked whole before the engine takes it: a bad one changes nothing
            n = load_context(self.engine, context)
        except Glm5Error as e:  # another model's, or damaged: the conversation still loads
            return f"its cache was not loaded ({e})"
        held = self.engine.cache_ids
        if isinstance(history, list) and held[: len(history)] == history[: len(held)]:
            self.history_ids = history  # the next turn's prompt extends exactly what the cache holds
            self.rendered = self.render(messages, add_generation_prompt=False) if messages else ""  # (none: "")
        return f"{n} cached tokens resumed"


def partial_suffix(text: str, strings: list[str]) -> int:
    """How many of text's last characters begin one of `strings` without completing it (0 if none): what a stream
    holds back until the next piece says whether the string comes."""
    return max((k for s in strings for k in range(min(len(s) - 1, len(text)), 0, -1)
                if s[k - 1] == text[-1] and text.endswith(s[:k])), default=0)


class ReplyStream:
    """Decodes tokens as they come and hands on whole characters, the reasoning part marked as such."""

    def __init__(self, tokenizer, stop_ids, thinking: bool, on_text):
        self.tokenizer, self.stop_ids, self.on_text = tokenizer, stop_ids, on_text
        self.in_reasoning, self.ids, self.sent, self.strip_newline = thinking, [], 0, False

    def __call__(self, token_id: int):
        if self.on_text is None or token_id in self.stop_ids:
            return
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a character still being spelled out in bytes
            return
        if self.in_reasoning:
            end = text.find(THINK_END)
            if end < 0:  # hold back what may be the start of </think>
                safe = len(text) - partial_suffix(text, [THINK_END])
                if safe > self.sent:
                    self.on_text(text[self.sent : safe], True)
                    self.sent = safe
                return
            if end > self.sent:
                self.on_text(text[self.sent : end], True)
            self.in_reasoning, self.sent, self.strip_newline = False, end + len(THINK_END), True
        self._send(text, False)

    def flush(self):
        """At the reply's end: what was held back (the start of a </think> that never came, a character's first
        bytes), as the whole reply decodes."""
        if self.on_text is not None and self.ids:
            self._send(self.tokenizer.decode(self.ids), self.in_reasoning)

    def _send(self, text: str, reasoning: bool):
        piece, self.sent = text[self.sent :], len(text)
        if self.strip_newline and not reasoning:
            piece = piece.lstrip("\n")
            self.strip_newline = not piece
        if piece:
            self.on_text(piece, reasoning)


MAX_LINE = 64 << 20  # characters of one piped line (as --prompt-file's bytes)


def read_line(prompt: str) -> str:
    """input(), but from a standard input that is not a terminal a line of at most MAX_LINE characters: one without
    an end (/dev/zero) is refused instead of read until memory runs out."""
    if sys.stdin.isatty():
        return input(prompt)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    line = sys.stdin.readline(MAX_LINE + 1)
    if not line:
        raise EOFError
    if len(line) > MAX_LINE:
        raise Glm5Error(f"standard input: a line of more than {MAX_LINE >> 20} Mi characters (chat takes a message a "
                        "line)")
    return line.removesuffix("\n")


def run_chat(conversation: Conversation, banner: str, show_thinking: bool = True, inp=read_line, out=sys.stdout):
    """The read-eval-print loop of `glm5 chat`."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    engine = conversation.engine
    totals = {"turns": 0, "prefilled": 0, "generated": 0}
    print(banner, file=out)
    print("type /help for commands", file=out)

    def show(piece: str, reasoning: bool):
        if reasoning and not show_thinking:
            return
        out.write(f"{DIM}{piece}{RESET}" if reasoning else piece)
        out.flush()

    while True:
        try:
            line = inp("\n> ")
        except EOFError:
            print(file=out)
            return
        except KeyboardInterrupt:
            print(file=out)
            continue
        line = line.strip()
        if not line:
            continue
        try:
            line.encode("utf-8")
        except UnicodeEncodeError as e:  # bytes the terminal could not decode arrive as lone surrogates
            print(f"error: the line is not valid UTF-8 (at character {e.start + 1}); nothing was sent", file=out)
            continue
        if line.startswith("/"):
            command, _, arg = line.partition(" ")
            arg = arg.strip()
            try:
                if command == "/help":
                    print(HELP, file=out)
                elif command in ("/exit", "/quit"):
                    return
                elif command in ("/save", "/load") and not arg:
                    print(f"{command} needs a FILE: {command} FILE", file=out)
                elif command == "/reset":
                    conversation.reset()
                    print("conversation cleared", file=out)
                elif command == "/save" and arg:
                    conversation.save(arg)
                    print(f"saved {len(conversation.messages)} messages to {arg}", file=out)
                elif command == "/load" and arg:
                    note = conversation.load(arg)
                    print(f"loaded {len(conversation.messages)} messages from {arg}; {note}", file=out)
                elif command == "/stats":
                    print(f"turns {totals['turns']}, prefilled {totals['prefilled']} tokens, generated "
                          f"{totals['generated']} tokens, context {len(engine.cache_ids)} of {engine.max_seq_len}",
                          file=out)
                else:
                    print(f"unknown command {line!r}; /help lists them", file=out)
            except Glm5Error as e:
                print(f"error: {e}", file=out)
            continue
        try:
            turn = conversation.ask(line, on_text=show)
        except Glm5Error as e:
            print(f"\nerror: {e}", file=out)
            continue
        r = turn.result
        totals["turns"] += 1
        totals["prefilled"] += r.prefilled_tokens
        totals["generated"] += len(r.output_ids)
        note = " [interrupted]" if turn.interrupted else ""
        print(f"{RESET}{note}\n[prefill {r.prefilled_tokens} tok at {r.prefill_tokens_per_s:.1f} tok/s · decode "
              f"{len(r.output_ids)} tok at {r.decode_tokens_per_s:.1f} tok/s · context {len(engine.cache_ids)}"
              f"/{engine.max_seq_len}]", file=out)
