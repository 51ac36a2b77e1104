"""Engine rows -> OpenAI responses: JSON bodies, SSE streams, logprobs, usage, tool calls.

Owns the life of a request's rows once submitted: reading each row's events (awaited on
the event loop through `RequestHandle.__aiter__`, which the engine thread wakes: no
thread waits for a row), folding them into per-choice state,
shaping chat / text-completion bodies and SSE chunks (or another API's, handed to
`run_job`: server/anthropic.py), and releasing rows. Checks: a
client that disconnects (stream or not) has its unfinished rows cancelled at once, so
they leave the engine within one step; a row that errors gives a 500 (JSON) or an
`error` event (SSE). Engine "cancelled" (server shutdown) is reported as "abort".

Oracle: tests/test_server.py (JSON == SSE; 32 concurrent streams equal each alone).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mlx_tandem.engine.output import TextOffsets
from mlx_tandem.engine.request import RequestHandle, RequestOutput
from mlx_tandem.server.schemas import ApiError
from mlx_tandem.server.state import ServerState
from mlx_tandem.server.tools import ToolCallStream

# --- reading rows ------------------------------------------------------------------------------


@dataclass
class Row:
    """The server's view of one choice while its events arrive."""

    index: int
    tools: ToolCallStream | None
    max_calls: int | None = None  # parallel_tool_calls false: 1 (later calls are dropped)
    text: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    parts: list[str | dict[str, Any]] = field(default_factory=list)  # text and calls, in order
    ids: list[int] = field(default_factory=list)  # the tokens generated
    tokens: int = 0
    logprobs: list[Any] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    last_token: float | None = None
    drafted: int = 0  # draft tokens proposed for this row, and how many the target accepted
    accepted: int = 0
    offsets: TextOffsets | None = None  # completions' logprobs: where each token starts


async def merged_events(
    handles: list[RequestHandle],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, event) from all rows, in arrival order, until every row has finished.

    Each row ends with exactly one final event: if reading a row fails, it ends as an error.
    """
    inbox: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        try:
            async for out in handle:
                inbox.put_nowait((i, out))
        except Exception as err:  # the row's events are lost; its client must hear an end
            error = f"reading the row's events failed: {type(err).__name__}"
            inbox.put_nowait((i, RequestOutput(handle.id, "", [], [], "error", error)))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        left = len(handles)
        while left:
            i, out = await inbox.get()
            if out.finish_reason is not None:
                left -= 1
            yield i, out
    finally:
        for task in tasks:
            task.cancel()


def observe(
    state: ServerState, row: Row, out: RequestOutput, streaming: bool
) -> tuple[str, list[dict]]:
    """Fold one event into the row; returns (content delta, tool calls completed now)."""
    now = time.perf_counter()
    if out.tokens:
        gap = None if row.last_token is None else now - row.last_token
        state.metrics.record_tokens(len(out.tokens), gap)
        row.last_token = now
    row.tokens += len(out.tokens)
    row.ids += out.tokens
    row.logprobs += out.logprobs
    content, calls = out.text, []
    if row.tools is not None:
        content, calls = row.tools.feed(out.text, streaming)
        if out.finish_reason is not None:
            rest, more = row.tools.finish(streaming)
            content, calls = content + rest, calls + more
        if row.max_calls is not None:
            calls = calls[: max(0, row.max_calls - len(row.calls))]
    row.text += content
    row.calls += calls
    row.parts += [content, *calls] if content else calls
    if out.finish_reason is not None:
        reason = out.finish_reason
        if reason == "stop" and row.calls:
            reason = "tool_calls"
        row.finish, row.error = reason, out.error
        if out.stats is not None:
            row.drafted, row.accepted = out.stats.drafted, out.stats.accepted
        ttft = out.stats.ttft_s if out.stats and out.stats.first_token else None
        state.metrics.record_row(reason, ttft)
    return content, calls


def finish_reason(row: Row) -> str | None:
    return "abort" if row.finish == "cancelled" else row.finish


def release(state: ServerState, handles: list[RequestHandle], rows: list[Row]) -> None:
    """Cancel rows that have not finished (client gone, or an error); stop tracking all."""
    for handle, row in zip(handles, rows, strict=True):
        if row.finish is None:
            handle.cancel()
            row.finish = "cancelled"
            state.metrics.record_row("cancelled", None)
    state.untrack(handles)


# --- response shapes ----------------------------------------------------------------------------


def chat_logprobs(state: ServerState, items: list[Any], k: int) -> dict[str, Any]:
    def entry(token: int, lp: float) -> dict[str, Any]:
        return {"token": state.token_text(token), "logprob": lp,
                "bytes": list(state.token_bytes(token))}

    content = []
    for item in items:
        top = [entry(t, lp) for t, lp in item.top[:k]]
        content.append({**entry(item.token, item.logprob), "top_logprobs": top})
    return {"content": content, "refusal": None}


def text_logprobs(
    state: ServerState, items: list[Any], k: int, offsets: TextOffsets
) -> dict[str, Any]:
    return {
        "tokens": [state.token_text(item.token) for item in items],
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": [{state.token_text(t): lp for t, lp in item.top[:k]} for item in items],
        "text_offset": offsets.of([item.token for item in items]),
    }


def usage(prompts: list[list[int]], rows: list[Row]) -> dict[str, Any]:
    """OpenAI's usage; speculation as its Predicted Outputs counts (drafts accepted/rejected)."""
    prompt = sum(len(p) for p in prompts)
    completion = sum(r.tokens for r in rows)
    accepted = sum(r.accepted for r in rows)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": sum(r.drafted for r in rows) - accepted,
        },
    }


