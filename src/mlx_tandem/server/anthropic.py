"""Anthropic's Messages API on the same engine: POST /v1/messages and /v1/messages/count_tokens.

Owns the Anthropic wire shapes and their translation, both ways. A request (strict
pydantic models: an unknown field or block type — images, documents, thinking, ... — is
a 400 naming it) becomes the OpenAI chat request the rest of the server already serves:
`system` -> a system message; `text`, `tool_use` and `tool_result` blocks -> user,
assistant (with `tool_calls`) and `tool` messages; `tools` -> functions; `tool_choice`
auto/none, and any/tool -> OpenAI's required / named function (one call whose input
follows the tool's schema: jobs.py constrains the reply); `stop_sequences` -> stop. From there prompts.py renders the chat template,
jobs.py checks the options and builds the row (every sampling value through
SamplingParams), responses.py reads it. The row's text and parsed tool calls (tools.py)
come back as `text` and `tool_use` blocks in the order produced — one `Blocks` builds
both the JSON message and the SSE events, so they hold the same blocks. Which stop
sequence ended a row is found in the decoded tokens (the engine reports only "stop").
`max_tokens` past the context window is cut to it, and a row that then runs out says
`model_context_window_exceeded`, as Anthropic does. count_tokens renders the same prompt
and generates nothing. Errors on these routes have Anthropic's shape (`error_response`;
guard.py picks the shape by path): 429 queue full and 503 become 529 overloaded_error.

Not supported (400 naming them): image/document/thinking blocks, a final assistant turn
(prefill). `disable_parallel_tool_use` keeps a reply's first tool call (OpenAI's
`parallel_tool_calls: false`).

Oracle: tests/test_server_anthropic.py (the official anthropic client against a live server).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
)
from pydantic_core import PydanticCustomError

from mlx_tandem.server import schemas as S
from mlx_tandem.server.jobs import build_job, refuse_unsupported
from mlx_tandem.server.prompts import PromptWorkers, chat_prompt
from mlx_tandem.server.responses import Job, Row, merged_events, observe, release, run_job
from mlx_tandem.server.schemas import ApiError, Text
from mlx_tandem.server.state import ServerState

PREFIX = "/v1/messages"
# the OpenAI request's field names that jobs.py reports -> this API's names
PARAMS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}

# --- request ----------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


Cache = dict[str, Any] | None  # `cache_control`: accepted, ignored (no prompt cache here)


class TextBlock(_Strict):
    type: Literal["text"]
    text: Text
    cache_control: Cache = None
    citations: None = None  # a reply's text block sent back as is


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: Text = Field(min_length=1)
    name: Text = Field(min_length=1)
    input: dict[str, Any]
    cache_control: Cache = None
    caller: dict[str, Literal["direct"]] | None = None  # {"type": "direct"}: the model's call


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: Text = Field(min_length=1)
    content: Text | list[TextBlock] = ""
    is_error: bool = False
    cache_control: Cache = None


# block type -> its union tag (capitalised: error locations leave it out, see guard._param)
BLOCK_TAGS = {"text": "Text", "tool_use": "ToolUse", "tool_result": "ToolResult"}


def _block_tag(block: Any) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return BLOCK_TAGS.get(kind) if isinstance(kind, str) else None


Block = Annotated[
    Annotated[TextBlock, Tag("Text")]
    | Annotated[ToolUseBlock, Tag("ToolUse")]
    | Annotated[ToolResultBlock, Tag("ToolResult")],
    Discriminator(
        _block_tag,
        custom_error_type="block_type",
        custom_error_message="a content block is an object with a supported `type`",
    ),
]


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: Text | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, content: Any) -> Any:
        for j, block in enumerate(content if isinstance(content, list) else []):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(block, dict) and kind not in BLOCK_TAGS:
                raise PydanticCustomError(
                    "block_type",
                    "block {j}: type {kind} is not supported (text, tool_use and tool_result are)",
                    {"j": j, "kind": repr(kind)},
                )
        return content


class ToolSpec(_Strict):
    name: str = Field(min_length=1)
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: Cache = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _MessagesBody(_Strict):
    model: str = Field(description="Accepted and ignored: the reply names the model served.")
    messages: list[InputMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(None, description="range: SamplingParams' (0 = greedy)")
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")


class MessagesRequest(_MessagesBody):
    max_tokens: int = Field(ge=1, description="cut to the context window when over it")


class CountTokensRequest(_MessagesBody):
    max_tokens: int | None = Field(None, description="accepted and ignored")


# --- responses (documentation of /openapi.json) -----------------------------------------------


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]] = Field(description="text and tool_use blocks")
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: dict[str, int] = Field(description="input_tokens, output_tokens")


class TokenCount(BaseModel):
    input_tokens: int


class ErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: dict[str, str] = Field(description="type (e.g. invalid_request_error), message")


SSE_NOTE = "With `stream: true`: Anthropic's events, message_start ... message_stop, or `error`."

# --- errors -----------------------------------------------------------------------------------

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
}


def error_kind(status: int) -> tuple[int, str]:
    """(HTTP status, Anthropic error type) for one of this server's statuses."""
    if status in (429, 503):  # queue full, not serving: Anthropic's overloaded (529)
        return 529, "overloaded_error"
    if status >= 500:
        return status, "api_error"
    return status, ERROR_TYPES.get(status, "invalid_request_error")


