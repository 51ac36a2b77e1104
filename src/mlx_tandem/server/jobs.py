"""A validated request body + its prompts -> engine rows (a Job), or a 4xx/5xx naming why not.

Owns the request-side rules that pydantic cannot state: options this server does not
implement (refused by name unless they ask for the default), `tool_choice` and tool
messages, what the reply must match (`response_format`, or a forced tool call: the
engine's Grammar, engine/constraint.py), `n` against what the engine's queue can ever hold (400, not 429), the
context window, logit_bias token ids, and each choice's SamplingParams: the server's
defaults (`ServerOptions.defaults`) overridden by the request's fields, read through
SamplingParams' knobs (wire names) — nothing is listed twice. A SamplingParams that
refuses a value raises InvalidParameter; its `field` becomes the error's `param`.
Submission refusals: QueueFull -> 429 + Retry-After, EngineClosed (or any RuntimeError
from a closed engine) -> 503, ValueError -> 400; rows already queued are withdrawn.

Oracle: tests/test_server.py and tests/test_server_hostile.py (each refusal's status
and `param`).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from mlx_tandem.engine.request import RequestHandle
from mlx_tandem.engine.sampling import (
    MAX_SEED,
    Grammar,
    InvalidParameter,
    SamplingParams,
    bias_from_json,
    knobs,
)
from mlx_tandem.engine.scheduler import QueueFull
from mlx_tandem.server import schemas as S
from mlx_tandem.server.responses import Job, Row
from mlx_tandem.server.schemas import ApiError
from mlx_tandem.server.state import ServerState
from mlx_tandem.server.tools import ToolCallStream, forced_call_grammar


def refuse_unsupported(body: S.SamplingFields) -> None:
    for name, default in S.UNSUPPORTED.items():
        value = getattr(body, name, None)
        if value is not None and value != default:
            raise ApiError(
                400, f"{name} is not supported by this server", name, code="unsupported_parameter"
            )
    if isinstance(body, S.ChatCompletionRequest):
        choice = body.tool_choice
        if choice is not None and choice not in ("none", "auto"):
            if not body.tools:
                raise ApiError(400, f"tool_choice {_choice_name(choice)} needs tools", "tool_choice")
            if body.response_format is not None and body.response_format.type != "text":
                raise ApiError(
                    400, f"tool_choice {_choice_name(choice)} and response_format both "
                    "constrain the reply; give one", "tool_choice",
                )  # fmt: skip
        for i, message in enumerate(body.messages):
            if message.role == "tool" and not message.tool_call_id:
                raise ApiError(
                    400, "a tool message needs the tool_call_id it answers",
                    f"messages[{i}].tool_call_id",
                )  # fmt: skip


def _choice_name(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.get('name')!r}"


def _wire_name(field: str) -> str:
    if field == "grammar":
        return "response_format"
    knob = knobs().get(field)
    return knob[0].wire[0] if knob and knob[0].wire else field


def request_values(body: S.SamplingFields, vocab: int) -> dict[str, Any]:
    """The request's sampling fields as SamplingParams keyword arguments (knob by knob)."""
    values: dict[str, Any] = {}
    for name, (k, _) in knobs().items():
        given = [(w, getattr(body, w, None)) for w in k.wire]
        wire, value = next(((w, v) for w, v in given if v is not None), (None, None))
        if wire is None:
            continue
        if k.kind == "bias":
            value = _logit_bias(value, vocab)
        elif k.kind == "strings":
            value = tuple([value] if isinstance(value, str) else value)
        elif k.kind == "ids":
            value = tuple(value)
        values[name] = value  # SamplingParams reads a knob's `off` value as off
    return values


def reply_grammar(state: ServerState, body: S.ChatCompletionRequest) -> Grammar | None:
    """What the reply must match: a forced tool call (tool_choice `required` or a named
    function) or OpenAI's response_format (None for text). Schemas themselves are checked
    when the engine compiles them (a 400 naming response_format)."""
    choice = body.tool_choice
    if body.tools and choice in (None, "auto") and state.tools is None:
        raise ApiError(  # vLLM refuses it too: the model would never see a usable tool
            400, "tools: this model has no tool calling (its tokenizer declares no tool-call "
            "markers), so it could not call them; send no tools or tool_choice 'none'",
            "tools", code="unsupported_parameter",
        )  # fmt: skip
    if body.tools and choice is not None and choice not in ("none", "auto"):
        if state.tools is None:
            raise ApiError(
                400, f"tool_choice {_choice_name(choice)}: this model has no tool calling",
                "tool_choice", code="unsupported_parameter",
            )  # fmt: skip
        name = None if isinstance(choice, str) else choice.function.get("name")
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        try:
            return forced_call_grammar(state.model.tokenizer, tools, name)
        except ValueError as err:
            raise ApiError(400, f"tool_choice: {err}", "tool_choice") from None
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar("json_object")
    schema = fmt.json_schema.json_schema if fmt.json_schema is not None else True
    return Grammar("json_schema", json.dumps(schema))


def _logit_bias(bias: dict[str, float], vocab: int) -> dict[int, float]:
    try:
        out = bias_from_json(bias)
    except InvalidParameter as err:
        raise ApiError(400, f"logit_bias: {err}", "logit_bias") from None
    outside = next((token for token in out if token >= vocab), None)
    if outside is not None:
        raise ApiError(400, f"logit_bias token {outside} is outside the vocabulary", "logit_bias")
    return out


