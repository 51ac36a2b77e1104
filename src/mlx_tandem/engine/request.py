"""Request: everything the engine knows about one request lives in this one object.

The cohort is a list of Requests plus one StateRows; filtering the cohort
filters both with the same index list, and no other per-row list exists.
A request's row state while it is being prefilled (`joining`) is its own
one-row StateRows; it merges into the cohort only when prefill completes. A
drafter that prefills rows of its own keeps its part in `draft_joining`.

`new_request` validates a prompt and its parameters against the model before
anything else exists (`check_prompt`); nothing in the engine changes until it
returns. `RequestHandle` is the caller's side: iterate it (sync, with an
optional timeout, or async without a thread) for `RequestOutput` events,
`cancel()` it, or `result()` to wait for the end. Events travel through an
`EventChannel` that the engine thread writes and any thread or event loop reads.

Oracle: tests/test_service.py (every handle ends: errors, shutdown and cancel
all deliver a final event; async iteration needs no thread).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from mlx_tandem.engine.constraint import GrammarCompiler, RowGrammar
from mlx_tandem.engine.output import RowOutput, TokenLogprob
from mlx_tandem.engine.sampling import InvalidParameter, RowSampler, SamplingParams
from mlx_tandem.kv.state_rows import StateRows
from mlx_tandem.models.loader import token_ids

if TYPE_CHECKING:
    from mlx_tandem.models.loader import LoadedModel

_ids = itertools.count()


class EngineClosed(RuntimeError):
    """The engine has shut down (or failed for good) and takes no more requests."""


@dataclass
class RequestOutput:
    """One event: tokens accepted this step and the text they released."""

    request_id: str
    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    stats: RequestStats | None = None


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    arrival: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # decode steps (target forwards) this request took part in
    produced: int = 0  # tokens those forwards gave the row: emitted, or the stop id ending it

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per target forward (1.0 without speculation; a stop id counts)."""
        return self.produced / self.steps if self.steps else 0.0

    @property
    def ttft_s(self) -> float:
        return (self.first_token or self.arrival) - self.arrival

    @property
    def generation_tps(self) -> float:
        if self.first_token is None or self.finished is None or self.generation_tokens < 2:
            return 0.0
        return (self.generation_tokens - 1) / max(self.finished - self.first_token, 1e-9)


@dataclass
class RequestResult:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    stats: RequestStats | None = None


def check_prompt(prompt: list[int], max_tokens: int, context_length: int, vocab_size: int) -> None:
    """A prompt the model can run: non-empty ids inside the vocabulary, within the context."""
    if not prompt:
        raise ValueError("prompt is empty: need at least one token")
    if isinstance(prompt, str):
        raise ValueError("prompt must be token ids here: encode the text first (model.encode)")
    bad = next((t for t in prompt if type(t) is not int), None)  # bool is not a token id
    if bad is not None:
        raise ValueError(f"prompt token {bad!r} is not an int token id")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token {bad!r} is outside the vocabulary (size {vocab_size})")
    if len(prompt) + max_tokens > context_length:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"model's context window ({context_length} tokens)"
        )


