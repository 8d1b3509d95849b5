"""glm5 serve through the official openai client: plain and streamed, queueing, prefix reuse, errors."""

import itertools
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from glm5_offload.loader import load_model
from glm5_offload.runtime.engine import Engine
from glm5_offload.server import make_server, parse_request

openai = pytest.importorskip("openai")  # a test dependency; absent on the GPU machine


@pytest.fixture(scope="module")
def server(tiny_dir):
    from transformers import AutoTokenizer

    path = tiny_dir()
    engine = Engine(load_model(path), max_seq_len=4096)
    engine.stop_ids = set()  # replies run to max_tokens: lengths are known
    srv = make_server(engine, AutoTokenizer.from_pretrained(str(path)), "tiny-glm5", "127.0.0.1", 0, max_new_tokens=16)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="unused", max_retries=0)


HELLO = [{"role": "user", "content": "Hello! How are you?"}]
NO_THINK = {"enable_thinking": False}


def test_an_ipv6_address_and_which_addresses_are_loopback(server):
    """--host ::1 listens on IPv6 (http.server's class is IPv4 only); serve warns where the address is not
    loopback (no API key is checked)."""
    from glm5_offload.server import is_loopback

    assert all(map(is_loopback, ("127.0.0.1", "127.0.0.2", "::1", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "192.168.1.5", "example.org")))
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here ({e.strerror})")
    service = server.RequestHandlerClass.service
    six = make_server(service.engine, service.tokenizer, "tiny-glm5", "::1", 0)
    thread = threading.Thread(target=six.serve_forever, daemon=True)
    thread.start()
    try:
        with urllib.request.urlopen(f"http://[::1]:{six.server_address[1]}/health", timeout=30) as r:
            assert json.load(r) == {"status": "ok"}
    finally:
        six.shutdown()
        six.server_close()


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-glm5"]
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/health") as r:
        assert json.load(r) == {"status": "ok"}


def test_plain_completion(client, server):
    r = client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=9, temperature=0,
                                       extra_body=NO_THINK)
    prompt = server.RequestHandlerClass.service.prompt(HELLO, {"enable_thinking": False})
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 9
    assert r.usage.total_tokens == len(prompt) + 9 and isinstance(r.choices[0].message.content, str)


def test_streaming_equals_plain(client):
    plain = client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=10, temperature=0,
                                           extra_body=NO_THINK)
    chunks = list(client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=NO_THINK))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_thinking_goes_to_reasoning_content(client):
    r = client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=8, temperature=0)
    message = r.choices[0].message.model_dump()
    assert message.get("reasoning_content")  # a random model never closes </think>: it is all reasoning


def test_thinking_and_effort_reach_the_chat_template(client, monkeypatch):
    """enable_thinking and reasoning_effort, as the request's own fields or in chat_template_kwargs (vLLM's and
    SGLang's way): what the template is rendered with, and thinking off gives no reasoning_content."""
    from glm5_offload import server as server_module

    seen, render = [], server_module.apply_template
    monkeypatch.setattr(server_module, "apply_template", lambda t, m, **kw: seen.append(kw) or render(t, m, **kw))
    for extra, template in (({}, {"enable_thinking": True}),
                            ({"reasoning_effort": "high"}, {"enable_thinking": True, "reasoning_effort": "high"}),
                            ({"chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "max"}},
                             {"enable_thinking": False, "reasoning_effort": "max"}),
                            ({"enable_thinking": False, "chat_template_kwargs": {"enable_thinking": False}},
                             {"enable_thinking": False})):
        seen.clear()
        r = client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=4, temperature=0,
                                           extra_body=extra)
        assert seen == [{"add_generation_prompt": True, **template}]
        assert bool(r.choices[0].message.model_dump().get("reasoning_content")) == template["enable_thinking"]


def test_stop_string_and_seed(client):
    base = client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=16, temperature=1.0, seed=3,
                                          extra_body=NO_THINK).choices[0].message.content
    again = client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=16, temperature=1.0, seed=3,
                                           extra_body=NO_THINK).choices[0].message.content
    assert base == again and len(base) > 4
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    cut = client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=16, temperature=1.0, seed=3,
                                         stop=stop, extra_body=NO_THINK)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == base[: base.find(stop)]


