"""Turning a row's accepted tokens into the request's output event.

`accept_tokens` feeds a row's accepted tokens, in order, through the request's
`RowOutput` (the one finish rule, shared with the plain path) and cuts exactly
where plain decoding would stop, so speculative and plain steps end identically.

Oracle: tests/test_speculative.py (speculative output, finish reasons included,
equals plain decoding), tests/test_engine.py.
"""

from __future__ import annotations

import time

import mlx.core as mx

from mlx_tandem.engine.output import top_logprobs
from mlx_tandem.engine.request import Request, RequestOutput


def accept_tokens(request: Request, tokens: list[int], logprobs: list[mx.array]) -> RequestOutput:
    """Append accepted tokens; the returned event carries finish_reason when the row ends."""
    out = RequestOutput(request.id, "", [])
    now = time.perf_counter()
    if request.stats.first_token is None:
        request.stats.first_token = now
    for token, lp in zip(tokens, logprobs, strict=True):
        delta, emitted = request.output.add(token)
        request.stats.produced += 1
        out.text += delta
        if emitted:
            request.tokens.append(token)
            request.stats.generation_tokens += 1
            out.tokens.append(token)
            if request.params.logprobs:
                out.logprobs.append(top_logprobs(lp, token, request.params.logprobs))
            if request.history is not None:
                history = [request.history, mx.array([token], mx.uint32)]
                request.history = mx.concatenate(history)
            request.pending = token
        if request.output.finish_reason is not None:
            break
    if request.output.finish_reason is not None:
        out.finish_reason = request.finish_reason = request.output.finish_reason
        request.stats.finished = now
        out.stats = request.stats
    return out
