"""Pydantic models of the OpenAI-compatible API: what a request may carry, what a response holds.

Owns the wire shapes of /v1/chat/completions, /v1/completions, /v1/models and the
OpenAI error object. Checks, at the HTTP boundary and before any engine state is
touched: field types and ranges (temperature >= 0, top_p in [0, 1], penalties in
[-2, 2], n in [1, MAX_N], top_logprobs in [0, 20], ...), non-finite numbers, content
parts of type "text" only, at least one message. Field names follow OpenAI and
mlx_lm.server (num_draft_tokens, repetition_penalty, top_k, min_p, chat_template_kwargs
are mlx-lm's extensions). Unknown fields are ignored, as both of them do. The response
models document /openapi.json; the handlers build the same shapes as plain dicts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # rows one HTTP request may ask for
MAX_TOP_LOGPROBS = 20
MAX_STOP = 16
MAX_DRAFT = 64
MAX_SEED = (1 << 64) - 1

Number = float


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Fields shared by chat and text completions (OpenAI names, plus mlx_lm.server's)."""

    model: str | None = Field(
        None, description="Accepted and ignored: the server answers with the model it serves."
    )
    max_tokens: int | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0.0, le=100.0)
    top_p: Number | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: Number | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Number | None = Field(
        None, ge=0.0, le=100.0, description="mlx-lm's multiplicative penalty; 0 or 1 turns it off"
    )
    repetition_context_size: int | None = Field(None, ge=1, le=1 << 20)
    presence_context_size: int | None = Field(None, ge=1, le=1 << 20)
    frequency_context_size: int | None = Field(None, ge=1, le=1 << 20)
    logit_bias: dict[str, Annotated[Number, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100]"
    )
    seed: int | None = Field(None, ge=-(1 << 63), le=MAX_SEED)
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOP} stop strings")
    n: int = Field(1, ge=1, le=MAX_N, description="choices: separate rows, seeds seed, seed+1, ...")
    stream: bool = False
    stream_options: StreamOptions | None = None
    num_draft_tokens: int | None = Field(
        None, ge=0, le=MAX_DRAFT, description="cap on drafted tokens per step; 0 = no speculation"
    )
    user: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


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
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="wins over max_tokens")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, several texts, token ids, or several lists of token ids"
    )
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


# --- responses (documentation of /openapi.json) ---------------------------------------------


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