def test_a_stream_never_sends_the_start_of_a_stop_string(client):
    """A stop string that spans two pieces of the reply: the stream holds its first piece's end back until the next
    shows it is the stop (sent only what the plain reply has); a stop string's start that never finishes is sent at
    the end."""
    kw = dict(model="tiny-glm5", messages=HELLO, max_tokens=16, temperature=1.0, seed=3, extra_body=NO_THINK)

    def streamed(**more):
        return [c.choices[0].delta.content for c in client.chat.completions.create(stream=True, **kw, **more)
                if c.choices and c.choices[0].delta.content]

    pieces = streamed()
    text = "".join(pieces)
    ends = list(itertools.accumulate(map(len, pieces)))[:-1]
    at = next(e for e in ends if text.find(text[e - 1 : e + 1]) == e - 1)  # the stop's first occurrence spans e
    stop = text[at - 1 : at + 1]
    assert "".join(streamed(stop=stop)) == text[: at - 1]
    assert client.chat.completions.create(**kw, stop=stop).choices[0].message.content == text[: at - 1]
    assert "".join(streamed(stop=[text[-1] + "\x00never"])) == text


def test_nothing_of_the_reply_after_a_stop_string(client, monkeypatch):
    """What the reply's stream still holds when a stop string ends it (a character's first bytes, flushed at the
    end) is past the reply's end: neither the plain reply nor the stream has it."""
    from glm5_offload import server as server_module

    class HoldingBack(server_module.ReplyStream):
        def flush(self):
            self.on_text("HELD", False)
            super().flush()

    monkeypatch.setattr(server_module, "ReplyStream", HoldingBack)
    kw = dict(model="tiny-glm5", messages=HELLO, max_tokens=16, temperature=1.0, seed=3, extra_body=NO_THINK)

    def streamed(**more):
        chunks = client.chat.completions.create(stream=True, **kw, **more)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    base = client.chat.completions.create(**kw).choices[0].message.content
    assert streamed() == base + "HELD"  # (the plain reply is decoded whole, not from the stream)
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    assert client.chat.completions.create(**kw, stop=stop).choices[0].message.content == base[: base.find(stop)]
    assert streamed(stop=stop) == base[: base.find(stop)]


def test_extending_the_conversation_reuses_its_prefix(client, server):
    first = client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=6, temperature=0,
                                           extra_body=NO_THINK)
    follow = HELLO + [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "Tell me more."}]
    second = client.chat.completions.create(model="tiny-glm5", messages=follow, max_tokens=6, temperature=0,
                                            extra_body=NO_THINK)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert server.RequestHandlerClass.service.last.reused_tokens == second.usage.prompt_tokens_details.cached_tokens


def test_concurrent_requests_queue_and_none_is_lost(client):
    prompts = [[{"role": "user", "content": f"Question number {i}"}] for i in range(6)]
    expected = [client.chat.completions.create(model="tiny-glm5", messages=p, max_tokens=5, temperature=0,
                                               extra_body=NO_THINK).choices[0].message.content for p in prompts]
    got = [None] * len(prompts)

    def ask(i):
        got[i] = client.chat.completions.create(model="tiny-glm5", messages=prompts[i], max_tokens=5, temperature=0,
                                                extra_body=NO_THINK).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == expected


def post(server, body: bytes):
    request = urllib.request.Request(f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (json.dumps({"messages": []}).encode(), "messages"),
    (json.dumps({"messages": [{"role": "user"}]}).encode(), "messages[0]"),
    (json.dumps({"messages": HELLO, "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({"messages": HELLO, "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"messages": HELLO, "top_p": 1.5}).encode(), "top_p"),
    (json.dumps({"messages": HELLO, "stop": [1]}).encode(), "stop"),
    (json.dumps({"messages": HELLO, "stream": "yes"}).encode(), "stream"),
    (json.dumps({"messages": HELLO, "enable_thinking": "no"}).encode(), "enable_thinking"),
    (json.dumps({"messages": HELLO, "reasoning_effort": "medium"}).encode(), "reasoning_effort"),
    (json.dumps({"messages": HELLO, "chat_template_kwargs": {"reasoning_effort": 3}}).encode(), "chat_template_kwargs"),
    (json.dumps({"messages": HELLO, "chat_template_kwargs": {"tools_in_system": True}}).encode(),
     "chat_template_kwargs"),
    (json.dumps({"messages": HELLO, "chat_template_kwargs": []}).encode(), "chat_template_kwargs"),
    (json.dumps({"messages": HELLO, "enable_thinking": True,
                 "chat_template_kwargs": {"enable_thinking": False}}).encode(), "enable_thinking"),
])
def test_bad_requests(server, body, param):
    status, payload = post(server, body)
    assert status == 400 and payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["param"] == param and payload["error"]["message"]


