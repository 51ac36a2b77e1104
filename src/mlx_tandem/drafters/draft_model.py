"""Draft-model source (the seed's `MlxAutoregressiveDraftRows`): a small model drafts for every row.

The drafter keeps its own StateRows in the cohort's row order and runs the
batch-invariant ModelRunner, so a row's drafts never depend on its neighbours.
Each step it feeds every row its pending input — the target's last token, plus
the previous step's last draft when that draft was fully accepted and so never
fed ("pending last", per-row padded to two tokens) — then drafts one token per
forward, snapshotting the state after each forward. On commit each row is
restored from the snapshot after its last accepted draft (attention layers by
end, recurrent layers by their arrays): never by trimming, so recurrent draft
models work. Depth 0 still consumes the pending input.

Oracle: tests/test_speculative.py (greedy == plain for self, perturbed, random
and recurrent draft models; seeded rows alone == batched).
"""

from __future__ import annotations

import mlx.core as mx

from mlx_tandem.drafters.row_sampling import DraftRowSampling
from mlx_tandem.engine.draft_source import Drafts
from mlx_tandem.engine.request import Request
from mlx_tandem.engine.runner import ModelRunner
from mlx_tandem.engine.sampling import MAX_DRAFT
from mlx_tandem.kv.state_rows import PreparedChange, StateRows
from mlx_tandem.models.families import check_engine
from mlx_tandem.models.loader import LoadedModel


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    tv, dv = target.graph.vocab_size, draft.graph.vocab_size
    if tv != dv or len(target.tokenizer.vocab) != len(draft.tokenizer.vocab):
        raise ValueError(
            f"draft model {draft.name!r} has vocabulary {dv} (tokenizer {len(draft.tokenizer.vocab)}), "
            f"target {target.name!r} has {tv} (tokenizer {len(target.tokenizer.vocab)}): "
            "a draft model must share the target's tokenizer"
        )


class DraftModelSource:
    samples = True  # sampled rows draw their drafts from the draft model's distribution
    stateless = False  # its rows hold its own proposals (rewound by snapshot)
    def __init__(self, model: LoadedModel, chunk: int = 512, batch_invariant: bool = True) -> None:
        self.name = f"draft:{model.name}"
        check_engine(model.config, speculative=False)  # it runs in rows (models/families.py)
        self.runner = ModelRunner(model, batch_invariant=batch_invariant)
        self.runner.reach = max(chunk, MAX_DRAFT + 1)  # its prefill chunk or a draft block
        self.rows: StateRows = self.runner.empty_rows()
        self.chunk = chunk
        self.sampling = DraftRowSampling()
        self.pending_last: list[int | None] = []
        self._history: list[StateRows] = []
        self._drafts: list[list[int]] = []
        self._depth = 0

    def prefill(self, request: Request, upto: int) -> None:
        """While `request` joins: advance its own row by whole chunks ending at most at `upto`
        (the target's progress), at most two a call, so this prefill runs inside the engine's
        budgeted prefill units. Chunks start at multiples of `chunk`, as a whole-prompt
        prefill's do: the row's arithmetic never depends on the schedule."""
        row, done = request.draft_joining or (self.runner.blank_rows(1), 0)
        end = min(upto, len(request.prompt) - 1)
        for _ in range(2):
            if done + self.chunk > end:
                break
            self.runner.prefill(row, request.prompt[done : done + self.chunk], self.chunk)
            done += self.chunk
        request.draft_joining = (row, done)

    def prepare_append(self, requests: list[Request], hidden: mx.array) -> PreparedChange:
        parts = []
        for r in requests:  # the drafter sees the same prompt, minus the pending last token
            row, done = r.draft_joining or (self.runner.blank_rows(1), 0)
            if len(r.prompt) - 1 > done:  # the rest: less than a chunk unless it fell behind
                self.runner.prefill(row, r.prompt[done:-1], self.chunk)
            parts.append(row)
        change = self.rows.prepare_append(parts)

        def commit() -> None:
            change.commit()
            self.pending_last += [None] * len(requests)
            for r in requests:
                r.draft_joining = None

        return PreparedChange(commit=commit, dispose=change.dispose)

    def filter_rows(self, keep: list[int]) -> None:
        self.rows.filter_rows(keep)
        self.pending_last = [self.pending_last[i] for i in keep]

    def draft(self, requests: list[Request], depths: list[int], target: StateRows) -> Drafts:
        depth = max(depths, default=0)
        self._history, self._depth = [], depth
        feeds = [
            [r.pending] if last is None else [last, r.pending]
            for r, last in zip(requests, self.pending_last, strict=True)
        ]
        width = max(len(f) for f in feeds)
        ids = mx.array([f + [0] * (width - len(f)) for f in feeds], dtype=mx.int32)
        lengths = [len(f) for f in feeds]
        columns: list[mx.array] = []
        qs: list[list] = [[] for _ in requests]
        for step in range(max(1, depth)):
            hidden = self.runner.forward(self.rows, ids, lengths if step == 0 else None)
            self._history.append(self.rows.clone())
            if depth == 0:
                break
            if step == 0 and width > 1:  # each row's last real position
                picks = mx.array([n - 1 for n in lengths], dtype=mx.int32)[:, None]
                logits = self.runner.logits(hidden, picks)[:, 0]
            else:
                logits = self.runner.logits(hidden)[:, -1]
            token, q = self.sampling.sample(requests, logits, step)
            columns.append(token)
            for i, qi in enumerate(q):
                qs[i].append(qi)
            ids = token[:, None].astype(mx.int32)
        mx.eval(self.rows.arrays())
        values = mx.stack(columns, axis=1).tolist() if columns else [[] for _ in requests]
        self._drafts = [row[:k] for row, k in zip(values, depths, strict=True)]
        q_rows = [
            None if k == 0 or q[0] is None else mx.concatenate(q[:k])
            for q, k in zip(qs, depths, strict=True)
        ]
        return Drafts(tokens=self._drafts, q=q_rows)

    def commit(self, accepted: list[int], hidden: mx.array) -> None:
        depth = self._depth
        choice = [min(a, max(0, depth - 1)) for a in accepted]
        if any(c != len(self._history) - 1 for c in choice):
            self.rows.restore_rows(self._history, choice)
        self.pending_last = [
            self._drafts[i][-1]
            if depth > 0 and a == depth and len(self._drafts[i]) == depth
            else None
            for i, a in enumerate(accepted)
        ]
        self._history, self._drafts, self._depth = [], [], 0
