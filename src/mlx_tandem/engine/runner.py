"""ModelRunner: runs the target graph over StateRows with batch-invariant shapes.

Two kinds of forward, and nothing else touches the model:
  * `prefill(ids)`: one joining row alone, in fixed-size chunks (the chunk size
    is engine configuration, never batch state, so a row's prefill arithmetic
    is the same whatever else is running);
  * `forward(rows, ids, lengths)`: every row of the cohort, L tokens each
    (ragged rows right-padded).
A decode or verify forward (not prefill) runs as compiled segments between the
attentions where the family is covered (engine/compiled_step.py, with the runner's
BlockMode; ragged blocks hand it their real slots): the same planned projections and
row-cache attention, with element-wise primitives fused.
Both run a row-stable copy of the model (models/invariance.row_stable: every
projection follows its probed RowPlan; `prefill` chunks use block arithmetic,
fixed by the row's own chunk boundaries) and
return hidden states; logits are projected only where callers ask, through a
head padded the same way. `greedy_picks` hands a verify whose rows need only their
argmax the picks of one fast head call, certified against the exact head's
(models/certified_head.py), where the head's plan would not make that call anyway.

The runner also owns the rows' KV codec plan (kv/codec.py): which codec each
attention layer stores its committed K/V with. The codec name is validated
against the model's head dims (and the codec kinds the model declares, a
`kv_codecs` attribute, where it sets one) when the runner is built, before any request runs.

Oracle: tests/test_state_rows.py, tests/test_engine.py (each row's logits and
tokens in any cohort equal the row decoded alone).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from mlx_tandem.engine.compiled_step import CompiledStep, compiled_step
from mlx_tandem.kv.attention import BlockMode, Ragged
from mlx_tandem.kv.calibrated import CALIBRATION, layer_stats
from mlx_tandem.kv.codec import FP, CodecSpec, KVCodec, check_dims, parse_codec
from mlx_tandem.kv.recurrent import unrewindable
from mlx_tandem.kv.row_cache import RowKVCache
from mlx_tandem.kv.state_rows import StateRows
from mlx_tandem.models.certified_head import CertifiedHead, certify_head, head_weight
from mlx_tandem.models.graph import MlxLmGraph, Which, bind_graph
from mlx_tandem.models.invariance import (
    RowPlan,
    follow_plan,
    head_plan,
    pack_alignment,
    probe_plan,
    row_quantum,
    row_stable,
    small_turned,
)
from mlx_tandem.models.loader import LoadedModel


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        batch_invariant: bool = True,
        kv_codec: str | CodecSpec = "fp",
        compiled: bool = True,
    ) -> None:
        self.model = model
        self.kv_spec = kv_codec if isinstance(kv_codec, CodecSpec) else parse_codec(kv_codec)
        self._codecs: dict[int, KVCodec] = {}
        self.reach: int | None = None  # most tokens one append brings (sliding layers: a ring)
        self.block = BlockMode()  # on while one row's own prefill chunk runs
        embed = model.graph.embedding
        self.hidden_size = int(model.config.get("hidden_size") or embed.weight.shape[-1])
        self.hidden_dtype = getattr(embed, "scales", embed.weight).dtype
        self.pack_unit = 0  # prompts prefilled together: packed calls, at offsets of this unit
        self.row_quantum = 0  # most rows one projection call of a forward takes (0: any)
        self.small_turned = 0  # calls of 2 .. this many rows run turned (models/invariance)
        self._last_ragged: tuple[tuple | None, Ragged | None] = (None, None)
        # the compiled decode forward: True until built, then it or False (not covered)
        self._decode: CompiledStep | bool = compiled and batch_invariant
        # greedy picks from one fast head call (models/certified_head.py), where the head's
        # plan would not make that call as it is
        self.certified: CertifiedHead | None = None
        self.head_plan: RowPlan | None = None
        if batch_invariant:
            weight = head_weight(model.model, model.graph)
            self.certified = certify_head(model.graph.head, weight)
            stable, _ = row_stable(model.model, self.block, model.row_plans)
            self.pack_unit = pack_alignment(stable)
            self.row_quantum = row_quantum(stable)
            self.small_turned = small_turned(stable)
            self.graph: MlxLmGraph = bind_graph(stable)
            self.head_plan = head_plan(stable)
            if self.head_plan is None:  # not planned with the projections: a tied quantized embedding
                self.head_plan = probe_plan(self.graph.head, self.hidden_size)
                self.graph.head = follow_plan(self.graph.head, self.head_plan, self.block)
        else:
            self.graph = model.graph
        if self.kv_spec.kind != "fp":
            self._plan_codecs()

    def _plan_codecs(self) -> None:
        """Each attention layer's codec, checked against its K/V dims (a traced forward)."""
        spec = self.kv_spec
        probe = StateRows.blank(self.model.model, 1, kind=_CalibrationKV)
        ids = self.model.encode_text(CALIBRATION) if spec.calibrated else [0]
        self.graph.forward_hidden(mx.array([ids], dtype=mx.int32), probe.layers)
        kinds = make_prompt_cache(self.model.model)
        attention = [i for i, c in enumerate(probe.layers) if _first_kv(c) is not None]
        declared = getattr(self.model, "kv_codecs", None)
        stray = [i for i in spec.named_layers if i not in attention]
        if stray:
            raise ValueError(
                f"kv codec {spec.name!r} names layers {stray}, which are not attention layers "
                f"of this model (those are {attention[0]}..{attention[-1]}: {attention})"
            )
        for i in attention:
            cache = _first_kv(probe.layers[i])
            assert cache is not None and cache.kparts and cache.vparts
            window = getattr(kinds[i], "max_size", None)
            stats = None
            if spec.calibrated:
                assert isinstance(cache, _CalibrationKV) and cache.queries is not None
                stats = layer_stats(*cache.fetch(cache.ends[0]), cache.queries)
            codec = spec.for_layer(i, window, i in (attention[0], attention[-1]), stats)
            check_dims(spec, i, codec, cache.kparts[0].shape[3], cache.vparts[0].shape[3], declared)
            self._codecs[i] = codec

    def codec_for(self, layer: int, window: int | None) -> KVCodec:
        """The plan StateRows builds row caches with."""
        return self._codecs.get(layer, FP)

    def empty_rows(self) -> StateRows:
        return StateRows.empty(self.model.model, self.codec_for, reach=self.reach)

    def recurrent_layers(self) -> bool:
        """Whether any layer keeps recurrent state it cannot rewind per row: a traced
        2-token forward leaves it without per-token checkpoints (kv/recurrent.py)."""
        rows = self.blank_rows(1)
        self.graph.forward_hidden(mx.zeros((1, 2), dtype=mx.int32), rows.layers)  # not evaluated
        return bool(unrewindable(rows.leaves()))

    def attention_only(self) -> bool:
        """Whether every layer's state is attention K/V (no recurrent state, which exists
        only at a row's end: the short-prompt cache needs states at unit boundaries)."""
        return not any(isinstance(c, ArraysCache) for c in self.blank_rows(1).leaves())

    def blank_rows(self, n: int) -> StateRows:
        """n rows holding no tokens yet (joining rows before prefill)."""
        return StateRows.blank(self.model.model, n, self.codec_for, reach=self.reach)

    def no_hidden(self, n: int) -> mx.array:
        """(n, D) zeros: the hidden handed over for rows that fed no token yet."""
        return mx.zeros((n, self.hidden_size), self.hidden_dtype)

    def prefill(self, rows: StateRows, ids: list[int], chunk: int) -> mx.array:
        """Run a single row's tokens through `rows` (1 row) in chunks; return last hidden (1, 1, D).

        Each chunk is one call whose shape depends only on this row's chunk boundaries, so
        it may use block arithmetic (one large projection call, fused attention): the row
        gets the same arithmetic whenever and with whatever else it is prefilled.
        """
        assert rows.row_count == 1 and ids
        hidden = None
        self.block.on = True
        try:
            for start in range(0, len(ids), chunk):
                piece = mx.array(ids[start : start + chunk], dtype=mx.int32)[None]
                hidden = self.graph.forward_hidden(piece, rows.layers)
                mx.eval(hidden[:, -1:], *rows.arrays())
        finally:
            self.block.on = False
        assert hidden is not None
        return hidden[:, -1:]

    def forward(
        self, rows: StateRows, ids: mx.array, lengths: list[int] | None = None,
        prefill: bool = False,
    ) -> mx.array:
        """Hidden states (B, L, D) for ids (B, L); afterwards row i's end advanced by lengths[i].
        `prefill`: prompts prefilled together — recurrent layers keep mlx-lm's block form
        (shared by plain and speculative runs); otherwise they step token by token with
        per-token checkpoints (kv/recurrent.py), so a verify block can rewind per row.
        Prompts prefilled together run packed where every projection allows it
        (models/invariance.py): each row is padded to a whole number of pack units, so a
        prompt's token t sits at an offset = t mod unit in every call, alone or batched."""
        B, L = ids.shape
        assert rows.row_count == B
        before = rows.ends
        advance = lengths if lengths is not None else [L] * B
        unit = self.pack_unit if prefill else 0
        if unit and L % unit:
            lengths = advance
            ids = mx.concatenate([ids, mx.zeros((B, unit - L % unit), ids.dtype)], axis=1)
        hidden = self._forward(rows, ids, lengths, prefill, bool(unit))
        rows.set_ends([e + n for e, n in zip(before, advance, strict=True)], padding=True)
        return hidden[:, :L]

    def _forward(
        self, rows: StateRows, ids: mx.array, lengths: list[int] | None, prefill: bool,
        packed: bool,
    ) -> mx.array:
        L = ids.shape[1]
        recurrent = [c for c in rows.leaves() if isinstance(c, ArraysCache)]
        ragged = lengths is not None and any(n != L for n in lengths)
        if ragged:  # recurrent layers must not absorb the right padding
            for c in recurrent:
                c.prepare(lengths=lengths)
        self.block.recurrence, self.block.packed = prefill, packed
        if ragged and not prefill:  # verify blocks: projections run the real slots only
            self.block.ragged = self._ragged(lengths, L)
        try:
            step = None if prefill else self._decode_step(rows)
            if step is None:
                hidden = self.graph.forward_hidden(ids, rows.layers)
            else:
                hidden = step(ids, rows.layers, self.block.ragged)
        finally:
            self.block.recurrence = self.block.packed = False
            self.block.ragged = None
        if ragged:
            for c in recurrent:
                c.finalize()
        return hidden

    def _decode_step(self, rows: StateRows) -> CompiledStep | None:
        """The compiled decode forward, built on first use (None: not covered)."""
        if self._decode is True:
            self._decode = compiled_step(self.graph, rows.layers, self.block) or False
        return self._decode if isinstance(self._decode, CompiledStep) else None

    def logits(
        self, hidden: mx.array, which: Which = "last", lengths: list[int] | None = None
    ) -> mx.array:
        """Logits at `which` positions; with "all" and `lengths`, the head runs row i's first
        lengths[i] slots only (the others get a stand-in: kv/attention.Ragged)."""
        if isinstance(which, str) and which == "all" and lengths is not None:
            self.block.ragged = self._ragged(lengths, hidden.shape[1])
        try:
            return self.graph.project_logits(hidden, which)
        finally:
            self.block.ragged = None

    def greedy_picks(
        self, hidden: mx.array, lengths: list[int], tie: float
    ) -> tuple[mx.array, mx.array] | None:
        """Certified argmax picks and unsure flags (B, L) for the real slots of a verify's
        hidden (B, L, D), from one fast head call; None without a certificate, or where the
        head's plan makes that one call anyway (the exact logits cost no more)."""
        if self.certified is None or self.head_plan is None:
            return None
        B, L, D = hidden.shape
        ragged = self._ragged(lengths, L)
        if self.head_plan.as_is(B * L if ragged is None else int(ragged.take.shape[0])):
            return None
        flat = hidden.reshape(B * L, D)
        picks, unsure = self.certified.picks(flat if ragged is None else flat[ragged.take], tie)
        if ragged is not None:
            picks, unsure = picks[ragged.back], unsure[ragged.back]
        return picks.reshape(B, L), unsure.reshape(B, L)

    def _ragged(self, lengths: list[int], width: int) -> Ragged | None:
        """Ragged.of, built once for a verify's forward and its logits (the same rows)."""
        key = (tuple(lengths), width)
        if self._last_ragged[0] != key:
            self._last_ragged = (key, Ragged.of(lengths, width))
        return self._last_ragged[1]


def _first_kv(cache: object) -> RowKVCache | None:
    """A layer's (first) row KV cache, looking inside CacheLists."""
    if isinstance(cache, RowKVCache):
        return cache
    for c in getattr(cache, "caches", ()):
        if (found := _first_kv(c)) is not None:
            return found
    return None


class _CalibrationKV(RowKVCache):
    """A float row cache that also keeps the queries of its last attention call."""

    queries: mx.array | None = None

    def attend(self, queries, *args, **kwargs) -> mx.array:
        self.queries = queries
        return super().attend(queries, *args, **kwargs)
