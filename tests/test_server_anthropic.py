"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), live, via the anthropic client.

Tiny random-weight llama: the reply equals the engine's own greedy run and count_tokens the
prompt it ran; the streamed events build the same message; stop sequences, max_tokens and
the context window as stop reasons; x-api-key auth; bad input as Anthropic's 400 naming the
field. The tool-use round trip runs on tests/test_server_tools.py's tool-calling tiny model.
Slow: SmolLM2-135M names Paris.
"""

from __future__ import annotations

import json
import threading
from typing import Any
from unittest import mock

import anthropic
import httpx
import pytest
from test_server import KEY, LiveServer, sse_events
from test_server_tools import CALL, TOOL_END, TOOL_START, TOOLS, make_tool_model

from mlx_tandem.engine.request import EngineClosed
from mlx_tandem.engine.sampling import SamplingParams
from mlx_tandem.server.anthropic import Blocks

ASK = [{"role": "user", "content": "Stop test"}]  # the tiny llama's greedy reply has no <eos>
A_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]  # fmt: skip


def client(server: LiveServer, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def post(server: LiveServer, body: Any, path: str = "/v1/messages", **headers: str):
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"x-api-key": KEY, "content-type": "application/json", **headers}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60)


def events(server: LiveServer, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a streamed /v1/messages reply."""
    body = {**body, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    names = [line[len("event: ") :] for line in lines if line.startswith("event: ")]
    data = sse_events(lines)
    assert len(names) == len(data) and all(d["type"] == n for n, d in zip(names, data, strict=True))
    return list(zip(names, data, strict=True))


def without_id(message: Any) -> dict[str, Any]:
    out = message.model_dump(exclude={"id"})
    for block in out["content"]:
        block.pop("parsed_output", None)
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("toolu_")
    return out


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(llama):
    live = LiveServer(llama, api_key=KEY, config={"max_rows": 8})
    yield live
    live.stop()


# --- replies ------------------------------------------------------------------------------------


def test_reply_equals_the_engine_and_count_tokens_the_prompt(server, llama):
    c = client(server)
    chat = [{"role": "user", "content": "Hello there"}]
    reasons = []
    for system in (None, "Be brief.", [{"type": "text", "text": "Be brief."}]):
        extra: dict[str, Any] = {"system": system} if system else {}
        text = system if isinstance(system, str) else system and system[0]["text"]
        prompt = llama.encode_messages([{"role": "system", "content": text}] * bool(text) + chat)
        direct = server.engine.submit(prompt, SamplingParams(max_tokens=30)).result()
        r = c.messages.create(model="claude-x", max_tokens=30, messages=chat, **extra)
        assert (r.type, r.role, r.model) == ("message", "assistant", llama.name)
        assert r.id.startswith("msg_") and r.stop_sequence is None
        assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[direct.finish_reason]
        assert [b.type for b in r.content] == ["text"] and r.content[0].text == direct.text
        assert (r.usage.input_tokens, r.usage.output_tokens) == (len(prompt), len(direct.tokens))
        count = c.messages.count_tokens(model="x", messages=chat, **extra)
        assert count.input_tokens == len(prompt)
        reasons.append(r.stop_reason)
    assert reasons[0] == "end_turn"  # the greedy reply to "Hello there" ends with <eos>


def test_stream_builds_the_same_message(server):
    c = client(server)
    ref = c.messages.create(model="x", max_tokens=16, messages=ASK)
    with c.messages.stream(model="x", max_tokens=16, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert without_id(final) == without_id(ref) and text == ref.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16

    seen = events(server, {"model": "x", "max_tokens": 16, "messages": ASK})
    names = [n for n, _ in seen]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = seen[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == ref.usage.input_tokens
    deltas = [d["delta"] for n, d in seen if n == "content_block_delta"]
    assert "".join(d["text"] for d in deltas) == ref.content[0].text
    assert all(d["type"] == "text_delta" for d in deltas)
    end = seen[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"] == {"output_tokens": 16}


def test_stop_sequence_and_max_tokens(server):
    c = client(server)
    full = c.messages.create(model="x", max_tokens=40, messages=ASK).content[0].text
    stop = next(ch for i, ch in enumerate(full) if i >= 3 and ch.isascii() and ch.isalnum())
    cut = full[: full.find(stop)]
    r = c.messages.create(
        model="x", max_tokens=40, messages=ASK, stop_sequences=["never-seen", stop]
    )
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in r.content) == (cut if cut.strip() else "")
    with c.messages.stream(model="x", max_tokens=40, messages=ASK, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert without_id(final) == without_id(r)

    short = c.messages.create(model="x", max_tokens=3, messages=ASK)
    assert (short.stop_reason, short.usage.output_tokens) == ("max_tokens", 3)
    assert short.content[0].text == full[: len(short.content[0].text)]


def test_max_tokens_past_the_context_window_is_cut_to_it(tiny_model):
    live = LiveServer(tiny_model("llama", max_position_embeddings=64), api_key=KEY)
    try:
        c = client(live)
        r = c.messages.create(model="x", max_tokens=8192, messages=ASK)
        assert r.stop_reason == "model_context_window_exceeded"
        assert r.usage.input_tokens + r.usage.output_tokens == 64
        long = [{"role": "user", "content": "word " * 80}]
        with pytest.raises(anthropic.BadRequestError, match="context window"):
            c.messages.create(model="x", max_tokens=5, messages=long)
    finally:
        live.stop()


# --- auth and errors -----------------------------------------------------------------------------


def test_x_api_key_and_anthropic_error_shape_for_auth(server):
    body = {"model": "x", "max_tokens": 2, "messages": ASK}
    r = httpx.post(server.url + "/v1/messages", json=body)
    assert r.status_code == 401
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    assert "api key" in r.json()["error"]["message"].lower()
    assert post(server, body, **{"x-api-key": KEY + "x"}).status_code == 401
    assert post(server, body).status_code == 200
    bearer = {"authorization": f"Bearer {KEY}", "x-api-key": ""}
    assert post(server, body, **bearer).status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        client(server, "wrong").messages.create(model="x", max_tokens=2, messages=ASK)
    # x-api-key works on every route; the OpenAI routes keep OpenAI's error shape
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    openai_401 = httpx.get(server.url + "/v1/models").json()
    assert openai_401["error"]["code"] == "invalid_api_key"
    missing = post(server, body, path="/v1/messages/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_failures_are_anthropic_errors(server):
    c = client(server)

    def closed(*args: Any, **kwargs: Any) -> None:
        raise EngineClosed("the engine is shut down")

    with (
        mock.patch.object(server.engine, "submit", closed),
        pytest.raises(anthropic.OverloadedError) as caught,
    ):
        c.messages.create(model="x", max_tokens=2, messages=ASK)
    assert caught.value.body["error"]["type"] == "overloaded_error"

    core, armed = server.engine.core, threading.Event()
    real_step = core.step

    def failing_step() -> bool:
        if armed.is_set() and core.running:
            armed.clear()
            raise RuntimeError("injected step failure")
        return real_step()

    with mock.patch.object(core, "step", failing_step):
        armed.set()
        with pytest.raises(anthropic.InternalServerError) as failed:
            c.messages.create(model="x", max_tokens=20, messages=ASK)
        assert failed.value.body["error"]["type"] == "api_error"
        armed.set()
        seen = events(server, {"model": "x", "max_tokens": 20, "messages": ASK})
        assert seen[0][0] == "message_start" and seen[-1][0] == "error"
        assert seen[-1][1]["error"]["type"] == "api_error"
        assert "injected" in seen[-1][1]["error"]["message"]
    assert c.messages.create(model="x", max_tokens=2, messages=ASK).usage.output_tokens == 2


MSG = {"model": "x", "max_tokens": 8, "messages": ASK}
BAD = [
    ('{"model": "x", "messages": [', "JSON"),
    ({"model": "x", "messages": ASK}, "max_tokens"),
    ({**MSG, "max_tokens": 0}, "max_tokens"),
    ({**MSG, "temperature": -1}, "temperature"),
    ({**MSG, "temperature": 101}, "temperature"),
    ({**MSG, "top_p": 2}, "top_p"),
    ({**MSG, "top_k": -1}, "top_k"),
    ({**MSG, "stop_sequences": ["a"] * 20}, "stop_sequences"),
    ({**MSG, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking: not a field this server supports"),
    ({**MSG, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "type 'image' is not supported"),
    ({**MSG, "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "z": 1}]}]},
     "messages[0].content[0].z"),
    ({**MSG, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({**MSG, "messages": [*ASK, {"role": "assistant", "content": "The answer"}]},
     "messages[1].role"),
    ({**MSG, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "messages[0].content[0]"),
    ({**MSG, "tools": A_TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({**MSG, "tools": A_TOOLS, "tool_choice": {"type": "any"}}, "tool_choice 'any': this model has no tool"),
    ({**MSG, "tools": A_TOOLS}, "tools: this model has no tool calling"),  # auto, as vLLM
    ({**MSG, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "named"), BAD)
def test_bad_input_is_400_naming_the_field(server, body, named):
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"], error


# --- tools --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    live = LiveServer(make_tool_model(tmp_path_factory.mktemp("tools") / "m"), api_key=KEY)
    yield live
    live.stop()


def test_forced_tool_use_any_and_named(tool_server):
    """tool_choice any / tool: one call, its input following that tool's input_schema."""
    c = client(tool_server)
    ask = [{"role": "user", "content": "Wake me at seven"}]
    alarm = {"name": "set_alarm", "description": "Set an alarm", "input_schema": {
        "type": "object", "additionalProperties": False, "required": ["hour"],
        "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}}}}  # fmt: skip
    tools = [*A_TOOLS, alarm]
    anyone = c.messages.create(model="x", max_tokens=60, messages=ask, tools=tools,
                               tool_choice={"type": "any"})  # fmt: skip
    assert anyone.stop_reason == "tool_use" and anyone.content[0].name == "get_weather"
    named = c.messages.create(model="x", max_tokens=60, messages=ask, tools=tools,
                              tool_choice={"type": "tool", "name": "set_alarm",
                                           "disable_parallel_tool_use": True})  # fmt: skip
    (block,) = named.content
    assert named.stop_reason == "tool_use" and block.name == "set_alarm"
    assert set(block.input) == {"hour"} and 0 <= block.input["hour"] <= 23


def test_disable_parallel_tool_use_keeps_the_first_call(tmp_path_factory):
    server = LiveServer(make_tool_model(tmp_path_factory.mktemp("again") / "m", again=True))
    try:
        c = client(server)
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        many = c.messages.create(model="x", max_tokens=9, messages=ask, tools=A_TOOLS)
        assert [b.type for b in many.content] == ["tool_use"] * 3  # a call, again and again
        one = c.messages.create(model="x", max_tokens=9, messages=ask, tools=A_TOOLS,
                                tool_choice={"type": "auto", "disable_parallel_tool_use": True})
        assert [b.type for b in one.content] == ["tool_use"]
    finally:
        server.stop()


def test_tool_use_round_trip(tool_server):
    c = client(tool_server)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = c.messages.create(model="x", max_tokens=10, messages=ask, tools=A_TOOLS)
    (block,) = r.content
    assert r.stop_reason == "tool_use" and block.type == "tool_use"
    assert block.id.startswith("toolu_") and block.name == "get_weather"
    assert block.input == {"city": "Paris"}
    with c.messages.stream(model="x", max_tokens=10, messages=ask, tools=A_TOOLS) as stream:
        final = stream.get_final_message()
    assert without_id(final) == without_id(r)
    seen = events(tool_server, {"model": "x", "max_tokens": 10, "messages": ask, "tools": A_TOOLS})
    delta = next(d["delta"] for n, d in seen if n == "content_block_delta")
    assert delta["type"] == "input_json_delta" and json.loads(delta["partial_json"]) == block.input

    bare = c.messages.create(model="x", max_tokens=10, messages=ask)  # no tools: plain text
    assert bare.content[0].text == TOOL_START + CALL + TOOL_END and bare.stop_reason == "end_turn"
    none = c.messages.create(
        model="x", max_tokens=10, messages=ask, tools=A_TOOLS, tool_choice={"type": "none"}
    )
    assert none.usage.input_tokens == bare.usage.input_tokens < r.usage.input_tokens

    turns = [
        *ask,
        {"role": "assistant", "content": r.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id, "content": "18 C, sunny"}]},
    ]  # fmt: skip
    count = c.messages.count_tokens(model="x", messages=turns, tools=A_TOOLS).input_tokens
    call = {"id": block.id, "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
    rendered = tool_server.model.encode_messages(
        [*ask, {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": block.id, "content": "18 C, sunny",
          "name": "get_weather"}],
        template_kwargs={"tools": TOOLS},
    )  # fmt: skip
    assert count == len(rendered)
    assert "<|tool|>18 C, sunny" in tool_server.model.tokenizer.decode(rendered)
    again = c.messages.create(model="x", max_tokens=10, messages=turns, tools=A_TOOLS)
    assert again.usage.input_tokens == count and again.content[0].type == "tool_use"


def test_blocks_do_not_depend_on_how_text_was_split():
    call = {"function": {"name": "f", "arguments": '{"a": 1}'}}
    whole = Blocks()
    whole.feed("  ", [])
    whole.feed("Let me check.\n", [call])
    whole.feed("\n  ", [])
    pieces = Blocks()
    for ch in "  Let me check.\n":
        pieces.feed(ch, [])
    pieces.feed("", [call])
    pieces.feed("\n", [])
    pieces.feed("  ", [])
    assert [{k: v for k, v in b.items() if k != "id"} for b in whole.content] == [
        {"type": "text", "text": "  Let me check.\n"},
        {"type": "tool_use", "name": "f", "input": {"a": 1}},
    ]
    assert [b["type"] for b in pieces.content] == ["text", "tool_use"]
    assert pieces.content[0] == whole.content[0]


# --- a real model -----------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_names_paris(real_model):
    live = LiveServer(real_model("smollm2-135m", "float32"), drafter="ngram")
    try:
        c = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        r = c.messages.create(model="smollm2-135m", max_tokens=40, messages=question)
        assert "Paris" in r.content[0].text and r.stop_reason in ("end_turn", "max_tokens")
        with c.messages.stream(model="smollm2-135m", max_tokens=40, messages=question) as s:
            assert s.get_final_message().content[0].text == r.content[0].text
    finally:
        live.stop()