def error_body(err: ApiError) -> tuple[int, dict[str, Any]]:
    status, kind = error_kind(err.status)
    message = err.message
    if err.param and err.param not in message:
        message = f"{err.param}: {message}"
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def error_response(err: ApiError) -> JSONResponse:
    status, body = error_body(err)
    return JSONResponse(body, status_code=status, headers=err.headers)


# --- request -> the OpenAI chat request --------------------------------------------------------


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _turn(i: int, message: InputMessage, names: dict[str, str]) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages (a user turn's tool results become tool messages)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    allowed = ToolUseBlock if message.role == "assistant" else ToolResultBlock
    for j, block in enumerate(message.content):
        if not isinstance(block, TextBlock | allowed):
            raise ApiError(
                400, f"a {block.type} block cannot be in a {message.role} turn",
                f"messages[{i}].content[{j}]",
            )  # fmt: skip
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            names[block.id] = block.name
            function = {"name": block.name, "arguments": block.input}
            calls.append({"id": block.id, "type": "function", "function": function})
        else:
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            result = ("Error: " if block.is_error else "") + _text(block.content)
            tool = {"role": "tool", "tool_call_id": block.tool_use_id, "content": result}
            if block.tool_use_id in names:
                tool["name"] = names[block.tool_use_id]
            out.append(tool)
    if message.role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        return [{**turn, "tool_calls": calls}] if calls else [turn]
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def to_chat(body: _MessagesBody) -> S.ChatCompletionRequest:
    """The OpenAI chat request that serves this Anthropic request (refusals name the field)."""
    choice, openai_choice = body.tool_choice, None
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise ApiError(400, "tool_choice of type 'tool' needs the tool's name", "tool_choice.name")
        forced = {"any": "required", "tool": {"type": "function", "function": {"name": choice.name}}}
        openai_choice = forced.get(choice.type, choice.type)
    last = len(body.messages) - 1
    if body.messages[last].role == "assistant":
        raise ApiError(
            400, "a final assistant turn (prefill) is not supported: end with a user turn",
            f"messages[{last}].role", code="unsupported_parameter",
        )  # fmt: skip
    messages = [{"role": "system", "content": _text(body.system)}] if body.system else []
    names: dict[str, str] = {}
    for i, message in enumerate(body.messages):
        messages += _turn(i, message, names)
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description,
                                          "parameters": t.input_schema}}
        for t in body.tools or []
    ]  # fmt: skip
    one_call = bool(choice and choice.disable_parallel_tool_use)  # forced calls are one anyway
    fields = {"messages": messages, "stop": body.stop_sequences, "stream": body.stream,
              "tools": tools or None, "tool_choice": openai_choice,
              "parallel_tool_calls": False if one_call else None,
              **body.model_dump(include={"temperature", "top_p", "top_k"})}  # fmt: skip
    data = json.dumps({k: v for k, v in fields.items() if v is not None}, ensure_ascii=False)
    try:
        return S.ChatCompletionRequest.model_validate_json(data)
    except ValidationError as err:  # a sampling value outside its knob's range
        first = err.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else None
        param = PARAMS.get(name or "", name)
        raise ApiError(400, f"{param}: {first['msg']}", param) from None