@pytest.mark.parametrize("body, status, param", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "temperature"),
    (json.dumps({"messages": HELLO, "seed": 2**63}).encode(), 400, "seed"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages[0]"),
    (b"[" * 100_000 + b"]" * 100_000, 400, None),
    (json.dumps({"messages": HELLO, "stream": True, "stream_options": "x"}).encode(), 400, "stream_options"),
    (json.dumps({"messages": HELLO, "model": "gpt-5"}).encode(), 404, "model"),
])
def test_hostile_requests_get_a_json_error(server, client, body, status, param):
    got, payload = post(server, body)
    assert got == status and payload["error"]["param"] == param and payload["error"]["message"]
    assert client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=2).usage.completion_tokens == 2


def test_text_parts_are_the_string_they_join(client):
    joined = [{"role": "user", "content": "Hello!\nHow are you?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello!"}, {"type": "text", "text": "How are you?"}]}]
    a, b = (client.chat.completions.create(model="tiny-glm5", messages=m, max_tokens=6, temperature=0,
                                           extra_body=NO_THINK) for m in (joined, parts))
    assert a.usage.prompt_tokens == b.usage.prompt_tokens and a.choices[0].message.content == b.choices[0].message.content


def test_top_k_one_is_greedy(client):
    greedy, top1 = (client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=8, temperature=t,
                                                   seed=5, extra_body={**NO_THINK, **extra})
                    for t, extra in ((0, {}), (1.5, {"top_k": 1})))
    assert top1.choices[0].message.content == greedy.choices[0].message.content


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"),
    ("response_format", {"type": "json_object"}),
    ("logprobs", True),
    ("top_logprobs", 3),
    ("frequency_penalty", 0.5),
    ("presence_penalty", -1),
    ("logit_bias", {"42": 100}),
    ("top_k", -1),
])
def test_fields_that_would_change_the_reply_are_refused(server, field, value):
    status, payload = post(server, json.dumps({"messages": HELLO, field: value, "max_tokens": 2}).encode())
    assert status == 400 and payload["error"]["param"] == field and field in payload["error"]["message"]


def test_their_defaults_are_accepted(server):
    defaults = {"tools": [], "tool_choice": "auto", "response_format": {"type": "text"}, "logprobs": False,
                "top_logprobs": 0, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "top_k": 0}
    status, payload = post(server, json.dumps({"messages": HELLO, "max_tokens": 2, **defaults}).encode())
    assert status == 200 and payload["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("message, words", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, ["content[0]", "image_url"]),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, ["content[0]", "text part"]),
    ({"role": "user", "content": []}, ["list of text parts"]),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}, ["tool_calls"]),
])
def test_content_other_than_text_is_refused(server, message, words):
    status, payload = post(server, json.dumps({"messages": [message], "max_tokens": 2}).encode())
    assert status == 400 and payload["error"]["param"] == "messages[0]"
    assert all(w in payload["error"]["message"] for w in words), payload


def test_a_message_keeps_its_other_keys():
    messages = parse_request({"messages": [{"role": "assistant", "content": [{"type": "text", "text": "x"}],
                                            "reasoning_content": "why"}]}, 8)[0]
    assert messages == [{"role": "assistant", "content": "x", "reasoning_content": "why"}]


def raw_request(server, head: bytes, body: bytes = b"") -> tuple[int, dict | None]:
    """One request on a socket as written; the status and the JSON body (None for a HEAD)."""
    with socket.create_connection(server.server_address, timeout=30) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        header, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in header.split(b"\r\n") if line.lower().startswith(b"content-length")))
        if head.startswith(b"HEAD"):
            return int(header.split()[1]), None
        while len(rest) < length:
            rest += sock.recv(65536)
    return int(header.split()[1]), json.loads(rest)


@pytest.mark.parametrize("length, status", [("1000000000000", 413), ("-5", 400), ("many", 400)])
def test_bad_content_length(server, length, status):
    got, payload = raw_request(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                               + length.encode(), b"{}")
    assert got == status and "Content-Length" in payload["error"]["message"]


