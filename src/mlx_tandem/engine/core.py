"""EngineCore: the synchronous step machine over a cohort of rows. No threads, queues or events.

    step():  schedule -> prefill joining rows -> draft -> forward -> verify -> postprocess

The cohort is `self.running` (Requests, one per row, in row order) and
`self.rows` (their StateRows); they are filtered together, by one index list.
Without a drafter every row drafts nothing and the same step is plain batched
decoding; with one, each row verifies its own proposals (engine/verify.py),
the rejected tail is rewound by moving the row's end back, and the drafter
restores its rows to match.

Joining rows are prefilled in whole chunks, at most one chunk's worth of tokens
per step, so a long prompt never stalls running rows for more than one chunk;
they merge into the cohort with their last prompt token pending: the next step
feeds it and samples from its logits, exactly as plain decoding does.

A step that raises leaves the core in an unknown state: `fail_in_flight` ends
every admitted request with an error event and rebuilds empty rows; requests
still waiting for admission are kept. The service shell (engine/service.py)
owns threads, the inbox and when to call what.

Oracle: tests/test_engine.py — every row's tokens in a cohort equal the same
request run alone, with rows joining and leaving at random steps;
tests/test_service.py — a failing step fails the requests in flight and the
next request succeeds.
"""

from __future__ import annotations

import logging
import math
import time

import mlx.core as mx

from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.constraint import GrammarCompiler, grammar_masks
from mlx_tandem.engine.depth import AdaptiveDepth, DepthPolicy, FixedDepth
from mlx_tandem.engine.draft_source import Drafts, DraftSource
from mlx_tandem.engine.postprocess import accept_tokens
from mlx_tandem.engine.prefill import (
    PrefillPolicy,
    device_kind,
    keep_in_cache,
    keep_short,
    start_from_cache,
    start_short,
)
from mlx_tandem.engine.request import Request, RequestHandle, new_request
from mlx_tandem.engine.runner import ModelRunner
from mlx_tandem.engine.sampling import MAX_DRAFT, SamplingParams
from mlx_tandem.engine.scheduler import (
    Scheduler,
    default_budget,
    measure_memory,
    prefix_cache_budget,
    size_buffer_cache,
)
from mlx_tandem.engine.verify import (
    TIE_MARGIN,
    CertifiedPicks,
    Verdict,
    certifiable,
    verify,
)
from mlx_tandem.kv.prefix_cache import PrefixCache
from mlx_tandem.kv.state_rows import StateRows
from mlx_tandem.models.families import check_engine, recurrent_refusal
from mlx_tandem.models.loader import LoadedModel

log = logging.getLogger(__name__)
GRAMMAR = "grammar"  # EngineStats' name for grammar-forced proposals
SHORT_UNIT = 16  # short-prompt cache blocks where prefills are not packed (any split is exact)
NEXT_UNIT_MARGIN = 1.25  # a prefill unit may take this much more than the last one did


