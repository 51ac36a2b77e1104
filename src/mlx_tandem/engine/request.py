"""Request: everything the engine knows about one request lives in this one object.

The cohort is a list of Requests plus one StateRows; filtering the cohort
filters both with the same index list, and no other per-row list exists.
A request's row state while it is being prefilled (`joining`) is its own
one-row StateRows; it merges into the cohort only when prefill completes.

`RequestHandle` is the caller's side: iterate it (sync or async) for
`RequestOutput` events, `cancel()` it, or `result()` to wait for the end.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from mlx_tandem.engine.output import TextStream, TokenLogprob
from mlx_tandem.engine.sampling import RowSampler, SamplingParams
from mlx_tandem.kv.state_rows import StateRows

if TYPE_CHECKING:
    from mlx_tandem.engine.engine import Engine

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


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

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward (1.0 without speculation)."""
        return self.generation_tokens / self.steps if self.steps else 0.0

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


class Request:
    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        sampler: RowSampler,
        text: TextStream,
        stop_ids: set[int],
        request_id: str | None = None,
    ) -> None:
        self.id = request_id or f"req-{next(_ids)}"
        self.prompt = prompt
        self.params = params
        self.sampler = sampler
        self.text = text
        self.stop_ids = stop_ids
        self.status = Status.WAITING
        self.tokens: list[int] = []
        self.prefilled = 0  # prompt tokens already in `joining`
        self.joining: StateRows | None = None
        self.pending = prompt[-1]  # the next token to feed; its logits give the next sample
        self.history = mx.array(prompt, dtype=mx.uint32) if sampler.needs_history else None
        self.finish_reason: str | None = None
        self.spec_alpha: float | None = None  # per-token draft acceptance estimate (adaptive depth)
        self.stats = RequestStats(prompt_tokens=len(prompt), arrival=time.perf_counter())
        self.events: queue.Queue[RequestOutput] = queue.Queue()
        self.listeners: list[Callable[[], None]] = []  # async iterators waiting for events

    @property
    def position(self) -> int:
        """Absolute position of the next token to sample (keys the row's randomness)."""
        return len(self.prompt) + len(self.tokens)

    def emit(self, out: RequestOutput) -> None:
        self.events.put(out)
        for wake in self.listeners:
            wake()


class RequestHandle:
    """The submitter's view of a request: events, cancel, result."""

    def __init__(self, request: Request, engine: Engine) -> None:
        self.request = request
        self.engine = engine
        self.id = request.id

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self.request.events.get()
            yield out
            if out.finish_reason is not None:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Async iteration without a thread per waiter: the engine wakes this loop on emit."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        self.request.listeners.append(lambda: loop.call_soon_threadsafe(ready.set))
        while True:
            try:
                out = self.request.events.get_nowait()
            except queue.Empty:
                await ready.wait()
                ready.clear()
                continue
            yield out
            if out.finish_reason is not None:
                return

    def cancel(self) -> None:
        self.engine.cancel(self.id)

    def result(self) -> RequestResult:
        """Block until the request ends and collect everything it produced."""
        res = RequestResult()
        for out in self:
            res.text += out.text
            res.tokens += out.tokens
            res.logprobs += out.logprobs
            res.finish_reason, res.error, res.stats = out.finish_reason, out.error, out.stats
        return res
