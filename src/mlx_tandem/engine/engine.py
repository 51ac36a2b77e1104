"""Engine: the continuously batched step loop over a cohort of rows.

    step():  inbox -> admit -> prefill (<= one chunk of tokens) -> decode all running rows

    decode:  draft -> verify (one target forward) -> accept -> rewind -> postprocess

Without a drafter every row drafts nothing and the same decode is plain
decoding; with one, each row verifies its own proposals and keeps its own
accepted prefix (spec/verify.py), the rejected tail is rewound by moving the
row's end back, and the drafter restores its rows to match.

The cohort is `self.running` (Requests, one per row, in row order) and
`self.rows` (their StateRows); they are filtered together, by one index list.
Joining rows are prefilled alone, in whole chunks, at most one chunk's worth of
tokens per step, so a long prompt never stalls running rows for more than one
chunk; they merge into the cohort with
their last prompt token pending: the next decode feeds it and samples from
its logits, exactly as plain decoding does.

Threading: `submit`/`cancel` may be called from any thread; they only put
messages in the inbox. Everything else runs on the engine thread (or on the
caller's thread when the engine is stepped by hand, `threaded=False`).

Oracle: tests/test_engine.py — every row's tokens in a cohort equal the same
request run alone, with rows joining and leaving at random steps.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import mlx.core as mx

from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.depth import DepthPolicy, FixedDepth
from mlx_tandem.engine.draft_source import Drafts, DraftSource
from mlx_tandem.engine.generate import check_prompt
from mlx_tandem.engine.output import TextStream
from mlx_tandem.engine.postprocess import accept_tokens
from mlx_tandem.engine.prefill import PrefillPolicy
from mlx_tandem.engine.request import Request, RequestHandle, RequestOutput, Status
from mlx_tandem.engine.runner import ModelRunner
from mlx_tandem.engine.sampling import RowSampler, SamplingParams
from mlx_tandem.engine.scheduler import MemoryModel, Scheduler
from mlx_tandem.engine.verify import verify
from mlx_tandem.kv.state_rows import StateRows
from mlx_tandem.models.loader import LoadedModel


class Engine:
    def __init__(
        self,
        model: LoadedModel,
        config: RuntimeConfig | None = None,
        threaded: bool = True,
        drafter: DraftSource | None = None,
        depth: DepthPolicy | None = None,
    ) -> None:
        self.model = model
        self.config = config or RuntimeConfig.resolve()
        self.runner = ModelRunner(model, batch_invariant=self.config.batch_invariant)
        self.drafter = drafter
        self.depth = depth or FixedDepth(3)
        if drafter is not None:
            check_rewindable(self.runner)
        self.stats = EngineStats()
        memory = measure_memory(self.runner)
        budget = self.config.memory_budget or default_budget(model)
        self.prefill_policy = PrefillPolicy.resolve(model.config, self.config, budget)
        self.scheduler = Scheduler(self.config.max_rows, budget, memory, self.config.max_queue)
        self.running: list[Request] = []
        self.rows: StateRows = self.runner.empty_rows()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_transit = 0  # submitted, not yet seen by the engine thread
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
            self._thread.start()

    # --- any thread -------------------------------------------------------------------
    def submit(
        self, prompt: list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestHandle:
        """Validate and queue a request; raises ValueError (QueueFull) before any state changes."""
        check_prompt(
            prompt, params.max_tokens, self.model.context_length, self.model.graph.vocab_size
        )
        sampler = RowSampler(params, self.model.graph.vocab_size)
        request = Request(
            prompt,
            params,
            sampler,
            TextStream(self.model.tokenizer, params.stop),
            (set() if params.ignore_eos else self.model.eos_token_ids) | set(params.stop_token_ids),
            request_id,
        )
        with self._lock:
            self.scheduler.check(request, queued=self._in_transit)
            self._in_transit += 1
            self._inbox.put(("submit", request))
        self._wake.set()
        return RequestHandle(request, self)

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))
        self._wake.set()

    def shutdown(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the loop; with drain, first let admitted and queued requests finish."""
        if drain:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.busy() and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.01)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._stopped.wait()
        for request in [*self.running, *self.scheduler.joining, *self.scheduler.waiting]:
            self._finish(request, "cancelled")

    def busy(self) -> bool:
        return bool(
            self.running
            or self.scheduler.joining
            or self.scheduler.waiting
            or not self._inbox.empty()
        )

    # --- engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.step():
                    self._wake.wait(0.05)
                    self._wake.clear()
        finally:
            self._stopped.set()
        # Park instead of exiting: when a thread that ran compiled MLX functions exits, MLX's
        # per-thread cleanup needs the GIL, and during interpreter shutdown that aborts the
        # process (exit code 134). A parked daemon thread is simply dropped at exit.
        threading.Event().wait()

    def step(self) -> bool:
        """One engine step; returns False when there was nothing to do."""
        self._drain_inbox()
        self.scheduler.admit(len(self.running))
        worked = self._prefill()
        if self.running:
            self._decode()
            worked = True
        return worked

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.step() and not self.busy():
                return

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                with self._lock:
                    self._in_transit -= 1
                    self.scheduler.add(item)
            else:
                self._cancel(item)

    def _cancel(self, request_id: str) -> None:
        request = self.scheduler.remove_waiting(request_id)
        if request is None:
            request = next((r for r in self.scheduler.joining if r.id == request_id), None)
            if request is not None:
                self.scheduler.joining.remove(request)
        if request is not None:
            self._finish(request, "cancelled")
            return
        for i, r in enumerate(self.running):
            if r.id == request_id:
                self._finish(r, "cancelled")
                self._keep([j for j in range(len(self.running)) if j != i])
                return

    def _prefill(self) -> bool:
        """Prefill joining rows, oldest first, whole chunks only, up to one chunk of tokens.

        A row's chunk boundaries are fixed (multiples of the policy's chunk from
        its start), so its prefill arithmetic never depends on what else runs.
        Prompts that fit one chunk are prefilled together in one ragged forward
        (batch-invariant like every other forward); longer ones chunk by chunk.
        """
        chunk = self.prefill_policy.chunk
        budget, whole, partial = chunk, [], []
        for request in self.scheduler.joining:
            remaining = len(request.prompt) - 1 - request.prefilled
            need = min(chunk, remaining)
            if (whole or partial) and need > budget:
                break
            budget -= need
            short = request.prefilled == 0 and remaining <= chunk
            (whole if short else partial).append(request)
        if whole:
            self._prefill_together(whole)
        for request in partial:
            self._prefill_one_chunk(request)
        return bool(whole or partial)

    def _prefill_together(self, requests: list[Request]) -> None:
        """Prefill prompts that fit one chunk in one forward and join them to the cohort."""
        try:
            rows = self.runner.blank_rows(len(requests))
            lengths = [len(r.prompt) - 1 for r in requests]
            width = max(lengths)
            if width:
                ids = [
                    r.prompt[:-1] + [0] * (width - n)
                    for r, n in zip(requests, lengths, strict=True)
                ]
                self.runner.forward(rows, mx.array(ids, dtype=mx.int32), lengths)
                mx.eval(*rows.arrays())
            self._join(requests, rows)
        except Exception as err:  # the cohort is untouched: the rows never joined
            for request in requests:
                self._fail_joining(request, err)

    def _prefill_one_chunk(self, request: Request) -> None:
        """Advance a joining request by one chunk; join the cohort when its prompt is done."""
        try:
            if request.joining is None:
                request.joining = self.runner.blank_rows(1)
            todo = request.prompt[request.prefilled : len(request.prompt) - 1]
            piece = todo[: self.prefill_policy.chunk]
            if piece:
                self.runner.prefill(request.joining, piece, self.prefill_policy.chunk)
                request.prefilled += len(piece)
            if request.prefilled == len(request.prompt) - 1:
                self._join([request], request.joining)
        except Exception as err:  # the cohort is untouched: the row never joined
            self._fail_joining(request, err)

    def _join(self, requests: list[Request], rows: StateRows) -> None:
        """Append prefilled rows (and the drafter's rows for them) to the cohort, all or nothing."""
        change = self.rows.prepare_append([rows])
        try:
            companion = self.drafter.prepare_append(requests) if self.drafter else None
            change.commit()
            if companion is not None:
                companion.commit()
        finally:
            change.dispose()
        for request in requests:
            self.scheduler.joining.remove(request)
            request.joining = None
            request.status = Status.RUNNING
            self.running.append(request)

    def _fail_joining(self, request: Request, err: Exception) -> None:
        self.scheduler.joining.remove(request)
        request.joining = None
        self._finish(request, "error", error=f"{type(err).__name__}: {err}")

    def _decode(self) -> None:
        """draft -> verify -> accept -> rewind -> postprocess, for every running row."""
        rows, B = self.running, len(self.running)
        t0 = time.perf_counter()
        depths = self.depth.depths(rows) if self.drafter else [0] * B
        drafts = self.drafter.draft(rows, depths) if self.drafter else Drafts([[]] * B, [None] * B)
        t1 = time.perf_counter()
        feeds = [[r.pending, *d] for r, d in zip(rows, drafts.tokens, strict=True)]
        width = max(len(f) for f in feeds)
        ids = mx.array([f + [0] * (width - len(f)) for f in feeds], dtype=mx.int32)
        before = self.rows.ends
        hidden = self.runner.forward(self.rows, ids, [len(f) for f in feeds])
        verdicts = verify(rows, self.runner.logits(hidden, "all"), drafts.tokens, drafts.q)
        self.rows.set_ends([e + v.accepted + 1 for e, v in zip(before, verdicts, strict=True)])
        accepted = [v.accepted for v in verdicts]
        if self.drafter:
            self.drafter.commit(accepted)
            drafted = [len(d) for d in drafts.tokens]
            self.depth.observe(rows, drafted, accepted, t1 - t0, time.perf_counter() - t1, width)
            self.stats.record(self.drafter.name, drafted, accepted)
        keep = []
        for i, (request, verdict) in enumerate(zip(rows, verdicts, strict=True)):
            request.stats.steps += 1
            request.stats.drafted += len(drafts.tokens[i])
            request.stats.accepted += verdict.accepted
            out = accept_tokens(request, verdict.tokens, verdict.logprobs)
            request.emit(out)
            if out.finish_reason is None:
                keep.append(i)
            else:
                self._finish(request, out.finish_reason, emitted=True)
        self._keep(keep)

    def _keep(self, keep: list[int]) -> None:
        if len(keep) != len(self.running):
            self.rows.filter_rows(keep)
            if self.drafter:
                self.drafter.filter_rows(keep)
            self.running = [self.running[i] for i in keep]

    def _finish(
        self, request: Request, reason: str, error: str | None = None, emitted: bool = False
    ) -> None:
        request.status = Status.FINISHED
        request.finish_reason = request.finish_reason or reason
        request.stats.finished = time.perf_counter()
        self.scheduler.release(request)
        if not emitted:
            request.emit(
                RequestOutput(
                    request.id, "", [], finish_reason=reason, error=error, stats=request.stats
                )
            )


