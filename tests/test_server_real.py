"""The server on real SmolLM2-135M-Instruct (from PyPI), live, through the official openai client.

Speculation is on (prompt lookup): the answer to the capital question names Paris;
streamed text equals the JSON answer; a request that turns speculation off for itself
(`num_draft_tokens: 0`) gets the same greedy text; concurrent requests equal each alone;
seeded sampling repeats. Tool calls are not tested here: SmolLM2's chat template has no
tool support (no `tools` variable, no tool-call markers), so mlx-lm infers no tool parser
for it; the tool-call round trip runs in tests/test_server.py on a tiny model whose
template and weights call a tool.
"""

from __future__ import annotations

import asyncio

import pytest
from test_server import LiveServer, chat, streamed_text, token_name

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def server(real_model):
    model = real_model("smollm2-135m", "float32")
    assert not model.tokenizer.has_tool_calling
    live = LiveServer(model, drafter="ngram", config={"max_rows": 8})
    yield live
    live.stop()


def test_capital_of_france(server):
    r = chat(server, "What is the capital of France?", max_tokens=40)
    assert "Paris" in r.choices[0].message.content
    assert r.model == "smollm2-135m" and r.usage.completion_tokens > 0
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_completion_continues_its_prompt_and_its_logprobs_locate_its_tokens(server):
    """The text after "... is" keeps its leading space (echoed: prompt + that text); each
    token's text sits at its offset, streamed or not; logprobs' bytes join to the text's."""
    prompt = "The capital of France is"
    kw = {"model": "x", "prompt": prompt, "max_tokens": 8}
    one = server.client.completions.create(logprobs=1, **kw).choices[0]
    chunks = list(server.client.completions.create(logprobs=1, stream=True, **kw))
    streamed = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert "".join(c.choices[0].text for c in chunks) == one.text
    assert streamed == one.logprobs.text_offset and one.text.startswith(" ")
    for token, offset in zip(one.logprobs.tokens, one.logprobs.text_offset, strict=True):
        assert one.text[offset : offset + len(token)] == token
    assert server.client.completions.create(echo=True, **kw).choices[0].text == prompt + one.text
    r = chat(server, "Reply with only these emoji: 🐉🔥🌊 and the word 日本語", max_tokens=16,
             logprobs=True)
    joined = b"".join(bytes(item.bytes) for item in r.choices[0].logprobs.content)
    assert joined.decode("utf-8", "replace") == r.choices[0].message.content
    split = [item for item in r.choices[0].logprobs.content if item.token.startswith("bytes:")]
    assert split and all(item.token == token_name(bytes(item.bytes)) for item in split)


def test_streaming_equals_json_and_speculation_off_per_request(server):
    for question in QUESTIONS[:2]:
        ref = chat(server, question, max_tokens=40).choices[0].message.content
        chunks = list(chat(server, question, max_tokens=40, stream=True))
        assert streamed_text(chunks) == ref
        off = chat(server, question, max_tokens=40, extra_body={"num_draft_tokens": 0})
        assert off.choices[0].message.content == ref
    prompt = "The capital of France is"
    ref = server.client.completions.create(model="x", prompt=prompt, max_tokens=16)
    chunks = list(
        server.client.completions.create(model="x", prompt=prompt, max_tokens=16, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == ref.choices[0].text
    assert server.metrics()['tandem_spec_drafted_tokens_total{drafter="ngram"}'] > 0


def test_concurrent_requests_equal_each_alone(server):
    alone = [chat(server, q, max_tokens=24).choices[0].message.content for q in QUESTIONS]

    async def together() -> list[str]:
        client = server.async_client()

        async def one(q: str) -> str:
            messages = [{"role": "user", "content": q}]
            stream = await client.chat.completions.create(
                model="x", messages=messages, max_tokens=24, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        try:
            return list(await asyncio.gather(*(one(q) for q in QUESTIONS)))
        finally:
            await client.close()

    assert asyncio.run(together()) == alone


def test_seeded_sampling_repeats(server):
    kw = {"max_tokens": 16, "temperature": 0.8, "seed": 11}
    a = chat(server, "Tell me a short story.", **kw).choices[0].message.content
    b = chat(server, "Tell me a short story.", **kw).choices[0].message.content
    many = chat(server, "Tell me a short story.", n=2, **kw)
    assert a == b == many.choices[0].message.content
