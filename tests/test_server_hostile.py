"""The server against a hostile client: every probe of issue 8 is a test against a live server.

A template bomb and a large prompt are built off the event loop (/health answers within
1 s while they run; the bomb is cut at the prompt time limit); 2,100 slow half-open
connections never hold more than the connection cap and /health keeps answering; a slow
body gets 408; strict types (no coercion); unsupported options and unusable sampling
values refused by name; lone surrogates are 400; every 5xx is counted in /metrics and
names no internals; /health is 503 while the engine cannot serve; the OpenAI JS client's
CORS preflight, a lowercase `bearer`, HEAD /health and the routes without /v1 work.
"""

from __future__ import annotations

import json
import resource
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest
from test_server import EOS, MSG, NO_EOS, LiveServer

from mlx_tandem.engine.request import EngineClosed
from mlx_tandem.server.transport import backlog

KEY = "sk-hostile"
ORIGIN = "http://app.example"
CAP = 256


@pytest.fixture(scope="module")
def server(tiny_model):
    live = LiveServer(
        tiny_model("llama"),
        config={"max_rows": 8, "max_queue": 8},
        allow_request_templates=True,
        prompt_timeout_s=1.0,
        body_timeout_s=1.0,
        header_timeout_s=2.0,
        max_connections=CAP,
    )
    yield live
    live.stop()


@pytest.fixture(scope="module")
def keyed(tiny_model):
    live = LiveServer(tiny_model("llama"), api_key=KEY, cors_origins=(ORIGIN,))
    yield live
    live.stop()


def post(server: LiveServer, path: str, body: Any, **kw: Any) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=30, **kw)


def refused(r: httpx.Response, param: str | None, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


@contextmanager
def health_watch(server: LiveServer) -> Iterator[list[float]]:
    """Poll /health every 50 ms while the block runs; yields the list of latencies (s)."""
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=5) as client:
            while not stop.is_set():
                start = time.monotonic()
                assert client.get(server.url + "/health").status_code == 200
                latencies.append(time.monotonic() - start)
                stop.wait(0.05)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield latencies
    finally:
        stop.set()
        thread.join(timeout=10)


# --- prompt building off the event loop ----------------------------------------------------------

BOMB = (
    "{% for a in range(99999) %}{% for b in range(99999) %}{% if a == b %}"
    "{% endif %}{% endfor %}{% endfor %}"
)


def test_template_bomb_is_cut_while_health_answers(server):
    body = {"messages": MSG, "max_tokens": 2, "chat_template_kwargs": {"chat_template": BOMB}}
    with health_watch(server) as latencies:
        time.sleep(0.2)
        start = time.monotonic()
        r = post(server, "/v1/chat/completions", body)
        took = time.monotonic() - start
        time.sleep(0.2)
    err = refused(r, "messages")
    assert err["code"] == "prompt_timeout" and took < 3.0
    assert len(latencies) >= 5 and max(latencies) < 1.0, latencies
    ok = post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2})
    assert ok.status_code == 200


def test_large_prompt_is_tokenized_off_the_loop(keyed):
    text = "lorem ipsum dolor sit amet " * 60_000  # ~1.6 MB: over a second to tokenize here
    auth = {"Authorization": f"Bearer {KEY}"}
    with health_watch(keyed) as latencies:
        start = time.monotonic()
        r = post(keyed, "/v1/completions", {"prompt": text, "max_tokens": 1}, headers=auth)
        took = time.monotonic() - start
    refused(r, "max_tokens")  # tokenized, then over the tiny model's context window
    assert "context window" in r.json()["error"]["message"]
    assert took > 0.5, took  # long enough that a blocked event loop would show
    # on the event loop, /health would wait about as long as the tokenization took
    assert latencies and max(latencies) < min(1.0, took / 2), (took, max(latencies))