class EventChannel:
    """A request's events: the engine thread puts; threads or event loops wait, none spins."""

    def __init__(self) -> None:
        self._items: deque[RequestOutput] = deque()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def put(self, item: RequestOutput) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_wake, future)

    def get(self, timeout: float | None = None) -> RequestOutput:
        """The next event; TimeoutError if none arrives within timeout seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                raise TimeoutError(f"no event within {timeout} s")
            return self._items.popleft()

    async def aget(self) -> RequestOutput:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    return self._items.popleft()
                future = loop.create_future()
                self._waiters.append((loop, future))
            await future


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Request:
    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        sampler: RowSampler,
        output: RowOutput,
        request_id: str | None = None,
        grammar: RowGrammar | None = None,
    ) -> None:
        self.id = request_id or f"req-{next(_ids)}"
        self.prompt = prompt
        self.params = params
        self.sampler = sampler
        self.output = output
        self.tokens: list[int] = []
        self.prefilled = 0  # prompt tokens already in `joining`
        self.joining: StateRows | None = None
        self.draft_joining: tuple[StateRows, int] | None = None  # a drafter's row, tokens held
        self.pending = prompt[-1]  # the next token to feed; its logits give the next sample
        self.history = mx.array(prompt, dtype=mx.uint32) if sampler.needs_history else None
        self.grammar = grammar  # the row's parser state when its output is constrained
        self.finish_reason: str | None = None
        self.reserved = 0  # KV bytes the scheduler reserved for this row while it is admitted
        self.spec_alpha: float | None = None  # per-token draft acceptance estimate (adaptive depth)
        self.spec_offer: float | None = None  # share of asked steps the drafter proposed in
        self.spec_seen = 0  # drafts of this row whose acceptance was observed (steps)
        self.spec_shadow: tuple[int, list[int]] | None = None  # (len(tokens) then, proposal)
        self.stats = RequestStats(prompt_tokens=len(prompt), arrival=time.perf_counter())
        self.events = EventChannel()

    @property
    def position(self) -> int:
        """Absolute position of the next token to sample (keys the row's randomness)."""
        return len(self.prompt) + len(self.tokens)

    def emit(self, out: RequestOutput) -> None:
        self.events.put(out)

    def finish(self, reason: str, error: str | None = None) -> None:
        """End the request from outside its tokens (cancel, error): one final event."""
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        self.stats.finished = time.perf_counter()
        self.emit(RequestOutput(self.id, "", [], finish_reason=reason, error=error, stats=self.stats))


def new_request(
    model: LoadedModel,
    prompt: list[int],
    params: SamplingParams,
    request_id: str | None = None,
    grammars: GrammarCompiler | None = None,
) -> Request:
    """A validated Request (ValueError naming the problem); nothing else changes.
    A constrained request (params.grammar) needs the engine's `grammars`."""
    graph = model.graph
    prompt = prompt if isinstance(prompt, str) else token_ids(prompt)  # text: refused below
    check_prompt(prompt, params.max_tokens, model.context_length, graph.vocab_size)
    sampler = RowSampler(params, graph.vocab_size)
    grammar = None
    if params.grammar is not None:
        if grammars is None:
            raise InvalidParameter("grammar", "this decoding path takes no grammar (use the engine)")
        grammar = grammars.compile(params.grammar)
    stop_ids = (set() if params.ignore_eos else model.eos_token_ids) | set(params.stop_token_ids)
    output = RowOutput(model.tokenizer, params.stop, stop_ids, params.max_tokens, prompt)
    return Request(list(prompt), params, sampler, output, request_id, grammar)


class RequestHandle:
    """The submitter's view of a request: events, cancel, result."""

    def __init__(self, request: Request, cancel: Callable[[str], None]) -> None:
        self.request = request
        self.id = request.id
        self._cancel = cancel
        self._result: RequestResult | None = None
        self._partial = RequestResult()  # what result() read before a timeout

    def events(self, timeout: float | None = None) -> Iterator[RequestOutput]:
        """Events until the final one; TimeoutError if any wait exceeds timeout seconds."""
        while True:
            out = self.request.events.get(timeout)
            yield out
            if out.finish_reason is not None:
                return

    def __iter__(self) -> Iterator[RequestOutput]:
        return self.events()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            out = await self.request.events.aget()
            yield out
            if out.finish_reason is not None:
                return

    def cancel(self) -> None:
        self._cancel(self.id)

    def result(self, timeout: float | None = None) -> RequestResult:
        """Wait for the end and collect everything the request produced (the events not read
        through `events`). A call that times out keeps what it read for the next call; a
        call after the end returns the same result."""
        if self._result is not None:
            return self._result
        res = self._partial
        for out in self.events(timeout):
            res.text += out.text
            res.tokens += out.tokens
            res.logprobs += out.logprobs
            res.finish_reason, res.error, res.stats = out.finish_reason, out.error, out.stats
        self._result = res
        return res
