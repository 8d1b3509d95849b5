"""`glm5 serve`: an OpenAI-compatible endpoint over the one engine.

POST /v1/chat/completions (plain JSON, or server-sent events with "stream": true), GET /v1/models,
GET /health. Requests queue on a lock and run one at a time; the engine's cache carries over, so a
request that extends the previous conversation prefills only what is new. A client that goes away (a stream, or a
plain request whose client timed out) stops its generation at the next token; one that left while queued is never
run. Text only: fields that would change the reply and are not implemented (tools, JSON mode, log probabilities,
penalties) are refused, never dropped. Errors are JSON with the OpenAI error shape, for every method and route; a
body over MAX_BODY bytes, or one that does not arrive within TIMEOUT seconds, is refused.
"""

import ipaddress
import json
import math
import select
import socket
import threading
import time
import traceback
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .chat import ROLES, ReplyStream, apply_template, partial_suffix, split_reasoning
from .errors import Glm5Error, ModelError
from .runtime.engine import Engine, SamplingParams
from .runtime.saved_context import load_context, save_context
from .util import check_writable

MAX_BODY = 16 << 20  # bytes of a request body
TIMEOUT = 30  # seconds a connection may take to send what it announced
CONTEXT_FILE = "context.safetensors"  # in --context-dir: the engine's context, kept across restarts
SAVE_AFTER = 1024  # a request that prefilled this many tokens or more has its context written to --context-dir


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def _number(body, name, kind, default, low=None, high=None, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = (isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
          and math.isfinite(value))
    if not ok or (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        bounds = f" in {'(' if low_open else '['}{low}, {high}]" if low is not None and high is not None else (
            f" >= {low}" if low is not None else "")
        raise RequestError(400, f"'{name}' must be {'a number' if kind is float else 'an integer'}{bounds}, got {value!r}",
                           name)
    return value


# Request fields that would change the reply: whether a value is one this server honours (the field's default, as
# clients send it) and, for any other, what the refusal says this server does not do.
UNSUPPORTED = {
    "tools": (lambda v: v == [], "calls no tools (the model would answer without them)"),
    "functions": (lambda v: v == [], "calls no tools (the model would answer without them)"),
    "tool_choice": (lambda v: v in ("none", "auto"), "calls no tools"),
    "response_format": (lambda v: isinstance(v, dict) and v.get("type") == "text",
                        "does not constrain the reply to JSON (only {'type': 'text'})"),
    "logprobs": (lambda v: v is False, "returns no log probabilities"),
    "top_logprobs": (lambda v: v == 0, "returns no log probabilities"),
    "frequency_penalty": (lambda v: v == 0, "applies no penalties (0 only)"),
    "presence_penalty": (lambda v: v == 0, "applies no penalties (0 only)"),
    "logit_bias": (lambda v: v == {}, "applies no logit bias"),
}


CONTENT = "'content': a string or a list of text parts"


def _text_content(m, i: int) -> str:
    """messages[i]'s text: its string content, or its text parts joined by newlines; anything else refused."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise RequestError(400, f"{where} must be an object with 'role' ({', '.join(ROLES)}) and {CONTENT}", where)
    if m.get("tool_calls"):
        raise RequestError(400, f"{where}.tool_calls is not supported: this server calls no tools", where)
    content = m.get("content")
    if isinstance(content, list) and content:
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': str}}"
                                        + (f": '{kind}' parts are not supported (text only)"
                                           if isinstance(kind, str) and kind != "text" else ""), where)
        content = "\n".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise RequestError(400, f"{where} must be an object with 'role' ({', '.join(ROLES)}) and {CONTENT}", where)
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(400, f"{where}.content is not valid Unicode (a lone surrogate)", where) from None
    return content


def parse_request(body, default_max_tokens: int, defaults: SamplingParams = SamplingParams(),
                  model_id: str | None = None):
    """The chat completion request's fields, checked; RequestError names the field at fault."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    if body.get("model") is not None and body["model"] != model_id:
        raise RequestError(404, f"the model {body['model']!r} does not exist; this server has {model_id!r}", "model",
                           "model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    for name, (honoured, what) in UNSUPPORTED.items():
        if body.get(name) is not None and not honoured(body[name]):
            raise RequestError(400, f"'{name}' is not supported: this server {what}", name)
    messages = [{**m, "content": _text_content(m, i)} for i, m in enumerate(messages)]
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
                             or len(stop) > 4):
        raise RequestError(400, "'stop' must be a string or a list of up to 4 non-empty strings", "stop")
    if not isinstance(body.get("stream", False), bool):
        raise RequestError(400, "'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict)
                                or not isinstance(options.get("include_usage", False), bool)):
        raise RequestError(400, "'stream_options' must be an object, its 'include_usage' a boolean", "stream_options")
    if body.get("n", 1) != 1:
        raise RequestError(400, "'n' must be 1", "n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", int, default_max_tokens, low=1)
    params = SamplingParams(
        temperature=_number(body, "temperature", float, defaults.temperature, 0, 2),
        top_p=_number(body, "top_p", float, defaults.top_p, 0, 1, low_open=True),
        top_k=_number(body, "top_k", int, defaults.top_k, 0),  # vLLM's and llama.cpp's extension
        seed=_number(body, "seed", int, defaults.seed, -(2**63), 2**63 - 1),
    )
    return messages, params, max_tokens, stop or [], body.get("stream", False), template_kwargs(body)


EFFORTS = ("max", "high")  # GLM-5's chat template's reasoning_effort


def template_kwargs(body: dict) -> dict:
    """The chat template's enable_thinking (default true) and reasoning_effort (where asked) from the request's own
    fields or from `chat_template_kwargs` (vLLM's and SGLang's way to pass them): any other template kwarg is
    refused, never dropped, and so are the two places disagreeing."""
    extra = body.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise RequestError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
    extra = extra or {}
    unknown = sorted(set(extra) - {"enable_thinking", "reasoning_effort"})
    if unknown:
        raise RequestError(400, f"'chat_template_kwargs.{unknown[0]}' is not supported (enable_thinking and "
                                f"reasoning_effort are)", "chat_template_kwargs")
    kwargs = {}
    for name, ok, what in (("enable_thinking", lambda v: isinstance(v, bool), "a boolean"),
                           ("reasoning_effort", lambda v: v in EFFORTS, f"one of {', '.join(EFFORTS)}")):
        given = {place: v for place, v in ((name, body.get(name)), (f"chat_template_kwargs.{name}", extra.get(name)))
                 if v is not None}
        for place, v in given.items():
            if not ok(v):
                raise RequestError(400, f"'{place}' must be {what}, got {v!r}", place.split(".")[0])
        if len(set(map(repr, given.values()))) > 1:
            raise RequestError(400, f"'{name}' and 'chat_template_kwargs.{name}' disagree", name)
        if given:
            kwargs[name] = next(iter(given.values()))
    return {"enable_thinking": True, **kwargs}


def error_status(e: Glm5Error) -> int:
    """A request's failure as an HTTP status: the model's own (ModelError) 500, the request's (its messages the
    chat template refused) 400."""
    return 500 if isinstance(e, ModelError) else 400


def error_body(status: int, message: str, param=None, code=None) -> dict:
    """OpenAI's error object: a request's fault below 500, the server's from 500."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Service:
    """The engine behind the endpoint, one request at a time."""

    def __init__(self, engine: Engine, tokenizer, model_id: str, max_new_tokens: int, defaults: SamplingParams,
                 context_file: Path | None = None):
        """context_file: where the engine's context is kept across restarts (--context-dir)."""
        self.engine, self.tokenizer, self.model_id = engine, tokenizer, model_id
        self.max_new_tokens, self.defaults = max_new_tokens, defaults
        self.lock = threading.Lock()
        self.last = None  # the last request's GenerationResult
        self.context_file = context_file

    def keep_context(self, result) -> None:
        """After a request that prefilled at least SAVE_AFTER tokens (a long document, not a short follow-up), the
        context goes to disk; a later start resumes the prefix a request shares with it."""
        if self.context_file is not None and result.prefilled_tokens >= SAVE_AFTER:
            save_context(self.engine, self.context_file)

    def prompt(self, messages, template: dict) -> list[int]:
        text = apply_template(self.tokenizer, messages, add_generation_prompt=True, **template)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def complete(self, body, emit=None, gone=lambda: False) -> dict:
        """Run one request; emit(kind, text) gets the reply as it streams, and its return True stops it; gone()
        says the client has left (checked when the request's turn comes and after each token: a client that timed
        out does not hold the engine for the rest of its reply)."""
        messages, params, max_tokens, stop, _, template = parse_request(body, self.max_new_tokens, self.defaults,
                                                                        self.model_id)
        prompt, thinking = self.prompt(messages, template), template["enable_thinking"]
        limit = self.engine.max_seq_len
        if len(prompt) + max_tokens > limit:
            raise RequestError(400, f"the prompt has {len(prompt)} tokens and max_tokens is {max_tokens}: more than "
                                    f"the context limit of {limit} tokens", "messages", "context_length_exceeded")
        state = {"text": "", "sent": 0, "stopped": False, "gone": False}  # sent: characters of text emitted

        def send_content(upto: int):
            piece, state["sent"] = state["text"][state["sent"] : upto], upto
            if piece and emit is not None and emit("content", piece):
                state["gone"] = True

        def on_text(piece: str, reasoning: bool):
            if state["stopped"]:  # what the stream flushes after a stop string is past the reply's end
                return
            if reasoning:
                if emit is not None and emit("reasoning_content", piece):
                    state["gone"] = True
                return
            state["text"] += piece
            cut = min((i for i in (state["text"].find(s) for s in stop) if i >= 0), default=-1)
            if cut >= 0:  # a stop string: keep the text before it, end here
                state["text"], state["stopped"] = state["text"][:cut], True
                send_content(cut)
            else:  # what may be a stop string's start waits for the next piece
                send_content(len(state["text"]) - partial_suffix(state["text"], stop))

        stream = ReplyStream(self.tokenizer, self.engine.stop_ids, thinking, on_text)

        def on_token(token_id):
            stream(token_id)
            state["gone"] = state["gone"] or gone()
            return state["stopped"] or state["gone"]

        with self.lock:
            if gone():
                raise RequestError(499, "the client closed its connection before its request ran")
            try:
                result = self.last = self.engine.generate(prompt, max_tokens, params, on_token=on_token)
                stream.flush()
            except Glm5Error:  # (said as it is; Ctrl-C is no Exception)
                raise
            except Exception as e:  # a defect: the client gets a 500 (not a dropped connection), the log its trace
                traceback.print_exc()
                raise ModelError(f"internal error ({type(e).__name__}: {e}); the traceback is in the server's "
                                 "log") from None
            send_content(len(state["text"]))  # a stop string's start that never finished
            self.keep_context(result)
        reply = [t for t in result.output_ids if t not in self.engine.stop_ids]
        reasoning, content = split_reasoning(self.tokenizer.decode(reply), thinking)
        if state["stopped"]:
            content = state["text"]
        finish = "length" if result.stop_reason == "length" else "stop"
        message = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_id,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(result.output_ids),
                      "total_tokens": len(prompt) + len(result.output_ids),
                      "prompt_tokens_details": {"cached_tokens": result.reused_tokens}},
        }


