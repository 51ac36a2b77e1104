"""The OpenAI-compatible server, live on a real socket, driven by the official `openai` client.

Tiny random-weight models: chat and completions (JSON and SSE), stop, logprobs, seeds, n,
usage, error codes (400/401/404/413/429), disconnect cancelling rows, 32 concurrent
streams equal to each request alone (speculation off, on, and off per request). Tools and
fuzzing: tests/test_server_tools.py; the `tandem serve` process: tests/test_serve_cli.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from mlx_tandem.drafters.factory import build_depth, build_drafter
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.sampling import SamplingParams
from mlx_tandem.engine.service import Engine
from mlx_tandem.models.loader import LoadedModel
from mlx_tandem.server import ServerOptions, create_app, uvicorn_config
from mlx_tandem.server.metrics import parse as parse_metrics

EOS = 256  # the tiny tokenizer's <eos>
NO_EOS = {str(EOS): -100}
KEY = "sk-test-key"
ORIGIN = "http://app.example"


# --- helpers (also used by tests/test_server_real.py) -------------------------------------------


class LiveServer:
    """create_app + uvicorn on 127.0.0.1:<free port> in a thread; `stop()` shuts it all down."""

    def __init__(
        self,
        model: LoadedModel,
        drafter: str | None = None,
        config: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        cfg = RuntimeConfig.resolve(environ={}, **(config or {}))
        spec = build_drafter(drafter, model, cfg) if drafter else None
        depth = build_depth("fixed", 3) if drafter else None
        self.model = model
        self.engine = Engine(model, cfg, drafter=spec, depth=depth)
        self.options = ServerOptions(model_id=model.name, **options)
        self.app = create_app(model, self.engine, self.options)
        config_ = uvicorn_config(self.app, self.options, "127.0.0.1", 0, log_level="warning")
        self.server = uvicorn.Server(config_)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        self.key = options.get("api_key") or "unused"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=self.key, max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.key, max_retries=0)

    def metrics(self) -> dict[str, float]:
        headers = {"Authorization": f"Bearer {self.key}"}
        return parse_metrics(httpx.get(self.url + "/metrics", headers=headers).text)

    def wait_idle(self, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while self.engine.busy():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.shutdown()


def sse_events(lines: list[str]) -> list[Any]:
    """The `data:` payloads of an SSE body: parsed JSON, or the string '[DONE]'."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def chat(server: LiveServer, content: str, **kw: Any) -> Any:
    messages = [{"role": "user", "content": content}]
    return server.client.chat.completions.create(model="x", messages=messages, **kw)


def streamed_text(chunks: list[Any], index: int = 0) -> str:
    return "".join(
        c.choices[0].delta.content or ""
        for c in chunks
        if c.choices and c.choices[0].index == index
    )


# --- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def plain(llama):
    server = LiveServer(llama, config={"max_rows": 32})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def spec_server(llama):
    server = LiveServer(llama, drafter="ngram", config={"max_rows": 32})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def strict(llama):
    config = {"max_rows": 1, "max_queue": 2}
    server = LiveServer(
        llama, config=config, api_key=KEY, max_body_bytes=16 << 10, cors_origins=(ORIGIN,)
    )
    yield server
    server.stop()


# --- basics ------------------------------------------------------------------------------------------