@dataclass
class Job:
    """One HTTP request turned into engine rows, and how to shape what they produce."""

    chat: bool
    prompts: list[list[int]]  # one per prompt (usage)
    handles: list[RequestHandle]
    rows: list[Row]
    logprobs: int | None  # top-N to report; None = no logprobs
    echo: list[str]  # per choice: text to put before the completion
    stream: bool
    include_usage: bool
    id: str
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, state: ServerState, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind + ".chunk" if self.stream and self.chat else kind,
            "created": self.created,
            "model": state.options.model_id,
            "system_fingerprint": state.fingerprint,
            "choices": choices,
        }


def _shape_logprobs(state: ServerState, job: Job, row: Row, items: list[Any]):
    if job.logprobs is None or not items:
        return None
    if job.chat:
        return chat_logprobs(state, items, job.logprobs)
    if row.offsets is None:  # the completion's text starts after the echoed prompt
        row.offsets = TextOffsets(state.token_bytes, len(job.echo[row.index]))
    return text_logprobs(state, items, job.logprobs, row.offsets)


def complete_body(state: ServerState, job: Job) -> dict[str, Any]:
    choices = []
    for row in job.rows:
        lp = _shape_logprobs(state, job, row, row.logprobs)
        if job.chat:
            message: dict[str, Any] = {"role": "assistant", "content": row.text}
            if row.calls:
                message["content"] = row.text.strip() or None
                message["tool_calls"] = row.calls
            choice = {"index": row.index, "message": message}
        else:
            choice = {"index": row.index, "text": job.echo[row.index] + row.text}
        choices.append({**choice, "logprobs": lp, "finish_reason": finish_reason(row)})
    return {**job.envelope(state, choices), "usage": usage(job.prompts, job.rows)}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def stream_body(state: ServerState, job: Job) -> AsyncIterator[str]:
    def chunk(index: int, delta: dict[str, Any], lp: Any = None, reason: str | None = None) -> str:
        if job.chat:
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            text = delta.get("content", "")
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
        body = job.envelope(state, [choice])
        if job.include_usage:
            body["usage"] = None
        return _sse(body)

    try:
        for row in job.rows:
            if job.chat:
                yield chunk(row.index, {"role": "assistant", "content": ""})
            elif job.echo[row.index]:
                yield chunk(row.index, {"content": job.echo[row.index]})
        async for i, out in merged_events(job.handles):
            row = job.rows[i]
            content, calls = observe(state, row, out, True)
            lp = _shape_logprobs(state, job, row, out.logprobs)
            delta: dict[str, Any] = {}
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            if delta or lp:
                yield chunk(i, delta, lp)
            if row.finish == "error":
                err = {"message": row.error or "generation failed", "type": "server_error"}
                yield _sse({"error": {**err, "param": None, "code": None}})
            if row.finish is not None:
                yield chunk(i, {}, None, finish_reason(row))
        if job.include_usage:
            yield _sse({**job.envelope(state, []), "usage": usage(job.prompts, job.rows)})
        yield "data: [DONE]\n\n"
    finally:
        release(state, job.handles, job.rows)


async def run_job(
    state: ServerState,
    request: Request,
    job: Job,
    body: Callable[[ServerState, Job], dict[str, Any]] = complete_body,
    events: Callable[[ServerState, Job], AsyncIterator[str]] = stream_body,
) -> Response:
    """Serve the job: SSE from `events`, or (the rows read to the end) JSON from `body`."""
    if job.stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            events(state, job), media_type="text/event-stream", headers=headers
        )

    async def collect() -> None:
        async for i, out in merged_events(job.handles):
            observe(state, job.rows[i], out, False)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, gone = asyncio.create_task(collect()), asyncio.create_task(disconnected())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
        release(state, job.handles, job.rows)
    if not work.done() or work.cancelled():
        return Response(status_code=499)  # nobody is listening
    work.result()
    failed = next((r for r in job.rows if r.finish == "error"), None)
    if failed is not None:
        raise ApiError(500, failed.error or "generation failed", None, "server_error")
    return JSONResponse(body(state, job))