def test_request_templates_need_the_operator(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": MSG, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}
    refused(post(keyed, "/v1/chat/completions", body, headers=auth), "chat_template_kwargs.chat_template")


def test_template_errors_name_the_request(server, tiny_model):
    for key in ("tokenize", "messages", "tools", "return_dict"):
        body = {"messages": MSG, "chat_template_kwargs": {key: True}}
        err = refused(post(server, "/v1/chat/completions", body), f"chat_template_kwargs.{key}")
        assert "apply_chat_template" not in err["message"] and "()" not in err["message"]
    raising = "{{ raise_exception('roles must alternate') }}"
    body = {"messages": MSG, "chat_template_kwargs": {"chat_template": raising}}
    err = refused(post(server, "/v1/chat/completions", body), "messages")
    assert "roles must alternate" in err["message"] and "jinja2" not in err["message"]
    broken = "{{ messages[0].content | no_such_filter }}"
    body["chat_template_kwargs"] = {"chat_template": broken}
    err = refused(post(server, "/v1/chat/completions", body), "messages")
    assert "Template" not in err["message"] and "render()" not in err["message"]


def test_add_generation_prompt_false(server):
    base = {"messages": MSG, "max_tokens": 1, "logit_bias": NO_EOS}
    on = post(server, "/v1/chat/completions", base).json()
    off_kwargs = {"chat_template_kwargs": {"add_generation_prompt": False}}
    off = post(server, "/v1/chat/completions", {**base, **off_kwargs}).json()
    assert off["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"] - 1  # no <|assistant|>
    bad = {**base, "chat_template_kwargs": {"add_generation_prompt": "no"}}
    refused(post(server, "/v1/chat/completions", bad), "chat_template_kwargs.add_generation_prompt")


# --- connections ------------------------------------------------------------------------------------


def open_connections(server: LiveServer) -> int:
    """Sockets the server holds open for accepted connections (its side, from /proc)."""
    port = int(server.url.rsplit(":", 1)[1])
    held = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].split(":")[1], 16)
        state, inode = fields[3], int(fields[9])
        held += local_port == port and state != "0A" and inode != 0  # 0A: the listener
    return held