def test_chat_and_completions_json(plain, llama):
    r = chat(plain, "Hello there", max_tokens=12, logit_bias=NO_EOS)
    prompt = llama.encode_messages([{"role": "user", "content": "Hello there"}])
    direct = plain.engine.submit(prompt, SamplingParams(max_tokens=12, logit_bias={EOS: -100}))
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == llama.name and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == direct.result().text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 12)
    assert r.usage.total_tokens == len(prompt) + 12

    t = plain.client.completions.create(
        model="x", prompt="Once upon", max_tokens=8, logit_bias=NO_EOS
    )
    ids = llama.encode_text("Once upon")
    direct = plain.engine.submit(ids, SamplingParams(max_tokens=8, logit_bias={EOS: -100}))
    assert t.object == "text_completion" and t.model == llama.name
    assert t.choices[0].text == direct.result().text and t.choices[0].finish_reason == "length"
    assert (t.usage.prompt_tokens, t.usage.completion_tokens) == (len(ids), 8)
    tokens = plain.client.completions.create(model="x", prompt=ids, max_tokens=8, logit_bias=NO_EOS)
    assert tokens.choices[0].text == t.choices[0].text
    echo = plain.client.completions.create(
        model="x", prompt="Once upon", max_tokens=8, logit_bias=NO_EOS, echo=True
    )
    assert echo.choices[0].text == "Once upon" + t.choices[0].text  # as sent, no BOS text
    echo_ids = plain.client.completions.create(
        model="x", prompt=ids, max_tokens=8, logit_bias=NO_EOS, echo=True
    )
    assert echo_ids.choices[0].text == llama.tokenizer.decode(ids) + t.choices[0].text


def test_echo_returns_a_text_prompt_as_sent(plain, llama, monkeypatch):
    """A tokenizer that adds BOS (Gemma's) must not put "<bos>" into an echoed text prompt."""
    bos = llama.tokenizer.convert_tokens_to_ids("<bos>")
    encode = llama.encode_text
    monkeypatch.setattr(llama, "encode_text", lambda x: [bos, *encode(x)])
    kw: dict[str, Any] = {"model": "x", "prompt": "Once upon", "max_tokens": 4,
                          "logit_bias": NO_EOS}
    alone = plain.client.completions.create(**kw).choices[0].text
    assert plain.client.completions.create(echo=True, **kw).choices[0].text == "Once upon" + alone


def test_model_field_never_loads_anything(plain, llama):
    for name in ("/etc/passwd", "../../../tmp/x", "gpt-4o", "smollm2-135m"):
        r = plain.client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert r.model == llama.name
    models = plain.client.models.list()
    assert [m.id for m in models.data] == [llama.name]
    assert plain.client.models.retrieve(llama.name).id == llama.name
    with pytest.raises(openai.NotFoundError):
        plain.client.models.retrieve("other")
    assert httpx.get(plain.url + "/health").json() == {"status": "ok"}