class EngineStats:
    """Engine-wide speculation counters, per drafter."""

    def __init__(self) -> None:
        self.drafted: dict[str, int] = {}
        self.accepted: dict[str, int] = {}

    def record(self, drafter: str, drafted: list[int], accepted: list[int]) -> None:
        self.drafted[drafter] = self.drafted.get(drafter, 0) + sum(drafted)
        self.accepted[drafter] = self.accepted.get(drafter, 0) + sum(accepted)

    def acceptance(self, drafter: str) -> float:
        return self.accepted.get(drafter, 0) / max(1, self.drafted.get(drafter, 0))


def check_rewindable(runner: ModelRunner) -> None:
    """Speculation rewinds target rows by moving their ends: refuse recurrent targets."""
    from mlx_lm.models.cache import ArraysCache

    if any(isinstance(c, ArraysCache) for c in runner.empty_rows().leaves()):
        raise ValueError(
            f"speculative decoding is not supported for {runner.model.name!r}: its recurrent "
            "layers cannot rewind rejected drafts per row (run it without a draft model)"
        )


def measure_memory(runner: ModelRunner) -> MemoryModel:
    """KV bytes per token and fixed bytes per row, from one real one-token forward."""
    from mlx_tandem.kv.row_cache import RowKVCache

    row = runner.blank_rows(1)
    runner.graph.forward_hidden(mx.array([[0]], dtype=mx.int32), row.layers)
    per_token = per_row = 0
    for leaf in row.leaves():
        if isinstance(leaf, RowKVCache):
            per_token += sum(a.nbytes for a in leaf.state) // leaf.keys.shape[2]
        else:
            per_row += sum(a.nbytes for a in leaf.cache if a is not None)
    return MemoryModel(per_token=per_token, per_row=per_row)


def default_budget(model: LoadedModel) -> int:
    """Half of the device's memory, minus the weights, at least 256 MiB."""
    try:
        total = int(mx.device_info()["memory_size"])
    except (AttributeError, KeyError, RuntimeError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    weights = sum(a.nbytes for a in _arrays(model.model.parameters()))
    return max(256 << 20, total // 2 - weights)


def _arrays(tree: Any) -> list[mx.array]:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(tree)]