def choice_params(
    state: ServerState,
    overrides: dict[str, Any],
    prompt_len: int,
    max_tokens: tuple[str, int | None],
    logprobs: int,
    choice: int,
    prompt_field: str,
) -> SamplingParams:
    """One choice's parameters: request fields over server defaults, seeds seed + choice
    (past the largest seed wrapped by 2^64: seeds are taken mod 2^64, so the same key)."""
    context = state.model.context_length
    name, explicit = max_tokens
    if explicit is not None:
        if prompt_len + explicit > context:
            raise ApiError(
                400,
                f"prompt ({prompt_len} tokens) + {name} ({explicit}) exceeds the model's "
                f"context window ({context} tokens)",
                name,
            )
        limit = explicit
    else:
        limit = min(state.options.defaults.max_tokens, context - prompt_len)
        if limit < 1:
            raise ApiError(400, f"prompt ({prompt_len} tokens) fills the context window "
                           f"({context} tokens)", prompt_field)
    values = {**overrides, "max_tokens": limit, "logprobs": logprobs}
    if values.get("seed") is not None:
        values["seed"] += choice
        if values["seed"] > MAX_SEED:
            values["seed"] -= 1 << 64
    try:
        return dataclasses.replace(state.options.defaults, **values)
    except InvalidParameter as err:
        param = name if err.field == "max_tokens" else _wire_name(err.field)
        raise ApiError(400, str(err), param) from None


def submit_all(
    state: ServerState, prompts: list[list[int]], params: list[SamplingParams], prefix: str
) -> list[RequestHandle]:
    """Submit every choice; on any refusal cancel the ones already queued and raise."""
    if not state.serving:
        raise ApiError(503, "the server is not serving", None, "server_error", "unavailable")
    handles: list[RequestHandle] = []
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            handles.append(state.engine.submit(prompt, p, request_id=f"{prefix}-{i}"))
    except QueueFull as err:
        _withdraw(handles)
        retry = {"Retry-After": str(state.options.retry_after_s)}
        raise ApiError(429, str(err), None, "rate_limit_error", "queue_full", retry) from None
    except InvalidParameter as err:
        _withdraw(handles)
        param = _wire_name(err.field)
        message = str(err) if param in str(err) else f"{param}: {err}"
        raise ApiError(400, message, param) from None
    except ValueError as err:  # the engine's own refusal (e.g. over the KV budget)
        _withdraw(handles)
        raise ApiError(400, str(err)) from None
    except RuntimeError:  # EngineClosed: shut down, or failed for good
        _withdraw(handles)
        raise ApiError(
            503, "the engine is not serving", None, "server_error", "unavailable"
        ) from None
    state.track(handles)
    for prompt in prompts:
        state.metrics.record_prompt(len(prompt))
    return handles


def _withdraw(handles: list[RequestHandle]) -> None:
    for h in handles:
        h.cancel()


def build_job(
    state: ServerState,
    body: S.SamplingFields,
    prompts: list[list[int]],
    chat: bool,
    echo_texts: list[str] | None = None,
) -> Job:
    rows = len(prompts) * body.n
    if rows > S.MAX_N:
        raise ApiError(400, f"prompts x n is {rows}; at most {S.MAX_N}", "n")
    queue = state.engine.config.max_queue
    if rows > queue:
        raise ApiError(
            400, f"prompts x n is {rows} rows; this server queues at most {queue} at once", "n"
        )
    if chat:
        assert isinstance(body, S.ChatCompletionRequest)
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        k = (body.top_logprobs or 0) if body.logprobs else None
        explicit = body.max_completion_tokens or body.max_tokens
        name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        tools = state.tools if body.tools and body.tool_choice != "none" else None
        echo = [""] * rows
    else:
        assert isinstance(body, S.CompletionRequest)
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs (prompt logprobs) is not supported", "echo")
        k, explicit, name, tools = body.logprobs, body.max_tokens, "max_tokens", None
        texts = echo_texts if body.echo and echo_texts else [""] * len(prompts)
        echo = [t for t in texts for _ in range(body.n)]
    engine_k = 0 if k is None else max(1, k)
    overrides = request_values(body, state.model.graph.vocab_size)
    if chat:
        overrides["grammar"] = reply_grammar(state, body)
    every = [p for p in prompts for _ in range(body.n)]
    params = [
        choice_params(state, overrides, len(p), (name, explicit), engine_k, c % body.n,
                      "messages" if chat else "prompt")
        for c, p in enumerate(every)
    ]
    prefix = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    tool_args = None
    if tools is not None and isinstance(body, S.ChatCompletionRequest) and body.tools:
        tool_args = [t.model_dump(exclude_none=True) for t in body.tools]
    handles = submit_all(state, every, params, prefix)
    one_call = chat and getattr(body, "parallel_tool_calls", None) is False
    row_states = [
        Row(i, ToolCallStream(*tools, tool_args) if tools is not None else None,
            max_calls=1 if one_call else None)
        for i in range(len(every))
    ]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Job(chat, prompts, handles, row_states, k, echo, body.stream, include_usage, prefix)
