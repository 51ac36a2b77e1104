"""Pydantic models of the OpenAI-compatible API: what a request may carry, what a response holds.

Owns the wire shapes of /v1/chat/completions, /v1/completions, /v1/models and the
OpenAI error object. The sampling fields are not listed here: `SamplingFields` is built
from SamplingParams' knobs (engine/sampling.py: wire names, ranges, help). Checks, at the
HTTP boundary and before any engine state is touched: strict types (no coercion: `"4"`,
`true` or `4.0` is not an integer, a string is not a number, `[true]` is not token ids),
ranges, non-finite numbers, text that is valid Unicode (no lone surrogates), content
parts of type "text" only, at least one message. Field names follow OpenAI and
mlx_lm.server (num_draft_tokens, repetition_penalty, top_k, min_p, chat_template_kwargs
are mlx-lm's extensions). Unknown fields are ignored, as both of them do; the known
options this server does not implement are declared (so they are not ignored) and
refused by the handlers (server/jobs.py). The response models document /openapi.json;
the handlers build the same shapes as plain dicts.

Oracle: tests/test_server.py (every field's bad values give 400 naming the field).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model

from mlx_tandem.engine.sampling import MAX_TOP_LOGPROBS, knobs

MAX_N = 16  # rows one HTTP request may ask for


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode (a lone surrogate such as \\ud800)") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


def _sampling_field(kind: str, lo: float | None, hi: float | None, help_: str) -> tuple:
    bounds = {"ge": lo, "le": hi}
    if kind == "int":
        return int | None, Field(None, description=help_, **bounds)
    if kind == "float":
        return float | None, Field(None, description=help_, **bounds)
    if kind == "bias":
        value = Annotated[float, Field(ge=lo, le=hi)]
        return dict[str, value] | None, Field(None, description=help_)
    if kind == "strings":
        return Text | list[Text] | None, Field(None, description=help_)
    if kind == "ids":
        ids = list[Annotated[int, Field(ge=0)]]
        return ids | None, Field(None, description=help_, max_length=int(hi) if hi else None)
    if kind == "bool":
        return bool | None, Field(None, description=help_)
    raise ValueError(f"no wire shape for knob kind {kind!r}")


def _sampling_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for k, _ in knobs().values():
        lo = k.lo if k.off is None or k.lo is None else min(k.lo, k.off)
        for wire in k.wire:
            fields[wire] = _sampling_field(k.kind, lo, k.hi, k.help)
    return fields


_SamplingKnobs = create_model(  # the request fields of every SamplingParams knob with a wire name
    "SamplingKnobs", __base__=_Body, **_sampling_fields()
)


_UNSUPPORTED = "not supported: refused (400) unless it asks for the default behaviour"

# The options this server does not implement, and the one value of each that asks for
# nothing (the default behaviour), which is accepted.
UNSUPPORTED: dict[str, Any] = {
    "best_of": 1,
    "suffix": "",
    "xtc_probability": 0.0,  # mlx_lm.server's XTC sampling (its threshold acts only with it)
}


class SamplingFields(_SamplingKnobs):  # type: ignore[misc, valid-type]
    """Fields shared by chat and text completions (OpenAI names, plus mlx_lm.server's)."""

    model: str | None = Field(
        None, description="Accepted and ignored: the server answers with the model it serves."
    )
    n: int = Field(1, ge=1, le=MAX_N, description="choices: separate rows, seeds seed, seed+1, ...")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    xtc_probability: Any = Field(None, description=_UNSUPPORTED)


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ToolCallFunction(_Body):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(_Body):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")  # extra keys reach the chat template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Text | None = None


class FunctionSpec(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: dict[str, Any]


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(
        True, alias="schema", description="the JSON schema the reply must follow (default: any JSON)"
    )
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="wins over max_tokens")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="none | auto | required | a named function (the reply is then one call "
        "whose arguments follow the function's schema)",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="extra chat-template variables; `add_generation_prompt` (default true) "
        "is honoured; `chat_template` only when the server allows request templates",
    )
    response_format: ResponseFormat | None = Field(
        None,
        description="text | json_object | json_schema: the reply is constrained to it "
        "(enforced per token, with speculation on)",
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one tool call per reply (later ones are dropped)"
    )


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[int] | list[list[int]] = Field(
        description="text, several texts, token ids, or several lists of token ids"
    )
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: Any = Field(None, description=_UNSUPPORTED)
    suffix: Any = Field(None, description=_UNSUPPORTED)


# --- responses (documentation of /openapi.json) ---------------------------------------------


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = Field(
        description="speculative draft tokens the target accepted (OpenAI's Predicted Outputs field)"
    )
    rejected_prediction_tokens: int = Field(description="speculative draft tokens it rejected")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = Field(None, description="stop | length | tool_calls")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlx-tandem"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]


SSE_NOTE = (
    "With `stream: true` the body is `text/event-stream`: `data: {chunk}` events "
    "(object `chat.completion.chunk` / `text_completion`), then `data: [DONE]`."
)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind, self.code, self.headers = kind, code, headers


def error_response(err: ApiError) -> JSONResponse:
    body = {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}
    return JSONResponse({"error": body}, status_code=err.status, headers=err.headers)