@pytest.fixture
def client_descriptors() -> Iterator[None]:
    """Room for 2,100 client sockets in this process (mlx_lm sets the soft limit to 2048)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_slow_half_open_connections_cannot_take_the_server(server, client_descriptors):
    port = int(server.url.rsplit(":", 1)[1])
    socks: list[socket.socket] = []
    peak = 0
    try:
        with health_watch(server) as latencies:
            for i in range(2100):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # no end of head
                socks.append(s)
                if i % 32 == 0:  # let the server accept: a full listen queue drops SYNs (1 s retry)
                    time.sleep(0.01)
                if i % 100 == 0:
                    peak = max(peak, open_connections(server))
            for _ in range(6):  # trickling bytes does not extend the head deadline
                for s in socks[-50:]:
                    with suppress(OSError):
                        s.sendall(b"X")
                peak = max(peak, open_connections(server))
                time.sleep(0.5)
        assert peak <= CAP + backlog(CAP), peak  # the cap, plus at most one accept burst
        assert latencies and max(latencies) < 1.0, max(latencies)
        deadline = time.monotonic() + 5
        while open_connections(server) > 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert open_connections(server) <= 2  # every slow one was closed
    finally:
        for s in socks:
            s.close()
    assert httpx.get(server.url + "/health").status_code == 200


def test_slow_body_gets_408(server):
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"messages\""
        )
        start, reply = time.monotonic(), b""
        while b"body_timeout" not in reply and (part := s.recv(65536)):
            reply += part  # head and body may come in separate packets
        assert time.monotonic() - start < 3.0
    assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout" in reply
    assert server.metrics()['tandem_http_requests_total{endpoint="/v1/chat/completions",code="408"}'] >= 1


# --- strict types, unsupported options, unusable values -------------------------------------------

STRICT_400 = [
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": "4"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 4.0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {"messages": MSG, "seed": True}, "seed"),
    ("/v1/chat/completions", {"messages": MSG, "stream": 1}, "stream"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": "true"}, "logprobs"),
    ("/v1/completions", {"prompt": [True]}, "prompt[0]"),
    ("/v1/completions", {"prompt": [[1, False]]}, "prompt[0][1]"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, "n"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": 1e-45}, "temperature"),
    ("/v1/chat/completions", {"messages": MSG, "repetition_penalty": 1e-45}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "temperature": 1e-30}, "temperature"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "yaml"}},
     "response_format.type"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ("/v1/chat/completions", {"messages": MSG, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions",
     {"messages": MSG, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ("/v1/chat/completions",
     {"messages": [*MSG, {"role": "tool", "content": "18 C"}]}, "messages[1].tool_call_id"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), STRICT_400)
def test_refused_by_name(server, path, body, param):
    err = refused(post(server, path, body), param)
    assert err["type"] == "invalid_request_error"
    assert param.split(".")[-1].split("[")[0] in err["message"]


def test_a_prompt_over_the_window_names_the_prompt_and_long_values_are_not_echoed(server):
    long = "lorem ipsum " * server.model.context_length
    for path, body, param in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages"),
        ("/v1/completions", {"prompt": long}, "prompt"),
    ):
        err = refused(post(server, path, body), param)  # no max_tokens: the prompt is too long
        assert "fills the context window" in err["message"]
    stops = [f"stop string number {i}" for i in range(100)]
    err = refused(post(server, "/v1/chat/completions", {"messages": MSG, "stop": stops}), "stop")
    assert "at most 16 stop strings, got 100" in err["message"] and len(err["message"]) < 200


def test_defaults_of_unsupported_options_are_accepted(server):
    body = {"messages": MSG, "max_tokens": 2, "response_format": {"type": "text"},
            "parallel_tool_calls": True, "tool_choice": "auto"}  # fmt: skip
    assert post(server, "/v1/chat/completions", body).status_code == 200
    text = {"prompt": "x", "max_tokens": 2, "best_of": 1, "suffix": ""}
    assert post(server, "/v1/completions", text).status_code == 200
    assert post(server, "/v1/chat/completions", {**body, "temperature": 1e-6}).status_code == 200


def test_lone_surrogates_are_400(server):
    raw = '{"prompt": "\\ud800", "max_tokens": 2}'
    refused(post(server, "/v1/completions", raw), "prompt")
    raw = '{"messages": [{"role": "user", "content": "a\\udfffb"}]}'
    refused(post(server, "/v1/chat/completions", raw), "messages[0].content")
    raw = '{"messages": [{"role": "user", "content": "x"}], "stop": ["\\ud800"]}'
    assert post(server, "/v1/chat/completions", raw).status_code == 400


# --- 5xx: counted, no internals; engine health -------------------------------------------------------


def test_every_5xx_is_counted_and_names_no_internals(server):
    code_500 = 'tandem_http_requests_total{endpoint="/v1/completions",code="500"}'
    before = server.metrics().get(code_500, 0)

    def boom(*args: Any, **kwargs: Any) -> None:
        raise KeyError("secret internal detail")

    with mock.patch.object(server.engine, "submit", boom):
        r = post(server, "/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and "secret" not in err["message"]
    assert "KeyError" not in err["message"]
    assert server.metrics()[code_500] == before + 1


def test_health_503_while_the_engine_cannot_serve(server):
    engine_type = type(server.engine)
    with mock.patch.object(engine_type, "healthy", new_callable=mock.PropertyMock) as healthy:
        healthy.return_value = False
        assert httpx.get(server.url + "/health").status_code == 503
        assert httpx.head(server.url + "/health").status_code == 503
    assert httpx.get(server.url + "/health").status_code == 200

    def closed(*args: Any, **kwargs: Any) -> None:
        raise EngineClosed("the engine is shut down")

    with mock.patch.object(server.engine, "submit", closed):
        r = post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"


def test_failed_row_is_500_json_and_an_error_chunk_on_a_stream(server):
    core = server.engine.core
    real_step = core.step
    armed = threading.Event()

    def failing_step() -> bool:
        if armed.is_set() and core.running:
            armed.clear()
            raise RuntimeError("injected step failure")
        return real_step()

    body = {"messages": MSG, "max_tokens": 50, "logit_bias": NO_EOS}
    with mock.patch.object(core, "step", failing_step):
        armed.set()
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        armed.set()
        with httpx.stream("POST", server.url + "/v1/chat/completions",
                          json={**body, "stream": True}, timeout=30) as s:  # fmt: skip
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    events = [line[6:] for line in lines]
    assert events[-1] == "[DONE]"
    assert any("error" in json.loads(e) for e in events[:-1])
    finals = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]
              if json.loads(e).get("choices")]  # fmt: skip
    assert finals[-1] == "error"
    assert post(server, "/v1/chat/completions", {**body, "max_tokens": 2}).status_code == 200


# --- compatibility ------------------------------------------------------------------------------------


def test_openai_js_client_compatibility(keyed):
    pre = httpx.options(
        keyed.url + "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os,"
            "x-stainless-lang,x-stainless-package-version,x-stainless-retry-count",
        },
    )
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "x-stainless-os" in pre.headers["access-control-allow-headers"].lower()
    for scheme in ("bearer", "BEARER", "Bearer"):
        auth = {"Authorization": f"{scheme} {KEY}"}
        assert httpx.get(keyed.url + "/v1/models", headers=auth).status_code == 200
    assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": KEY}).status_code == 401
    head = httpx.head(keyed.url + "/health")
    assert head.status_code == 200 and head.content == b""
    auth = {"Authorization": f"Bearer {KEY}"}
    models = httpx.get(keyed.url + "/models", headers=auth)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == keyed.model.name
    r = post(keyed, "/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {str(EOS): -100}},
             headers=auth)  # fmt: skip
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    metrics = keyed.metrics()
    assert metrics['tandem_http_requests_total{endpoint="/v1/completions",code="200"}'] >= 1