def test_a_body_that_never_comes_does_not_hold_a_thread(server):
    server.RequestHandlerClass.timeout = 1
    try:
        t0 = time.monotonic()
        got, payload = raw_request(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100",
                                   b'{"messages"')
        assert got == 408 and "did not arrive" in payload["error"]["message"] and time.monotonic() - t0 < 20
    finally:
        server.RequestHandlerClass.timeout = 30


def test_a_client_gone_before_its_body_ends_gets_no_answer(server, client):
    """Content-Length 100, 11 bytes, then the client closes its side: the server reads the end of the stream, answers
    nothing (no "not valid JSON" for a body cut short) and closes; it serves the next request."""
    with socket.create_connection(server.server_address, timeout=30) as sock:
        sock.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"messages"')
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(65536) == b""
    assert client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=2).usage.completion_tokens == 2


def test_an_answer_to_a_client_gone_is_dropped_quietly(server):
    """Writing a reply to a socket the client has closed (a broken pipe, a reset) ends that request only: no
    traceback from deep inside http.server in the server's log."""
    class Gone:
        def write(self, data):
            raise BrokenPipeError(32, "Broken pipe")

    handler = server.RequestHandlerClass.__new__(server.RequestHandlerClass)
    handler.request_version, handler.command, handler.close_connection = "HTTP/1.1", "POST", False
    handler.requestline, handler.client_address, handler.wfile = "POST / HTTP/1.1", ("127.0.0.1", 1), Gone()
    handler._error(400, "the request body is not valid JSON")
    assert handler.close_connection


def test_messages_the_chat_template_refuses_get_a_json_error(server, client):
    """A template's own raise_exception for some messages: a 400 with its words, and the next request is served."""
    tokenizer = server.RequestHandlerClass.service.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = ("{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no boom') }}"
                               "{% endif %}{% endfor %}" + template)
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-glm5", messages=[{"role": "user", "content": "boom"}],
                                           max_tokens=2)
        assert e.value.body["message"] == "the chat template failed: TemplateError: no boom"
        reply = client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=2)
        assert reply.usage.completion_tokens == 2
    finally:
        tokenizer.chat_template = template


def test_requests_http_server_refuses_get_json_errors(server):
    got, payload = raw_request(server, b"BREW /v1/chat/completions HTTP/1.1\r\nHost: x")
    assert got == 501 and payload["error"]["message"] == "Unsupported method ('BREW')"
    got, payload = raw_request(server, b"GET /health HTTP/1.1\r\nX: " + b"y" * 70000)
    assert got == 431 and payload["error"]["message"] == "Line too long"


@pytest.mark.parametrize("method", ["HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"])
def test_other_methods_get_json_405(server, method):
    got, payload = raw_request(server, f"{method} /v1/chat/completions HTTP/1.1\r\nHost: x".encode())
    assert got == 405
    if payload is not None:
        assert payload["error"]["message"].startswith(f"method {method} is not allowed")


@pytest.mark.parametrize("max_tokens", [3, 20])
def test_streamed_thinking_and_answer_equal_the_plain_reply(client, max_tokens):
    """With thinking on, the end of the reply (a </think> that never came, a character's first bytes) is flushed."""
    plain = client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=max_tokens, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=max_tokens,
                                                 temperature=0, stream=True))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    message = plain.choices[0].message.model_dump()
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == (message.get("reasoning_content") or "")
    assert "".join(d.get("content") or "" for d in deltas) == (message.get("content") or "")


def test_prompt_longer_than_the_context(server, client):
    long = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-glm5", messages=long, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"


def test_unknown_route(server):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/v2/nothing")
    assert e.value.code == 404


def test_a_model_that_fails_mid_reply_gets_a_server_error(server, client, monkeypatch):
    """Logits that are not finite (a broken checkpoint): a plain request gets a 500 server_error naming it; a stream
    already under way ends with an error event and [DONE]; the server goes on."""
    from glm5_offload.errors import ModelError
    from glm5_offload.runtime import engine as engine_module

    real, calls, fail_at = engine_module.sample, [], [1]

    def failing(logits, params, generator):
        calls.append(1)
        if len(calls) == fail_at[0]:
            raise ModelError("the model's next-token logits hold nan (not finite)")
        return real(logits, params, generator)

    monkeypatch.setattr(engine_module, "sample", failing)
    status, payload = post(server, json.dumps({"messages": HELLO, "max_tokens": 8}).encode())
    assert status == 500 and payload["error"]["type"] == "server_error" and "nan" in payload["error"]["message"]
    calls.clear()
    fail_at[0] = 12  # after tokens have streamed
    events = [json.loads(line[6:]) for line in urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions",
        json.dumps({"messages": HELLO, "max_tokens": 16, "stream": True}).encode())).read().decode().split("\n\n")
        if line.startswith("data: {")]
    assert any("delta" in str(e) for e in events[:-1]) and events[-1]["error"]["type"] == "server_error"
    monkeypatch.setattr(engine_module, "sample", real)
    assert client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=2).usage.completion_tokens == 2