def test_streaming_equals_json(plain):
    kw: dict[str, Any] = {"max_tokens": 16, "logit_bias": NO_EOS}
    ref = chat(plain, "Stream me", **kw)
    chunks = list(
        chat(plain, "Stream me", stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert streamed_text(chunks) == ref.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [r for r in reasons if r] == ["length"] and reasons[-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == ref.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)

    ref = plain.client.completions.create(model="x", prompt="Abc", **kw)
    chunks = list(plain.client.completions.create(model="x", prompt="Abc", stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == ref.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"

    body = {"messages": [{"role": "user", "content": "raw"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", plain.url + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])


def test_stop_strings(plain):
    kw: dict[str, Any] = {"max_tokens": 40, "logit_bias": NO_EOS}
    full = chat(plain, "Stop test", **kw).choices[0].message.content
    stop = next(ch for i, ch in enumerate(full) if i >= 3 and ch.isascii() and ch.isalnum())
    cut = full[: full.find(stop)]
    r = chat(plain, "Stop test", stop=[stop, "never-seen"], **kw)
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    chunks = list(chat(plain, "Stop test", stop=stop, stream=True, **kw))
    assert streamed_text(chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def token_name(data: bytes) -> str:
    """OpenAI's name for a token: its text, or "bytes:\\x.." when it holds part of a character."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def test_logprobs_shapes(plain):
    kw: dict[str, Any] = {"max_tokens": 6, "logit_bias": NO_EOS}
    r = chat(plain, "Logprobs", logprobs=True, top_logprobs=3, **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for item in content:
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert item.logprob == pytest.approx(tops[0])  # greedy picks the top token
        assert item.token == token_name(bytes(item.bytes)) and item.logprob <= 0
    only = chat(plain, "Logprobs", logprobs=True, **kw).choices[0].logprobs.content
    assert [i.logprob for i in only] == [i.logprob for i in content]
    assert all(i.top_logprobs == [] for i in only)
    assert chat(plain, "Logprobs", **kw).choices[0].logprobs is None
    chunks = list(chat(plain, "Logprobs", logprobs=True, top_logprobs=2, stream=True, **kw))
    streamed = [
        i
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for i in c.choices[0].logprobs.content
    ]
    assert [i.logprob for i in streamed] == [i.logprob for i in content]

    t = plain.client.completions.create(model="x", prompt="abc", logprobs=2, **kw)
    lp = t.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_seeds_and_n(plain):
    kw: dict[str, Any] = {"max_tokens": 10, "temperature": 1.0, "logit_bias": NO_EOS}
    a = chat(plain, "Seeded", seed=7, **kw)
    assert (
        chat(plain, "Seeded", seed=7, **kw).choices[0].message.content
        == a.choices[0].message.content
    )
    b = chat(plain, "Seeded", seed=8, **kw).choices[0].message.content
    assert b != a.choices[0].message.content
    many = chat(plain, "Seeded", seed=7, n=3, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].message.content == a.choices[0].message.content
    assert many.choices[1].message.content == b  # choice i is seeded seed + i
    assert many.usage.prompt_tokens == a.usage.prompt_tokens
    assert many.usage.completion_tokens == 30
    top = chat(plain, "Seeded", seed=2**64 - 1, n=2, **kw)  # seed + 1 wraps to seed 0's key
    assert top.choices[1].message.content == chat(plain, "Seeded", seed=0, **kw).choices[0].message.content

    chunks = list(chat(plain, "Seeded", seed=7, n=3, stream=True, **kw))
    assert [streamed_text(chunks, i) for i in range(3)] == [c.message.content for c in many.choices]
    finals = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finals == [0, 1, 2]
    t = plain.client.completions.create(model="x", prompt=["ab", "cd"], n=2, max_tokens=3)
    assert [c.index for c in t.choices] == [0, 1, 2, 3]
    assert t.choices[0].text == t.choices[1].text  # greedy


# --- bad input ------------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "x"}]
CHAT_400 = [
    ('{"messages": [', None),
    ("[1, 2]", None),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": MSG, "temperature": -1}, "temperature"),
    ({"messages": MSG, "top_p": 2}, "top_p"),
    ({"messages": MSG, "top_k": -1}, "top_k"),
    ({"messages": MSG, "min_p": 5}, "min_p"),
    ({"messages": MSG, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": MSG, "frequency_penalty": -3}, "frequency_penalty"),
    ({"messages": MSG, "repetition_penalty": -1}, "repetition_penalty"),
    ({"messages": MSG, "n": 0}, "n"),
    ({"messages": MSG, "n": 99}, "n"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 100_000}, "max_tokens"),
    ({"messages": MSG, "max_completion_tokens": 100_000}, "max_completion_tokens"),
    ({"messages": MSG, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"5": 1000}}, "logit_bias"),
    ({"messages": MSG, "seed": "x"}, "seed"),
    ({"messages": MSG, "stop": 5}, "stop"),
    ({"messages": MSG, "stop": ["a"] * 20}, "stop"),
    ({"messages": MSG, "stop": ["a", ""]}, "stop"),
    ({"messages": MSG, "logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
    ({"messages": MSG, "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"messages": MSG, "stop_token_ids": [99999]}, "stop_token_ids"),
    ({"messages": MSG, "ignore_eos": "yes"}, "ignore_eos"),
    ({"messages": MSG, "xtc_probability": 0.5}, "xtc_probability"),
    ({"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": MSG, "num_draft_tokens": -1}, "num_draft_tokens"),
    ({"messages": MSG, "stream": "maybe"}, "stream"),
    ('{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
]


def test_vllm_and_mlx_lm_fields_reach_the_sampling_params():
    """vLLM's stop_token_ids / ignore_eos and mlx_lm.server's two penalty windows are request
    fields of their own (they were accepted and ignored, or shared one window)."""
    from mlx_tandem.engine.sampling import SamplingParams
    from mlx_tandem.server import schemas as S
    from mlx_tandem.server.jobs import request_values

    body = S.ChatCompletionRequest.model_validate({
        "messages": MSG, "stop_token_ids": [3, 4], "ignore_eos": True, "stop": "x",
        "presence_context_size": 5, "frequency_context_size": 50, "repetition_penalty": 0,
    })
    values = request_values(body, vocab=100)
    assert values["stop_token_ids"] == (3, 4) and values["ignore_eos"] is True
    assert (values["presence_context_size"], values["frequency_context_size"]) == (5, 50)
    assert values["stop"] == ("x",)
    params = SamplingParams(**values)
    assert params.frequency_context_size == 50 and params.repetition_penalty is None  # 0: off


@pytest.mark.parametrize(("body", "param"), CHAT_400)
def test_bad_chat_input_is_400_naming_the_field(plain, body, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        plain.url + "/v1/chat/completions",
        content=content,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param or (param and (err["param"] or "").startswith(param))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [999_999]}, "prompt"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ],
)
def test_bad_completion_input_is_400(plain, body, param):
    r = httpx.post(plain.url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_unknown_route_and_method_use_the_error_shape(plain):
    assert httpx.get(plain.url + "/v1/nothing").json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(plain.url + "/v1/chat/completions").status_code == 405
    assert "access-control-allow-origin" not in httpx.get(plain.url + "/health").headers


def test_api_key_cors_and_body_limit(strict):
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/v1/models", "/metrics", "/openapi.json"):
        r = httpx.get(strict.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        bad = httpx.get(strict.url + path, headers={"Authorization": f"Bearer {KEY}x"})
        assert bad.status_code == 401
        assert httpx.get(strict.url + path, headers=auth).status_code == 200
    assert httpx.get(strict.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=strict.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert chat(strict, "hi", max_tokens=2).choices[0].finish_reason in ("stop", "length")

    pre = httpx.options(
        strict.url + "/v1/chat/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
    )
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(strict.url + "/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers

    big = {"messages": [{"role": "user", "content": "x" * 20_000}]}
    r = httpx.post(strict.url + "/v1/chat/completions", json=big, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    chunked = (b"x" * 4096 for _ in range(8))  # no Content-Length: counted as it arrives
    r = httpx.post(strict.url + "/v1/chat/completions", content=chunked, headers=auth)
    assert r.status_code == 413


def test_queue_full_is_429_and_more_than_it_can_ever_hold_is_400(strict):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(strict, "queue", n=5, max_tokens=200)  # 2 queue places: 5 rows can never fit
    assert caught.value.response.json()["error"]["param"] == "n"
    long = SamplingParams(max_tokens=400, logit_bias={EOS: -100})
    busy = [strict.engine.submit([5, 6, 7], long)]
    deadline = time.monotonic() + 5
    while not strict.engine.running and time.monotonic() < deadline:
        time.sleep(0.005)
    busy += [strict.engine.submit([5, 6, 7], long) for _ in range(2)]  # the queue is full now
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            chat(strict, "queue", n=2, max_tokens=4)
        assert caught.value.response.headers["retry-after"] == "1"
        assert caught.value.response.json()["error"]["code"] == "queue_full"
    finally:
        for handle in busy:
            handle.cancel()
    assert strict.wait_idle()  # the rows already queued were withdrawn
    assert chat(strict, "queue", max_tokens=2).choices[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def endless(tiny_model):
    """A server whose model has a context no test can fill: its rows end only when cancelled."""
    server = LiveServer(tiny_model("llama", max_position_embeddings=1 << 20))
    yield server
    server.stop()


def test_disconnect_cancels_the_row(endless):
    # 262k tokens (~10 minutes here) cannot finish while the test runs, however far the
    # engine outruns this thread
    body = {"messages": MSG, "max_tokens": 1 << 18, "stream": True, "logit_bias": NO_EOS}
    with httpx.stream("POST", endless.url + "/v1/chat/completions", json=body) as r:
        lines, stream = [], r.iter_lines()
        for line in stream:
            lines += [line] if line.startswith("data: ") else []
            if len(lines) == 3:
                break
        assert all('"finish_reason": null' in line for line in lines), lines  # no error, no end
        # in flight (a row, or still joining: under a loaded machine the stream's first lines
        # can come before the row merges into the cohort). Read from this thread without the
        # engine's: a read inside a move between lists (joining -> running) sees 0, so any
        # of a few reads within 2 s must see the one request
        sched = endless.engine.scheduler
        seen, deadline = set(), time.monotonic() + 2
        while 1 not in seen and time.monotonic() < deadline:
            seen.add(len(endless.engine.running) + len(sched.joining) + len(sched.waiting))
            time.sleep(0.002)
        if 1 not in seen:  # say how the row ended: the rest of its stream
            rest = [line for line in stream if line.startswith("data: ")]
            pytest.fail(f"not in flight after 3 events ({seen}); then {len(rest)}: {rest[-2:]}")
    # idle within seconds means the row was cancelled (the bound is loose: a loaded 2-core CI
    # machine runs a step in up to ~1 s)
    assert endless.wait_idle(10.0), "the row was not cancelled"
    metrics = endless.metrics()
    assert metrics["tandem_rows_running"] == 0 and metrics["tandem_rows_queued"] == 0
    assert metrics['tandem_requests_total{status="cancelled"}'] == 1

    with pytest.raises(httpx.ReadTimeout):  # not streamed: the row goes when the client does
        httpx.post(endless.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=0.5)
    assert endless.wait_idle(10.0)
    assert endless.metrics()['tandem_requests_total{status="cancelled"}'] == 2


# --- concurrency ---------------------------------------------------------------------------------

PROMPTS = [f"Row {i}: abc abc abc {'xyz ' * (i % 5)}abc abc" for i in range(32)]


async def _concurrent(server: LiveServer, extra: dict[int, dict]) -> list[str]:
    client = server.async_client()

    async def one(i: int) -> str:
        messages = [{"role": "user", "content": PROMPTS[i]}]
        stream = await client.chat.completions.create(
            model="x", messages=messages, max_tokens=24, stream=True, extra_body=extra.get(i)
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    try:
        return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))
    finally:
        await client.close()


def _peak_rows(server: LiveServer, stop: threading.Event, peak: list[int]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], len(server.engine.running))
        time.sleep(0.002)


@pytest.fixture(scope="module")
def alone(plain):
    """Each concurrency prompt served alone, one request at a time (greedy)."""
    return [chat(plain, p, max_tokens=24).choices[0].message.content for p in PROMPTS]


@pytest.mark.parametrize("mode", ["plain", "ngram"])
def test_32_concurrent_streams_equal_each_alone(plain, spec_server, alone, mode):
    server = spec_server if mode == "ngram" else plain
    # with speculation on, every fourth request turns it off for itself
    extra = {i: {"num_draft_tokens": 0} for i in range(3, 32, 4)} if mode == "ngram" else {}
    stop, peak = threading.Event(), [0]
    watcher = threading.Thread(target=_peak_rows, args=(server, stop, peak))
    watcher.start()
    try:
        together = asyncio.run(_concurrent(server, extra))
    finally:
        stop.set()
        watcher.join()
    assert together == alone
    assert peak[0] >= 8, f"requests did not share the cohort (peak {peak[0]} rows)"
    if mode == "ngram":
        metrics = server.metrics()
        assert metrics['tandem_spec_drafted_tokens_total{drafter="ngram"}'] > 0
        assert metrics['tandem_spec_accepted_tokens_total{drafter="ngram"}'] > 0
    assert server.wait_idle()
