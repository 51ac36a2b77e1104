"""Assistant draft source (the seed's `assistant-target`): Q-only layers over the target's K/V.

Per row it keeps one thing, the seed hidden: the target's final hidden at the
last position the target consumed (the verify slot of the last accepted token,
or the last prefilled prompt token), handed over by the engine with no second
forward. A round feeds the row's pending token and the seed, then its own draft
and `h_next`, `depth` times, every step querying the row's committed length
(its end in the target's rows) with keys masked per row: columns before the
row's end, and for sliding layers only the last `window` of them. The donor K/V
are the target's rows as they are — nothing to rewind: a rejection only moves
the target's ends and replaces the seed.

Greedy mode (`samples=False`) drafts the argmax; the engine verifies those by
each position's own keyed sample, so a seeded row's text is plain sampling's.
Sampled mode draws from the drafter's own distribution (zero outside the draft
vocabulary) and hands q to the rejection rule. Projections follow their row
plans and attention is the batch-invariant one, so a row's drafts never
depend on its neighbours.

Oracle: tests/test_assistant.py (greedy speculative == plain at depths 1..6,
rows joining and leaving, the target's rows kept in groups; seeded rows alone ==
batched in sampled mode; the chi-square test with the assistant's q).
"""

from __future__ import annotations

import mlx.core as mx

from mlx_tandem.drafters.row_sampling import DraftRowSampling
from mlx_tandem.engine.draft_source import Drafts
from mlx_tandem.engine.request import Request
from mlx_tandem.kv.attention import BlockMode, invariant_attention
from mlx_tandem.kv.row_cache import RowKVCache
from mlx_tandem.kv.state_rows import PreparedChange, StateRows
from mlx_tandem.models.assistant import Assistant, bind_target, embed_tokens
from mlx_tandem.models.invariance import stable_projections
from mlx_tandem.models.loader import LoadedModel

MODES = ("greedy", "sample")


class AssistantSource:
    def __init__(self, assistant: Assistant, target: LoadedModel, mode: str = "greedy") -> None:
        if mode not in MODES:
            raise ValueError(f"assistant drafting mode must be one of {MODES}, got {mode!r}")
        cfg = assistant.config
        width = target.config.get("hidden_size")
        if width is not None and int(width) != cfg.backbone_hidden_size:
            raise ValueError(
                f"assistant for a {cfg.backbone_hidden_size}-wide target "
                f"({cfg.target or 'unnamed'}) cannot draft for {target.name!r} "
                f"(hidden size {width})"
            )
        self.name = "assistant"
        self.samples = mode == "sample"
        self.stateless = True  # per row only the seed hidden, which the engine hands over
        self.target = target.model
        self.donors = bind_target(assistant, target.model)
        mx.eval(assistant.parameters())  # nothing lazy may cross into the engine's thread
        self.net, _ = stable_projections(assistant, BlockMode())
        self.embed_scale = cfg.embed_scale
        self.vocab = target.graph.vocab_size
        self.sampling = DraftRowSampling()
        self.seed: mx.array | None = None  # (B, backbone) seed hiddens, in row order

    def prepare_append(self, requests: list[Request], hidden: mx.array) -> PreparedChange:
        def commit() -> None:
            self.seed = hidden if self.seed is None else mx.concatenate([self.seed, hidden])

        return PreparedChange(commit=commit, dispose=lambda: None)

    def filter_rows(self, keep: list[int]) -> None:
        if self.seed is not None:
            self.seed = self.seed[mx.array(keep, dtype=mx.int32)] if keep else None

    def commit(self, accepted: list[int], hidden: mx.array) -> None:
        self.seed = hidden

    def draft(self, requests: list[Request], depths: list[int], target: StateRows) -> Drafts:
        depth = max(depths, default=0)
        B = len(requests)
        if depth == 0 or not self._holds_kv(target):  # one-token prompts: nothing to read yet
            return Drafts([[] for _ in requests], [None] * B)
        assert self.seed is not None and self.seed.shape[0] == B
        ends = target.ends
        offset = mx.array(ends, dtype=mx.int32)
        read: dict[tuple[int, int | None], tuple[mx.array, mx.array, mx.array]] = {}
        for d in self.donors:  # layers reading the same target layer share its K/V and mask
            if (d.index, d.window) not in read:
                read[d.index, d.window] = self._donor_kv(target, d.index, d.window)
        donors = [read[d.index, d.window] for d in self.donors]
        tokens = mx.array([r.pending for r in requests], dtype=mx.int32)
        h = self.seed[:, None, :]
        columns, q_steps = [], []  # q_steps: per step, each row's q (sampled mode only)
        for step in range(depth):
            e = embed_tokens(self.target, tokens[:, None], self.embed_scale)
            logits, h = self.net(e, h, donors, self.donors, offset, invariant_attention)
            if self.samples:
                tokens, q = self.sampling.sample(requests, self._full_vocab(logits[:, 0]), step)
                q_steps.append(q)
            else:
                tokens = self._token_ids(mx.argmax(logits[:, 0], axis=-1))
            columns.append(tokens)
        values = mx.stack(columns, axis=1).tolist()
        drafts = [row[:k] for row, k in zip(values, depths, strict=True)]
        q_rows: list[mx.array | None] = [None] * B
        for i, k in enumerate(depths):
            if q_steps and k and q_steps[0][i] is not None:
                q_rows[i] = mx.concatenate([q_steps[j][i] for j in range(k)])
        return Drafts(tokens=drafts, q=q_rows)

    def _token_ids(self, index: mx.array) -> mx.array:
        """Draft-vocabulary indices -> target token ids."""
        vocab = getattr(self.net, "draft_vocab", None)
        return index if vocab is None else vocab[index]

    def _full_vocab(self, logits: mx.array) -> mx.array:
        """Draft-vocabulary logits scattered into the target's vocabulary (-inf elsewhere)."""
        vocab = getattr(self.net, "draft_vocab", None)
        if vocab is None:  # the head already spans the whole vocabulary
            return logits
        full = mx.full((logits.shape[0], self.vocab), -mx.inf, logits.dtype)
        full[:, vocab] = logits
        return full

    def _holds_kv(self, target: StateRows) -> bool:
        """Whether the target's rows hold K/V yet: a cohort of one-token prompts has fed
        nothing before its first decode step (each row's pending token is its prompt)."""
        cache = target.layers[self.donors[0].index]
        return not isinstance(cache, RowKVCache) or cache.capacity > 0

    @staticmethod
    def _donor_kv(
        target: StateRows, layer: int, window: int | None
    ) -> tuple[mx.array, mx.array, mx.array]:
        cache = target.layers[layer]
        # capacity, not the layer's own buffers: a grouped cohort keeps its K/V in the groups
        if not isinstance(cache, RowKVCache) or cache.capacity == 0:
            raise ValueError(f"target layer {layer} holds no attention K/V for the assistant")
        return cache.committed(window)  # decoded through the layer's KV codec