class EngineCore:
    def __init__(
        self,
        model: LoadedModel,
        config: RuntimeConfig | None = None,
        drafter: DraftSource | None = None,
        depth: DepthPolicy | None = None,
    ) -> None:
        self.model = model
        self.config = config or RuntimeConfig.resolve()
        check_engine(model.config, speculative=drafter is not None)  # models/families.py
        self.runner = ModelRunner(
            model, batch_invariant=self.config.batch_invariant, kv_codec=self.config.kv_codec
        )
        if drafter is not None and self.runner.recurrent_layers():
            raise ValueError(recurrent_refusal(model.config))
        self.drafter = drafter
        self.depth = depth or FixedDepth(3)
        if isinstance(self.depth, AdaptiveDepth):  # its step costs jump at whole projection calls
            self.depth.quantum = self.runner.row_quantum
            self.depth.small = self.runner.small_turned
            if drafter is not None and not drafter.samples and hasattr(drafter, "propose"):
                self.depth.shadow = drafter.propose  # free proposals: measured, not probed
        self.stats = EngineStats()
        self.grammars = GrammarCompiler(
            model.tokenizer._tokenizer, model.graph.vocab_size, model.eos_token_ids
        )
        budget = self.config.memory_budget or default_budget(model)
        self.buffer_cache = size_buffer_cache(self.config.buffer_cache)
        self.prefill_policy = PrefillPolicy.resolve(
            model.config, self.config, budget, device_kind()
        )
        # the widest append (a prefill chunk or a verify block) sizes sliding layers' rings
        self.runner.reach = max(self.prefill_policy.chunk, MAX_DRAFT + 1)
        memory = measure_memory(self.runner)
        self.scheduler = Scheduler(self.config.max_rows, budget, memory, self.config.max_queue)
        cache_bytes = self.config.prefix_cache_bytes
        if cache_bytes is None:
            cache_bytes = prefix_cache_budget(model, budget)
        if cache_bytes:  # a quarter for short prompts, where no layer keeps recurrent state
            short = cache_bytes // 4 if self.runner.attention_only() else 0
            self.scheduler.prefix_cache = PrefixCache(cache_bytes - short, self.prefill_policy.cuts)
            if short:
                self.scheduler.short_cache = PrefixCache(short, self.runner.pack_unit or SHORT_UNIT)
        self.running: list[Request] = []
        self.rows: StateRows = self.runner.empty_rows()
        self._long_turn = False  # whether a long prompt's chunk goes next (alternation)
        self._decode_s = 0.0  # the running rows' last draft/forward/verify (prefill's budget)

    # --- requests in and out ----------------------------------------------------------
    def new_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        queued: int = 0,
    ) -> Request:
        """Validate (ValueError; QueueFull counting `queued` not yet added) without changing state."""
        request = new_request(self.model, prompt, params, request_id, self.grammars)
        self.scheduler.check(request, queued)
        return request

    def submit(
        self, prompt: list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestHandle:
        """Validate and queue a request (caller steps the core by hand)."""
        request = self.new_request(prompt, params, request_id)
        self.scheduler.add(request)
        return RequestHandle(request, self.cancel)

    def cancel(self, request_id: str) -> None:
        request = self.scheduler.remove(request_id)
        if request is not None:
            self._finish(request, "cancelled")
            return
        for i, r in enumerate(self.running):
            if r.id == request_id:
                self._finish(r, "cancelled")
                self._keep([j for j in range(len(self.running)) if j != i])
                return

    def busy(self) -> bool:
        return bool(self.running or self.scheduler.joining or self.scheduler.waiting)

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.step() and not self.busy():
                return

    def fail_in_flight(self, error: str) -> None:
        """After a failed step: end every admitted request with `error`, start from empty rows."""
        for request in [*self.running, *self.scheduler.joining]:
            self._finish(request, "error", error)
        self.scheduler.joining.clear()
        self.running = []
        self.rows = self.runner.empty_rows()
        if self.drafter is not None:
            self.drafter.filter_rows([])

    def cancel_all(self) -> None:
        for request in [*self.running, *self.scheduler.joining, *self.scheduler.waiting]:
            self._finish(request, "cancelled")
        self.scheduler.joining.clear()
        self.scheduler.waiting.clear()
        self._keep([])

    # --- the step ---------------------------------------------------------------------
    def step(self) -> bool:
        """One engine step; returns False when there was nothing to do."""
        self.scheduler.admit(len(self.running))
        prefilled = self._prefill()
        if not self.running:
            return prefilled
        t0 = time.perf_counter()
        drafts, forced = self._draft()
        t1 = time.perf_counter()
        verdicts, hidden = self._forward_and_verify(drafts)
        self._postprocess(drafts, forced, verdicts, hidden, t1 - t0, time.perf_counter() - t1)
        self._decode_s = time.perf_counter() - t0
        return True

    def _draft(self) -> tuple[Drafts, list[bool]]:
        """Each row's proposals, and which rows propose grammar-forced tokens instead."""
        B = len(self.running)
        if self.drafter is None:
            return Drafts([[] for _ in range(B)], [None] * B), [False] * B
        depths = self.depth.depths(self.running, self.drafter.samples)
        drafts = self.drafter.draft(self.running, depths, self.rows)
        if all(r.grammar is None for r in self.running):
            return drafts, [False] * B
        return self._constrain(drafts, depths)

    def _constrain(self, drafts: Drafts, depths: list[int]) -> tuple[Drafts, list[bool]]:
        """Rows under a grammar (engine/constraint.py): within the depth the policy chose,
        the tokens the grammar forces are proposed instead of the drafter's, where the
        drafter keeps no state of its own proposals; other proposals are cut where the
        grammar refuses them."""
        replaceable = self.drafter is not None and self.drafter.stateless
        tokens: list[list[int]] = []
        qs: list[mx.array | None] = []
        forced: list[bool] = []
        for r, d, q, k in zip(self.running, drafts.tokens, drafts.q, depths, strict=True):
            f = r.grammar.forced(k) if r.grammar and replaceable else []
            keep = len(d) if r.grammar is None or not d else r.grammar.cut(d, q is not None)
            tokens.append(f or d[:keep])
            qs.append(None if f or q is None else q[:keep])
            forced.append(bool(f))
        return Drafts(tokens, qs), forced

    def _forward_and_verify(self, drafts: Drafts) -> tuple[list[Verdict], mx.array]:
        """One target forward over each row's [pending, d1..dk]; keep accepted, rewind the rest.
        Also returns the forward's final hiddens (B, width, D)."""
        feeds = [[r.pending, *d] for r, d in zip(self.running, drafts.tokens, strict=True)]
        width = max(len(f) for f in feeds)
        ids = mx.array([f + [0] * (width - len(f)) for f in feeds], dtype=mx.int32)
        before = self.rows.ends
        lengths = [len(f) for f in feeds]
        hidden = self.runner.forward(self.rows, ids, lengths)
        grammars = [r.grammar for r in self.running]
        allowed = grammar_masks(grammars, drafts.tokens, width, self.model.graph.vocab_size)
        logits = self.runner.logits(hidden, "all", lengths)  # lazy: certified rows may skip it
        certified = self._certified(hidden, lengths) if allowed is None else None
        verdicts = verify(self.running, logits, drafts.tokens, drafts.q, allowed, certified)
        self.rows.set_ends([e + v.accepted + 1 for e, v in zip(before, verdicts, strict=True)])
        return verdicts, hidden

    def _certified(self, hidden: mx.array, lengths: list[int]) -> CertifiedPicks | None:
        """Picks from one fast head call where every row needs only its argmax (verify)."""
        if not certifiable(self.running):
            return None
        found = self.runner.greedy_picks(hidden, lengths, TIE_MARGIN)
        if found is None:
            return None

        def rows_logits(rows: list[int]) -> mx.array:
            some = [lengths[i] for i in rows]
            return self.runner.logits(hidden[mx.array(rows)], "all", some)

        return CertifiedPicks(*found, rows_logits)

    def _postprocess(
        self,
        drafts: Drafts,
        forced: list[bool],
        verdicts: list[Verdict],
        hidden: mx.array,
        draft_s: float,
        verify_s: float,
    ) -> None:
        """Tokens out through each row's finish rule; finished rows leave the cohort.
        Grammar-forced proposals count as the grammar's, not the drafter's. The stats count
        the drafts a row's output took: a row that stops inside its accepted drafts (a stop
        string, a stop id, max_tokens) neither accepted nor drafted the ones after it (the
        depth policy still learns from every verdict: the drafter's quality)."""
        drafted = [len(d) for d in drafts.tokens]
        accepted = [v.accepted for v in verdicts]
        if self.drafter:
            slots = mx.array(accepted, dtype=mx.int32)[:, None, None]  # each row's last slot
            self.drafter.commit(accepted, mx.take_along_axis(hidden, slots, axis=1)[:, 0])
            width = max(drafted) + 1
            own_drafted, own_accepted = _split(drafted, forced)[0], _split(accepted, forced)[0]
            self.depth.observe(self.running, own_drafted, own_accepted, draft_s, verify_s, width)
        keep = []
        for i, (request, verdict) in enumerate(zip(self.running, verdicts, strict=True)):
            produced = request.stats.produced
            out = accept_tokens(request, verdict.tokens, verdict.logprobs)
            taken = request.stats.produced - produced
            if taken <= verdict.accepted:  # stopped at a draft: the rest never counted
                drafted[i] = accepted[i] = taken
            request.stats.steps += 1
            request.stats.drafted += drafted[i]
            request.stats.accepted += accepted[i]
            if request.grammar is not None and out.finish_reason is None:
                broken = request.grammar.advance(out.tokens)
                if broken:  # the grammar library refused a token its own mask allowed
                    out.finish_reason = request.finish_reason = "error"
                    out.error, out.stats = f"grammar: {broken}", request.stats
                    request.stats.finished = time.perf_counter()
            request.emit(out)
            if out.finish_reason is None:
                keep.append(i)
            else:
                self.scheduler.release(request)
        if self.drafter:
            own_drafted, forced_drafted = _split(drafted, forced)
            own_accepted, forced_accepted = _split(accepted, forced)
            self.stats.record(self.drafter.name, own_drafted, own_accepted, draft_s, verify_s)
            if any(forced):
                self.stats.record(GRAMMAR, forced_drafted, forced_accepted, step=False)
        self._keep(keep)

    # --- joining rows -----------------------------------------------------------------
    def _prefill(self) -> bool:
        """Prefill joining rows, one unit at a time, while units fit in the stall target.

        A unit is one long prompt's next whole chunk (block arithmetic) or a group of
        short prompts (one chunk each, not started) in one ragged forward (invariant
        arithmetic), at most a chunk of tokens (every short prompt while no row is
        running: nothing waits on it, and the scheduler admits at most max_rows). Units alternate between the two kinds,
        so a short prompt never waits for a long one's whole prefill; the first unit
        always runs, the next only if the last one's time (with a margin: units of one
        size vary by ~25% in time) still fits in `stall_s` less the running rows' own
        step (its last measured time), which follows in this step.
        Which arithmetic a row gets depends on its prompt alone, never on this schedule.
        """
        chunk = self.prefill_policy.chunk
        budget = self.prefill_policy.stall_s - (self._decode_s if self.running else 0.0)
        # with no rows waiting, all short prompts go in one group: one forward, each weight
        # streamed once per packed call (the grouping never changes a row's arithmetic)
        group_tokens = chunk if self.running else math.inf
        start, last = time.perf_counter(), 0.0
        worked = False
        while self.scheduler.joining:
            if worked and time.perf_counter() - start + NEXT_UNIT_MARGIN * last > budget:
                break
            begin = time.perf_counter()
            joining = self.scheduler.joining
            short = [r for r in joining if r.prefilled == 0 and len(r.prompt) - 1 <= chunk]
            long = [r for r in joining if r not in short]
            if long and (self._long_turn or not short):
                self._prefill_one_chunk(long[0])
                self._long_turn = False
            else:
                group, tokens = [short[0]], len(short[0].prompt) - 1
                for r in short[1:]:
                    tokens += len(r.prompt) - 1
                    if tokens > group_tokens:
                        break
                    group.append(r)
                self._prefill_together(group)
                self._long_turn = True
            worked, last = True, time.perf_counter() - begin
        return worked

    def _prefill_together(self, requests: list[Request]) -> None:
        """Prefill prompts that fit one chunk in one forward (each from its longest cached
        whole-unit prefix) and join them to the cohort."""
        try:
            cache = self.scheduler.short_cache
            start = start_short(cache, self.runner, requests)  # engine/prefill.py
            lengths = [len(r.prompt) - 1 - s for r, s in zip(requests, start.starts, strict=True)]
            width = max(lengths)
            # a row with nothing left to prefill keeps its cached hidden (or none)
            last = mx.concatenate([self.runner.no_hidden(1) if h is None else h
                                   for h in start.hidden])
            if width:
                ids = [
                    r.prompt[s : s + n] + [0] * (width - n)
                    for r, s, n in zip(requests, start.starts, lengths, strict=True)
                ]
                hidden = self.runner.forward(
                    start.rows, mx.array(ids, dtype=mx.int32), lengths, prefill=True
                )
                mx.eval(*start.rows.arrays())
                picks = mx.array([max(0, n - 1) for n in lengths], dtype=mx.int32)[:, None, None]
                seen = mx.array([n > 0 for n in lengths])[:, None]
                last = mx.where(seen, mx.take_along_axis(hidden, picks, axis=1)[:, 0], last)
                keep_short(cache, start, requests, hidden)
            self._join(requests, start.rows, last)
        except Exception as err:  # the cohort is untouched: the rows never joined
            for request in requests:
                self._fail_joining(request, err)

    def _prefill_one_chunk(self, request: Request) -> None:
        """Advance a joining request by one chunk; join the cohort when its prompt is done."""
        try:
            last = self.runner.no_hidden(1)
            if request.joining is None:
                request.joining = self.runner.blank_rows(1)
                hit = start_from_cache(self.scheduler.prefix_cache, request)  # engine/prefill.py
                last = last if hit is None else hit
            todo = request.prompt[request.prefilled : len(request.prompt) - 1]
            piece = todo[: self.prefill_policy.cuts.at(request.prefilled)]  # its next chunk
            if piece:
                last = self.runner.prefill(request.joining, piece, len(piece))[:, 0]
                request.prefilled += len(piece)
                keep_in_cache(self.scheduler.prefix_cache, request, last)
                if hasattr(self.drafter, "prefill"):  # its own rows: prefilled in this unit too
                    self.drafter.prefill(request, request.prefilled)
            if request.prefilled == len(request.prompt) - 1:
                self._join([request], request.joining, last)
        except Exception as err:  # the cohort is untouched: the row never joined
            self._fail_joining(request, err)

    def _join(self, requests: list[Request], rows: StateRows, last: mx.array) -> None:
        """Append prefilled rows (and the drafter's rows for them) to the cohort, all or nothing.
        `last` (n, D): each row's final hidden at its last prefilled token."""
        change = self.rows.prepare_append([rows])
        try:
            companion = self.drafter.prepare_append(requests, last) if self.drafter else None
            change.commit()
            if companion is not None:
                companion.commit()
            mx.eval(*self.rows.arrays())  # the merge runs here: joining, not in the next verify
        finally:
            change.dispose()
        for request in requests:
            self.scheduler.joining.remove(request)
            request.joining = None
            self.running.append(request)

    def _fail_joining(self, request: Request, err: Exception) -> None:
        # validated at submit: a failure here is a bug or the device's, worth a trace
        log.warning("request %s failed while joining the cohort", request.id, exc_info=err)
        self.scheduler.joining.remove(request)
        request.joining = request.draft_joining = None
        self._finish(request, "error", f"{type(err).__name__}: {err}")

    # --- leaving rows -----------------------------------------------------------------
    def _keep(self, keep: list[int]) -> None:
        if len(keep) != len(self.running):
            keep = self.rows.leaving_order(keep)  # survivors may fill holes from the tail
            self.rows.filter_rows(keep)
            if self.drafter:
                self.drafter.filter_rows(keep)
            self.running = [self.running[i] for i in keep]

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        request.joining = request.draft_joining = None
        self.scheduler.release(request)
        request.finish(reason, error)


def _split(counts: list[int], forced: list[bool]) -> tuple[list[int], list[int]]:
    """Per-row counts as (the drafter's, the grammar's): a row's proposals are one or the other."""
    return ([0 if f else c for c, f in zip(counts, forced, strict=True)],
            [c if f else 0 for c, f in zip(counts, forced, strict=True)])  # fmt: skip


class EngineStats:
    """Engine-wide speculation counters, per drafter: tokens, per-position acceptance
    (position j counts rows that drafted it with drafts 1..j-1 all accepted), and the
    wall time of the draft and the verify forward of each step."""

    def __init__(self) -> None:
        self.drafted: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.reached: dict[str, list[int]] = {}
        self.hits: dict[str, list[int]] = {}
        self.steps = 0
        self.row_steps = 0
        self.draft_s = 0.0
        self.verify_s = 0.0

    def record(
        self,
        drafter: str,
        drafted: list[int],
        accepted: list[int],
        draft_s: float = 0.0,
        verify_s: float = 0.0,
        step: bool = True,
    ) -> None:
        """step=False: proposals of a step already recorded under another name."""
        self.drafted[drafter] = self.drafted.get(drafter, 0) + sum(drafted)
        self.accepted[drafter] = self.accepted.get(drafter, 0) + sum(accepted)
        reached = self.reached.setdefault(drafter, [])
        hits = self.hits.setdefault(drafter, [])
        for d, a in zip(drafted, accepted, strict=True):
            for j in range(min(d, a + 1)):
                if j == len(reached):
                    reached.append(0)
                    hits.append(0)
                reached[j] += 1
                hits[j] += j < a
        if step:
            self.steps += 1
            self.row_steps += len(drafted)
        self.draft_s += draft_s
        self.verify_s += verify_s

    def acceptance(self, drafter: str) -> float:
        return self.accepted.get(drafter, 0) / max(1, self.drafted.get(drafter, 0))

    def position_acceptance(self, drafter: str) -> list[float]:
        """P(draft j accepted | drafts before it accepted), per draft position."""
        return [h / max(1, r) for h, r in zip(self.hits.get(drafter, []),
                                              self.reached.get(drafter, []), strict=True)]

    def tokens_per_forward(self, drafter: str) -> float:
        """Tokens a row emits per target forward (accepted drafts + the target's own)."""
        return 1.0 + self.accepted.get(drafter, 0) / max(1, self.row_steps)
