"""Turning a row's accepted tokens into the request's output.

`accept_tokens`: appends a row's accepted tokens in order and cuts exactly
where plain decoding would stop: a stop id (not emitted), a stop string (text
cut at its first occurrence), or max_tokens. Shared by plain and speculative
steps so they stop identically.
"""

from __future__ import annotations

import time

import mlx.core as mx

from mlx_tandem.engine.generate import top_logprobs
from mlx_tandem.engine.request import Request, RequestOutput


def accept_tokens(request: Request, tokens: list[int], logprobs: list[mx.array]) -> RequestOutput:
    """Append accepted tokens; the returned event carries finish_reason when the row ends."""
    out = RequestOutput(request.id, "", [])
    now = time.perf_counter()
    if request.stats.first_token is None:
        request.stats.first_token = now
    for token, lp in zip(tokens, logprobs, strict=True):
        if token in request.stop_ids:
            out.text += request.text.finish()
            out.finish_reason = "stop"
            break
        request.tokens.append(token)
        request.stats.generation_tokens += 1
        out.tokens.append(token)
        if request.params.logprobs:
            out.logprobs.append(top_logprobs(lp, token, request.params.logprobs))
        out.text += request.text.add(token)
        if request.history is not None:
            request.history = mx.concatenate([request.history, mx.array([token], mx.uint32)])
        request.pending = token
        if request.text.stopped:
            out.finish_reason = "stop"
            break
        if len(request.tokens) == request.params.max_tokens:
            out.text += request.text.finish()
            out.finish_reason = "length"
            break
    if out.finish_reason is not None:
        request.finish_reason = out.finish_reason
        request.stats.finished = now
        out.stats = request.stats
    return out
