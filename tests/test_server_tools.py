"""The server with a tool-calling tiny model, and schemathesis fuzzing of /openapi.json (zero 5xx)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from test_server import EOS, LiveServer, streamed_text

from mlx_tandem.models.loader import LoadedModel, load_folder
from mlx_tandem.models.tiny import make_tiny_model, tiny_tokenizer

# --- tools -------------------------------------------------------------------------------------------

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'
TOOL_TEMPLATE = (
    "{% if tools %}{{ '<tools>' + (tools | tojson) + '</tools>' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.tool_calls %}{% for tool_call in m.tool_calls %}"
    "{{ '<|assistant|><tool_call>' + ({'name': tool_call.function.name, "
    "'arguments': tool_call.function.arguments} | tojson) + '</tool_call>' }}"
    "{% endfor %}{% else %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def make_tool_model(folder: Path, again: bool = False) -> LoadedModel:
    """A tiny llama whose greedy answer to any chat is one tool call, then <eos> (`again`:
    another call after each call, until max_tokens).

    Three added tokens (the two markers and the call's JSON); attention and MLP outputs
    are zeroed so the last hidden state is the input token's embedding, and embeddings
    and lm_head form the bigram chain <|assistant|> -> <tool_call> -> CALL ->
    </tool_call> -> <eos>. tokenizer_config names mlx-lm's json_tools parser.
    """
    tok = tiny_tokenizer()
    tok.add_tokens([TOOL_START, TOOL_END, CALL])
    make_tiny_model("llama", folder, vocab_size=tok.get_vocab_size())
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(chat_template=TOOL_TEMPLATE, tool_parser_type="json_tools")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    weights = dict(mx.load(str(folder / "model.safetensors")))
    chain = [tok.token_to_id(t) for t in ("<|assistant|>", TOOL_START, CALL, TOOL_END)]
    chain.append(chain[1] if again else EOS)
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    basis = mx.eye(embed.shape[1])
    head[:, : len(chain)] = 0.0
    for nxt in chain[1:]:
        head[nxt] = 0.0
    for i, (token, nxt) in enumerate(itertools.pairwise(chain)):
        embed[token] = basis[i]
        head[nxt] = head[nxt] + 10.0 * basis[i]  # `again`: <tool_call> follows two tokens
    for name in weights:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, head
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return load_folder(folder, name="tiny-tools")


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    model = make_tool_model(tmp_path_factory.mktemp("tools") / "m")
    assert model.tokenizer.has_tool_calling
    server = LiveServer(model)
    yield server
    server.stop()


def test_tool_call_round_trip(tool_server):
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    create = tool_server.client.chat.completions.create
    r = create(model="x", messages=ask, tools=TOOLS, max_tokens=10)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    bare = create(model="x", messages=ask, max_tokens=10)  # no tools: text, not parsed
    assert bare.choices[0].message.content == TOOL_START + CALL + TOOL_END
    assert bare.choices[0].finish_reason == "stop" and not bare.choices[0].message.tool_calls
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens  # the tools reached the template
    none = create(model="x", messages=ask, tools=TOOLS, tool_choice="none", max_tokens=10)
    assert (
        none.usage.prompt_tokens == bare.usage.prompt_tokens
        and not none.choices[0].message.tool_calls
    )

    chunks = list(create(model="x", messages=ask, tools=TOOLS, max_tokens=10, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris"}
    assert streamed_text(chunks) == "" and chunks[-1].choices[0].finish_reason == "tool_calls"

    answer = [
        *ask,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    again = create(model="x", messages=answer, tools=TOOLS, max_tokens=10)
    assert again.usage.prompt_tokens > r.usage.prompt_tokens + len(CALL) // 4
    assert again.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_parallel_tool_calls_false_keeps_the_first_call(tmp_path_factory):
    model = make_tool_model(tmp_path_factory.mktemp("tools") / "m", again=True)
    server = LiveServer(model)
    try:
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        create = server.client.chat.completions.create
        many = create(model="x", messages=ask, tools=TOOLS, max_tokens=9)
        assert len(many.choices[0].message.tool_calls) == 3  # a call, again and again
        for parallel in (False, True):
            one = create(model="x", messages=ask, tools=TOOLS, max_tokens=9,
                         parallel_tool_calls=parallel)
            assert len(one.choices[0].message.tool_calls) == (3 if parallel else 1)
        chunks = list(create(model="x", messages=ask, tools=TOOLS, max_tokens=9,
                             parallel_tool_calls=False, stream=True))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]
    finally:
        server.stop()


# --- fuzzing ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_server(tiny_model):
    server = LiveServer(tiny_model("llama", max_position_embeddings=64), config={"max_rows": 16})
    yield server
    server.stop()


def test_openapi_fuzz_has_no_5xx(small_server):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    doc = httpx.get(small_server.url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= set(
        doc["paths"]
    )
    assert "ChatCompletionRequest" in doc["components"]["schemas"]
    schema = schemathesis.openapi.from_url(small_server.url + "/openapi.json")
    cases = st.one_of(
        schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE)
    )
    seen: dict[int, int] = {}

    @settings(
        max_examples=100,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def check(case):
        response = case.call(base_url=small_server.url, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])

    check()
    assert any(code == 200 for code in seen) and any(code == 400 for code in seen), seen
    assert small_server.wait_idle()