def test_a_plain_request_whose_client_left_stops(server, client, monkeypatch):
    """A client that times out and closes its connection (as clients do, then retry): its plain request stops at
    the next token, and one that left while queued never runs; the server goes on."""
    service = server.RequestHandlerClass.service
    ran, generate = [], service.engine.generate

    def recorded_run(prompt, *a, **kw):
        ran.append(prompt)
        return generate(prompt, *a, **kw)

    monkeypatch.setattr(service.engine, "generate", recorded_run)
    ended, complete = [], service.complete

    def recorded(*a, **kw):
        try:
            return complete(*a, **kw)
        finally:
            ended.append(1)

    monkeypatch.setattr(service, "complete", recorded)

    def send_and_leave(content, max_tokens):
        body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        with socket.create_connection(server.server_address) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.5)  # read by the server, then the client gives up
        return service.prompt([{"role": "user", "content": content}], {"enable_thinking": True})

    prompt = send_and_leave("a long answer nobody waits for", 3000)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (service.lock.locked() or service.last is None
                                           or service.last.prompt_ids != prompt):
        time.sleep(0.05)
    assert service.last.prompt_ids == prompt and service.last.stop_reason == "stop"
    assert len(service.last.output_ids) < 3000
    with service.lock:  # a request queued behind another, whose client leaves before its turn
        queued = send_and_leave("queued, then gone", 8)
    while time.monotonic() < deadline and len(ended) < 2:
        time.sleep(0.05)
    assert client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=2).usage.completion_tokens == 2
    assert queued not in ran and len(ran) == 2


def test_a_defect_in_a_request_is_a_500_not_a_dropped_connection(server, client, monkeypatch, capfd):
    """An exception no one expected (a bug) while a request runs: the client gets a 500 server_error naming it
    (mid-stream: an error event and [DONE]), the traceback goes to the server's log, and the server goes on."""
    service = server.RequestHandlerClass.service

    def broken(prompt, max_tokens, params, on_token=None):  # a few tokens, then a defect
        for token in service.tokenizer.encode("Hello there", add_special_tokens=False):
            on_token(token)
        return {}["no such key"]

    monkeypatch.setattr(service.engine, "generate", broken)
    error = {"message": "internal error (KeyError: 'no such key'); the traceback is in the server's log",
             "type": "server_error", "param": None, "code": None}
    error_body = {"error": error}
    assert post(server, json.dumps({"messages": HELLO, "max_tokens": 4}).encode()) == (500, error_body)
    events = urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions",
        json.dumps({"messages": HELLO, "max_tokens": 4, "stream": True}).encode())).read().decode().split("\n\n")
    assert "reasoning_content" in events[1] and events[-3:] == [f"data: {json.dumps(error_body)}", "data: [DONE]", ""]
    assert capfd.readouterr().err.count("Traceback") == 2
    monkeypatch.undo()
    assert client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=2).usage.completion_tokens == 2


def test_client_gone_mid_stream_frees_the_engine(server, client):
    body = json.dumps({"messages": HELLO, "max_tokens": 3000, "temperature": 0, "stream": True}).encode()
    sock = socket.create_connection(server.server_address)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while b"data:" not in received:  # the headers, then the first event
        received += sock.recv(4096)
    sock.close()
    service = server.RequestHandlerClass.service
    deadline, prompt = time.monotonic() + 120, service.prompt(HELLO, {"enable_thinking": True})
    while time.monotonic() < deadline and (service.lock.locked() or service.last is None
                                           or service.last.prompt_ids != prompt):
        time.sleep(0.05)
    assert not service.lock.locked()
    assert service.last.stop_reason == "stop" and len(service.last.output_ids) < 3000
    r = client.chat.completions.create(model="tiny-glm5", messages=HELLO, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
