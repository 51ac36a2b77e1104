"""Structured output through the server: response_format and forced tool calls, live.

Tiny random-weight llama (test_server's fixtures): a json_schema reply parses and validates,
equals the streamed reply and the reply with ngram speculation on; json_object gives an
object; bad schemas and impossible combinations are 400s naming the field. On
test_server_tools' tool-calling tiny model, tool_choice `required` and a named function
give a call whose arguments follow that function's schema, even where the model's own
greedy call names another function.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_constraint import PERSON
from test_server import MSG, LiveServer
from test_server_hostile import post, refused
from test_server_tools import TOOLS, make_tool_model

FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def servers(tiny_model):
    model = tiny_model("llama")
    plain, spec = LiveServer(model), LiveServer(model, drafter="ngram")
    yield plain, spec
    plain.stop()
    spec.stop()


def reply(server, **body):
    body = {"max_tokens": 300, **body}
    r = server.client.chat.completions.create(model="x", messages=MSG, **body)
    return r.choices[0]


def test_json_schema_replies_validate_and_equal_streamed_and_speculative(servers):
    plain, spec = servers
    choice = reply(plain, response_format=FORMAT)
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert reply(spec, response_format=FORMAT).message.content == choice.message.content
    chunks = plain.client.chat.completions.create(
        model="x", messages=MSG, max_tokens=300, response_format=FORMAT, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        choice.message.content
    )
    free = reply(plain).message.content
    assert free != choice.message.content  # the format changed the reply


def test_json_object_and_text_formats(servers):
    plain, _ = servers
    obj = reply(plain, response_format={"type": "json_object"}, max_tokens=40)
    assert obj.message.content.startswith("{")  # a random model's object may not end by 40
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)
    for fmt in ({"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "x"}},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}):
        any_json = reply(plain, response_format=fmt, max_tokens=40)  # no schema: any JSON
        assert any_json.message.content[:1] in set('{["-0123456789tfn')
        if any_json.finish_reason == "stop":
            json.loads(any_json.message.content)
    text = reply(plain, response_format={"type": "text"}, max_tokens=8)
    assert text.message.content == reply(plain, max_tokens=8).message.content


@pytest.mark.parametrize(
    ("fmt", "param", "words"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
         "response_format", "nope"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
         "response_format.json_schema.schema", "schema"),
        ({"type": "yaml"}, "response_format.type", "type"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": False}},
         "response_format", "false"),
    ],
)  # fmt: skip
def test_bad_formats_are_400_naming_the_field(servers, fmt, param, words):
    plain, _ = servers
    err = refused(post(plain, "/v1/chat/completions", {"messages": MSG, "response_format": fmt}), param)
    assert words in err["message"]
    assert plain.wait_idle()


TWO_TOOLS = [
    *TOOLS,
    {"type": "function", "function": {
        "name": "set_alarm", "description": "Set an alarm",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["hour"],
                       "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}}}}},
]  # fmt: skip


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    server = LiveServer(make_tool_model(tmp_path_factory.mktemp("tools") / "m"))
    yield server
    server.stop()


def test_forced_tool_calls_follow_the_named_function_schema(tool_server):
    create = tool_server.client.chat.completions.create
    ask = [{"role": "user", "content": "Wake me at seven"}]
    required = create(model="x", messages=ask, tools=TWO_TOOLS, tool_choice="required", max_tokens=60)
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name == "get_weather"  # the model's own choice, allowed
    named = create(model="x", messages=ask, tools=TWO_TOOLS, max_tokens=60,
                   tool_choice={"type": "function", "function": {"name": "set_alarm"}})  # fmt: skip
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "set_alarm"
    jsonschema.validate(json.loads(call.function.arguments), TWO_TOOLS[1]["function"]["parameters"])


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "give one"),
    ],
)
def test_impossible_tool_choices_are_400(tool_server, extra, words):
    body = {"messages": MSG, "tools": TWO_TOOLS, **extra}
    err = refused(post(tool_server, "/v1/chat/completions", body), "tool_choice")
    assert words in err["message"]


def test_forcing_a_call_on_a_model_without_tool_calling_is_400(servers):
    plain, _ = servers
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": "required"}
    err = refused(post(plain, "/v1/chat/completions", body), "tool_choice")
    assert "no tool calling" in err["message"]
