"""ModelRunner: runs the target graph over StateRows with batch-invariant shapes.

Two kinds of forward, and nothing else touches the model:
  * `prefill(ids)`: one joining row alone, in fixed-size chunks (the chunk size
    is engine configuration, never batch state, so a row's prefill arithmetic
    is the same whatever else is running);
  * `forward(rows, ids, lengths)`: every row of the cohort, L tokens each
    (ragged rows right-padded), padded with spare rows up to `min_rows` so
    the matmul kernels never change with the cohort size.
Both return hidden states; logits are projected only where callers ask.

Oracle: tests/test_rows_exactness.py (each row's logits in any cohort equal
the row decoded alone).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from mlx_tandem.kv.state_rows import StateRows
from mlx_tandem.models.graph import MlxLmGraph, Which
from mlx_tandem.models.invariance import probe_min_rows
from mlx_tandem.models.loader import LoadedModel


class ModelRunner:
    def __init__(self, model: LoadedModel, batch_invariant: bool = True) -> None:
        self.model = model
        self.graph: MlxLmGraph = model.graph
        self.min_rows = probe_min_rows(model.model, model.graph.head) if batch_invariant else 1

    def empty_rows(self) -> StateRows:
        return StateRows.empty(self.model.model)

    def blank_row(self) -> StateRows:
        """A one-row state holding no tokens yet (a joining row before prefill)."""
        return StateRows.blank(self.model.model, 1)

    def prefill(self, rows: StateRows, ids: list[int], chunk: int) -> mx.array:
        """Run a single row's tokens through `rows` (1 row) in chunks; return last hidden (1, 1, D)."""
        assert rows.row_count == 1 and ids
        hidden = None
        for start in range(0, len(ids), chunk):
            piece = mx.array(ids[start : start + chunk], dtype=mx.int32)[None]
            hidden = self.graph.forward_hidden(piece, rows.layers)
            mx.eval(hidden[:, -1:], *rows.arrays())
        assert hidden is not None
        return hidden[:, -1:]

    def forward(self, rows: StateRows, ids: mx.array, lengths: list[int] | None = None) -> mx.array:
        """Hidden states (B, L, D) for ids (B, L); afterwards row i's end advanced by lengths[i]."""
        B, L = ids.shape
        assert rows.row_count == B
        before = rows.ends
        spare = max(0, -(-self.min_rows // L) - B)
        rows.ensure_spare(spare)
        if rows.spare:
            ids = mx.concatenate([ids, mx.zeros((rows.spare, L), ids.dtype)])
        recurrent = [c for c in rows.leaves() if isinstance(c, ArraysCache)]
        ragged = lengths is not None and any(n != L for n in lengths)
        if ragged:  # recurrent layers must not absorb the right padding
            for c in recurrent:
                c.prepare(lengths=[*lengths, *([L] * rows.spare)])
        hidden = self.graph.forward_hidden(ids, rows.layers)
        if ragged:
            for c in recurrent:
                c.finalize()
        advance = lengths if lengths is not None else [L] * B
        rows.set_ends([e + n for e, n in zip(before, advance, strict=True)])
        return hidden

    def logits(self, hidden: mx.array, rows: int, which: Which = "last") -> mx.array:
        """Project the first `rows` rows' positions (spare rows ride along for stable shapes)."""
        extra = hidden.shape[0] - rows
        if isinstance(which, mx.array) and extra > 0:
            which = mx.concatenate([which, mx.zeros((extra, which.shape[1]), which.dtype)])
        return self.graph.project_logits(hidden, which)[:rows]