def _renamed(err: ApiError) -> ApiError:
    if err.param:
        head, dot, rest = err.param.partition(".")
        err.param = PARAMS.get(head, head) + dot + rest
    return err


# --- rows -> content blocks, JSON and SSE --------------------------------------------------------


def _event(name: str, **data: Any) -> tuple[str, dict[str, Any]]:
    return name, {"type": name, **data}


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """A parsed tool call (tools.format_call's shape) as a `tool_use` content block."""
    function = call["function"]
    try:
        value = json.loads(function.get("arguments") or "{}")
    except ValueError:
        value = function.get("arguments")
    arguments = value if isinstance(value, dict) else {"arguments": value}  # input is an object
    name = str(function.get("name", ""))
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": name,
            "input": arguments}  # fmt: skip


class Blocks:
    """Text and tool calls, as produced -> content blocks, and the SSE events that build them.

    A text block opens at the first text that is not only whitespace (it then starts with
    the whitespace held before it); whitespace that never reaches a block, such as a line
    break before a tool call, is dropped. The blocks do not depend on how the text was split
    into deltas, so the JSON reply and the stream hold the same blocks.
    """

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self.text_open = False
        self.pending = ""

    def feed(self, text: str, calls: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if text and not self.text_open:
            text, self.pending = self.pending + text, ""
            if text.strip():
                self.text_open = True
                self.content.append({"type": "text", "text": ""})
                block = {"type": "text", "text": ""}
                events.append(_event("content_block_start", index=self.last, content_block=block))
            else:
                self.pending, text = text, ""
        if text:
            self.content[-1]["text"] += text
            delta = {"type": "text_delta", "text": text}
            events.append(_event("content_block_delta", index=self.last, delta=delta))
        for call in calls:
            events += self.close()
            self.pending = ""
            block = tool_use_block(call)
            self.content.append(block)
            partial = json.dumps(block["input"], ensure_ascii=False)
            events += [
                _event("content_block_start", index=self.last, content_block={**block, "input": {}}),
                _event("content_block_delta", index=self.last,
                       delta={"type": "input_json_delta", "partial_json": partial}),
                _event("content_block_stop", index=self.last),
            ]  # fmt: skip
        return events

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        if not self.text_open:
            return []
        self.text_open = False
        return [_event("content_block_stop", index=self.last)]

    @property
    def last(self) -> int:
        return len(self.content) - 1


@dataclass
class Reply:
    """What shaping an Anthropic reply needs beyond the Job."""

    id: str
    stops: tuple[str, ...]
    clamped: bool  # max_tokens was cut to the context window

    def stop(self, state: ServerState, row: Row) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of a finished row."""
        if row.finish == "tool_calls":
            return "tool_use", None
        if row.finish == "length":
            return ("model_context_window_exceeded" if self.clamped else "max_tokens"), None
        if self.stops:  # a stop string cuts the text: find it in the tokens' whole text
            text = state.model.tokenizer.decode(row.ids)
            found = [(at, len(s), s) for s in self.stops if (at := text.find(s)) >= 0]
            if found:
                return "stop_sequence", min(found)[2]
        return "end_turn", None

    def message(
        self, state: ServerState, job: Job, content: list[dict[str, Any]], done: bool
    ) -> dict[str, Any]:
        row = job.rows[0]
        reason, sequence = self.stop(state, row) if done else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": state.options.model_id,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": len(job.prompts[0]), "output_tokens": row.tokens},
        }


def _unfinished(row: Row) -> ApiError | None:
    if row.finish == "error":
        return ApiError(500, row.error or "generation failed", None, "server_error")
    if row.finish == "cancelled":
        return ApiError(503, "the server stopped this reply (shutting down)", None, "server_error")
    return None


def message_body(state: ServerState, job: Job, reply: Reply) -> dict[str, Any]:
    row = job.rows[0]
    failed = _unfinished(row)
    if failed is not None:
        raise failed
    blocks = Blocks()
    for part in row.parts:
        text, calls = (part, []) if isinstance(part, str) else ("", [part])
        blocks.feed(text, calls)
    return reply.message(state, job, blocks.content, done=True)


def _sse(event: tuple[str, dict[str, Any]]) -> str:
    return f"event: {event[0]}\ndata: {json.dumps(event[1], ensure_ascii=False)}\n\n"


async def message_events(state: ServerState, job: Job, reply: Reply) -> AsyncIterator[str]:
    row, blocks = job.rows[0], Blocks()
    try:
        start = reply.message(state, job, [], done=False)
        yield _sse(_event("message_start", message=start))
        yield _sse(_event("ping"))
        async for _, out in merged_events(job.handles):
            content, calls = observe(state, row, out, True)
            for event in blocks.feed(content, calls):
                yield _sse(event)
        failed = _unfinished(row)
        if failed is not None:
            yield _sse(("error", error_body(failed)[1]))
            return
        for event in blocks.close():
            yield _sse(event)
        reason, sequence = reply.stop(state, row)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield _sse(_event("message_delta", delta=delta, usage={"output_tokens": row.tokens}))
        yield _sse(_event("message_stop"))
    finally:
        release(state, job.handles, job.rows)


# --- routes -----------------------------------------------------------------------------------


def install(app: FastAPI, state: ServerState, workers: PromptWorkers) -> None:
    """Register POST /v1/messages and /v1/messages/count_tokens on the app."""
    err = {"model": ErrorResponse}
    codes = {code: err for code in (400, 401, 404, 408, 413, 500, 529)}
    sse = {"text/event-stream": {"schema": {"type": "string", "description": SSE_NOTE}}}

    @app.post(PREFIX, responses={200: {"model": MessageResponse, "content": sse}, **codes})
    async def messages(body: MessagesRequest, request: Request) -> Response:
        chat = to_chat(body)
        prompt = await chat_prompt(state, workers, chat)
        room = state.model.context_length - len(prompt)
        if room < 1:
            raise ApiError(400, f"prompt ({len(prompt)} tokens) fills the context window",
                           "messages")  # fmt: skip
        forced = body.tool_choice.type if body.tool_choice else None
        if forced in ("any", "tool") and body.tools and state.tools is None:
            raise ApiError(400, f"tool_choice {forced!r}: this model has no tool calling",
                           "tool_choice", code="unsupported_parameter")  # fmt: skip
        limit = min(body.max_tokens, room)
        chat = chat.model_copy(update={"max_tokens": limit})
        try:
            refuse_unsupported(chat)
            job = build_job(state, chat, [prompt], chat=True)
        except ApiError as e:
            raise _renamed(e) from None
        reply = Reply(f"msg_{uuid.uuid4().hex[:24]}", tuple(body.stop_sequences or ()),
                      limit < body.max_tokens)  # fmt: skip
        shape, events = partial(message_body, reply=reply), partial(message_events, reply=reply)
        return await run_job(state, request, job, shape, events)

    @app.post(f"{PREFIX}/count_tokens", response_model=TokenCount, responses=codes)
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        prompt = await chat_prompt(state, workers, to_chat(body))
        return {"input_tokens": len(prompt)}