class Handler(BaseHTTPRequestHandler):
    service: Service  # set on the subclass serve() makes
    protocol_version = "HTTP/1.1"
    timeout = TIMEOUT  # on the connection's socket: a body that never comes does not hold a thread

    def log_message(self, fmt, *args):  # one line per request on stderr, as http.server does, minus noise
        pass

    def _json(self, status: int, payload: dict):
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client has gone: nobody to answer
            self.close_connection = True

    def _client_gone(self) -> bool:
        """The client has closed its connection: readable, with nothing to read (a pipelined request is data)."""
        try:
            return bool(select.select([self.connection], [], [], 0)[0]) and not self.connection.recv(1, socket.MSG_PEEK)
        except OSError:
            return True

    def _error(self, status: int, message: str, param=None, code=None):
        self._json(status, error_body(status, message, param, code))

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (an unknown method, a header line too long, ...) as JSON errors too."""
        self.close_connection = True
        self._error(code, message or HTTPStatus(code).phrase)

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": self.service.model_id, "object": "model", "created": 0, "owned_by": "glm5-offload"}]})
        else:
            self._error(404, f"no route GET {self.path}")

    def _not_allowed(self):
        self._error(405, f"method {self.command} is not allowed (GET /health, GET /v1/models, "
                         "POST /v1/chat/completions)")

    do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    def do_POST(self):
        if self.path != "/v1/chat/completions":
            self._error(404, f"no route POST {self.path}")
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self.close_connection = True
            self._error(413 if length > MAX_BODY else 400,
                        f"Content-Length must be a number of bytes from 0 to {MAX_BODY}, got {self.headers.get('Content-Length')!r}")
            return
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            self._error(408, f"the request body did not arrive within {TIMEOUT} s")
            return
        if len(raw) < length:  # the client closed the connection before its body ended: nobody to answer
            self.close_connection = True
            return
        try:
            body = json.loads(raw or b"null")
        except (ValueError, UnicodeDecodeError, RecursionError):
            self._error(400, "the request body is not valid JSON")
            return
        try:
            if isinstance(body, dict) and body.get("stream") is True:
                self._stream(body)
            else:
                self._json(200, self.service.complete(body, gone=self._client_gone))
        except RequestError as e:
            self._error(e.status, str(e), e.param, e.code)
        except Glm5Error as e:
            self._error(error_status(e), str(e))

    def _stream(self, body):
        parse_request(body, self.service.max_new_tokens, self.service.defaults,
                      self.service.model_id)  # bad requests get a JSON error, not a stream
        chunk_id, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        started = False

        def send(payload) -> bool:
            """One event; True when the client has gone (generation then stops)."""
            nonlocal started
            try:
                if not started:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    started = True
                data = payload if isinstance(payload, str) else json.dumps(payload)
                self.wfile.write(f"data: {data}\n\n".encode())
                self.wfile.flush()
                return False
            except (BrokenPipeError, ConnectionResetError):
                return True

        def chunk(delta, finish=None, usage=None):
            payload = {"id": chunk_id, "object": "chat.completion.chunk", "created": created,
                       "model": self.service.model_id,
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if usage is not None:
                payload["usage"], payload["choices"] = usage, []
            return send(payload)

        first = {"sent": False}

        def emit(kind, text):
            if not first["sent"]:
                first["sent"] = True
                if chunk({"role": "assistant", "content": ""}):
                    return True
            return chunk({kind: text})

        try:
            result = self.service.complete(body, emit, self._client_gone)
        except Glm5Error as e:
            if not started:  # nothing sent yet: a JSON error of its own (do_POST's)
                raise
            send(error_body(error_status(e), str(e)))  # the stream ends with it
            send("[DONE]")
            self.close_connection = True
            return
        if not first["sent"]:
            chunk({"role": "assistant", "content": ""})
        chunk({}, finish=result["choices"][0]["finish_reason"])
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk({}, usage=result["usage"])
        send("[DONE]")
        self.close_connection = True


def make_server(engine: Engine, tokenizer, model_id: str, host: str = "127.0.0.1", port: int = 8000,
                max_new_tokens: int = 2048, defaults: SamplingParams = SamplingParams(temperature=1.0, top_p=0.95),
                context_dir: Path | None = None) -> ThreadingHTTPServer:
    """defaults: the sampling a request gets for the fields it leaves out; context_dir: where the context is kept
    across restarts (resumed here if one of this model is there; one that does not match is said and left)."""
    context_file = None
    if context_dir is not None:
        context_file = Path(context_dir) / CONTEXT_FILE
        if Path(context_dir).exists() and not Path(context_dir).is_dir():
            raise Glm5Error(f"--context-dir {context_dir}: not a folder")
        try:
            Path(context_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise Glm5Error(f"--context-dir {context_dir}: cannot make it ({e.strerror})") from None
        check_writable(context_dir, f"--context-dir {context_dir}: cannot write there")
        if context_file.exists():
            try:
                n = load_context(engine, context_file)
                print(f"glm5 serve: resumed {n} cached tokens from {context_file}", flush=True)
            except Glm5Error as e:
                print(f"glm5 serve: not resuming: {e}", flush=True)
    service = Service(engine, tokenizer, model_id, max_new_tokens, defaults, context_file)
    handler = type("BoundHandler", (Handler,), {"service": service})
    ipv6 = ":" in host  # an IPv6 address (::1, ::): http.server's class listens on IPv4 only
    server_class = type("Server6", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6}) if ipv6 else \
        ThreadingHTTPServer
    try:
        server = server_class((host, port), handler)
    except OSError as e:
        raise Glm5Error(f"cannot listen on {host}:{port} ({e.strerror})") from None
    server.daemon_threads = True
    return server


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may stand for any address
        return False


def serve(engine: Engine, tokenizer, model_id: str, host: str, port: int, max_new_tokens: int,
          defaults: SamplingParams, random_weights: bool, context_dir: Path | None = None):
    server = make_server(engine, tokenizer, model_id, host, port, max_new_tokens, defaults, context_dir)
    note = " (the embedded tiny model: random weights)" if random_weights else ""
    where = f"[{host}]" if server.address_family == socket.AF_INET6 else host
    print(f"glm5 serve: {model_id}{note} on http://{where}:{server.server_address[1]}/v1 "
          "(POST /v1/chat/completions, GET /v1/models, GET /health); Ctrl-C stops", flush=True)
    if not is_loopback(host):
        print(f"glm5 serve: warning: {host} is not loopback only: whoever can reach this machine on port "
              f"{server.server_address[1]} can use the model (no API key is checked)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        service = server.RequestHandlerClass.service
        if service.context_file is not None and engine.cache is not None and engine.cache.length:
            with service.lock:
                n = save_context(engine, service.context_file)
            print(f"glm5 serve: kept {n} cached tokens in {service.context_file}", flush=True)
