"""Row-stable projections: a row's `x @ W.T` must not depend on the call it is computed in.

A fast BLAS picks kernels by shape. Measured here, two regimes exist:
  * large-call regime (OpenBLAS's native kernels): few rows take gemv and
    small-matrix paths, but from some row count on every row's result is the
    same whatever the count or the row's position — pad small calls up to it;
  * small-call regime (OpenBLAS forced to its Haswell kernels, as on this
    machine): a row's result depends on its position inside a large call
    (rows 0-5 and 6-11 of a 48-row tile differ), but calls of at most c rows
    all equal the one-row result — split calls into pieces of at most c rows.
    The turned form `(W @ x.T).T` puts the rows on the BLAS call's other side,
    where (measured here) calls of 1 to 30 rows all equal the one-row result:
    calls of more than c rows run turned, in pieces of at most `wide` rows, so
    16 rows stream each weight once instead of twice; so do calls of 2 or 3 rows
    (`SMALL_TURNED`: a k = 1 or 2 verify at one row, or 2-3 decoding rows, cost
    about one row's step turned); the other calls of at most c rows run as they
    are (no timing: the plan is the same in every build).
`probe_plan` measures a projection once and returns its `RowPlan`.
`row_stable(model)` returns a copy of the module tree (sharing every weight
array) whose projections follow their plans and whose attention layers run the
row caches' batch-invariant attention (kv/state_rows.rows_model, verified by a
probe forward); the plain path keeps using the untouched model.

While `BlockMode.on` (one row's own prefill chunk, whose shape depends on that
row alone), projections make one call of any size: exactness needs only that
the same row always gets the same arithmetic, and a whole chunk is the same
call alone or batched.
While `BlockMode.packed` (prompts prefilled together), projections make calls of
one of the `pack` sizes, zero-padded, in which a row's result depends only on its
position mod `period` — the same in every one of those sizes (probed, `_packing`);
the runner lays every prompt out at multiples of `pack_alignment` (the periods'
lcm), so a prompt gets the same rows alone or among others: many rows stream
each weight once per 768 rows (not per 30), a few rows take the smallest call.

Oracle: tests/test_invariance.py (the plan's rows equal one-row / large-call
results; the regime found here is needed; packed calls at every aligned offset,
off the period not exact), tests/test_invariance_smollm2.py (prompts prefilled
together == alone), tests/test_attention_routing.py and the engine exactness
tests (tests/test_engine.py).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn

from mlx_tandem._blas import blas_threads
from mlx_tandem.kv.attention import BlockMode
from mlx_tandem.kv.state_rows import rows_model
from mlx_tandem.models.activations import vectorised_activations
from mlx_tandem.models.graph import backbone_path, is_tied

PROBE_ROWS = (*range(1, 33), 40, 48, 64, 96, 128, 144, 160, 192)
REFERENCE_ROWS = 256
MAX_PAD = 64  # beyond this, padding costs more than splitting
MAX_CHUNK = 16
MAX_WIDE = 32
PACK_SIZES = (48, 96, 144, 192, 384, 768)  # packed calls' row counts (past the base: its multiples)
PACK_BASE = 192  # the packed call size that must hold for any packing
MAX_PERIOD = 16
SMALL_TURNED = 3  # calls of 2 .. this many rows run turned where exact (faster here: BENCHMARKS)
PROJECTIONS = (nn.Linear, nn.QuantizedLinear)
HEAD = "lm_head"  # an untied LM head's name in mlx-lm's models

Fn = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class RowPlan:
    """How one projection keeps a row's arithmetic independent of the call."""

    pad_to: int = 1  # large-call regime: calls with fewer rows are padded to this many
    chunk: int = 0  # small-call regime (> 0): calls are split into pieces of <= chunk rows
    wide: int = 0  # small-call regime, turned form: exact for calls of 1 .. wide rows
    turned_from: int = 0  # calls of this many rows or more run turned (pieces <= wide); 0: never
    turned_small: int = 0  # ... and so do calls of 2 .. turned_small rows
    pack: tuple[int, ...] = ()  # prompts prefilled together: calls of these sizes (padded) ...
    period: int = 0  # ... in which a row's result depends only on its position mod `period`

    def as_is(self, rows: int) -> bool:
        """Whether a decode or verify call of `rows` rows runs the function as it is (one
        call, no padding, not turned)."""
        turned = self.turns(rows)
        split = self.chunk and rows > self.chunk
        return not turned and not split and rows >= self.pad_to

    def turns(self, rows: int) -> bool:
        """Whether a decode or verify call of `rows` rows runs turned."""
        return bool(self.turned_from) and (
            rows >= self.turned_from or 2 <= rows <= self.turned_small
        )


def probe_plan(
    fn: Fn,
    in_dims: int,
    dtype: mx.Dtype = mx.float32,
    turned: Fn | None = None,
    packable: bool = False,
) -> RowPlan:
    """Measure fn's regime: the padding from which rows are stable, else the largest exact chunk
    (and, given fn's turned form, up to how many rows every turned call is exact: calls
    that the plain form would split run turned, either form gives the same rows;
    `packable`: the call size and period of packed calls, see `_packing`)."""
    x = _probe_rows(REFERENCE_ROWS, in_dims, dtype)
    ref = fn(x)
    mx.eval(ref)
    if mx.array_equal(fn(x[::-1])[::-1], ref).item():  # no dependence on a row's position
        unstable = [m for m in PROBE_ROWS if not mx.array_equal(fn(x[:m]), ref[:m]).item()]
        first = max(unstable) + 1 if unstable else 1
        for pad in [first, *(m for m in PROBE_ROWS if first < m <= MAX_PAD)]:
            if all(_padded_exact(fn, x, ref, rows, pad) for rows in (1, 2, 3, 5)):
                return RowPlan(pad_to=pad)
    reach = MAX_WIDE if turned is not None else MAX_CHUNK
    single = mx.concatenate([fn(x[i : i + 1]) for i in range(reach + 3)])
    chunk = _exact_up_to(fn, x, single, 1, MAX_CHUNK)
    pack, period = _packing(fn, _probe_rows(PACK_SIZES[-1] + 5 * MAX_PERIOD, in_dims, dtype)) \
        if packable else ((), 0)
    wide = _exact_up_to(turned, x, single, 0, MAX_WIDE, (3,)) if turned is not None else 0
    if turned is None or wide <= chunk:
        return RowPlan(chunk=chunk, pack=pack, period=period)
    # Turned where the plain form would split, and for calls of 2 .. SMALL_TURNED rows; the
    # other calls of at most `chunk` rows run as they are. Not timed: a timed choice
    # differed from build to build on a noisy machine
    # (docs/BENCHMARKS.md, session 18), and the plan must be the same in every build.
    return RowPlan(chunk=chunk, wide=wide, turned_from=chunk + 1,
                   turned_small=min(SMALL_TURNED, wide), pack=pack, period=period)


def _probe_rows(rows: int, in_dims: int, dtype: mx.Dtype) -> mx.array:
    return mx.random.normal((rows, in_dims), key=mx.random.key(in_dims)).astype(dtype)


def _packing(fn: Fn, x: mx.array) -> tuple[tuple[int, ...], int]:
    """The call sizes of PACK_SIZES, and the least period <= MAX_PERIOD, such that in calls
    of exactly any of those sizes every row's result depends only on its own input and its
    position mod the period, the same in every size (measured: OpenBLAS's Haswell kernels
    tile 12 rows, so 48- to 768-row calls agree with period 12). Prompts laid out at
    period-aligned offsets then get the same arithmetic in any packed calls, whatever else
    fills them; ((), 0) where the base size has no period. Sizes up to PACK_BASE are
    probed by rolling; a larger call must equal the base-size calls of its pieces (so its
    rows inherit the base size's period), at two alignments of the input."""
    rows = x[:PACK_BASE]
    ref = fn(rows)
    period = next((p for p in range(1, MAX_PERIOD + 1)
                   if PACK_BASE % p == 0 and _periodic(fn, rows, ref, p)), 0)
    if not period:
        return (), 0
    sizes = [PACK_BASE]
    for size in PACK_SIZES:
        if size == PACK_BASE or size % period:
            continue
        if size < PACK_BASE:
            fits = _periodic(fn, x[:size], fn(x[:size]), period) and all(
                mx.array_equal(fn(x[k : k + size])[:period], ref[k : k + period]).item()
                for k in (0, 5 * period))
        else:
            fits = all(_as_pieces(fn, x[k : k + size]) for k in (0, 5 * period))
        if fits:
            sizes.append(size)
    return tuple(sorted(sizes)), period


def _as_pieces(fn: Fn, rows: mx.array) -> bool:
    """Whether one call over rows equals PACK_BASE-row calls over its consecutive pieces."""
    pieces = [fn(rows[i : i + PACK_BASE]) for i in range(0, rows.shape[0], PACK_BASE)]
    return mx.array_equal(fn(rows), mx.concatenate(pieces)).item()


def _periodic(fn: Fn, rows: mx.array, ref: mx.array, period: int) -> bool:
    """Whether every roll of `rows` by a multiple of `period` moves the results with it, and
    a period of rows among zeros gets the results it gets among other rows."""
    size = rows.shape[0]
    for shift in range(period, size, period):
        if not mx.array_equal(mx.roll(fn(mx.roll(rows, shift, 0)), -shift, 0), ref).item():
            return False
    alone = mx.zeros_like(rows)
    alone[period : 2 * period] = rows[period : 2 * period]
    ours = slice(period, 2 * period)
    return mx.array_equal(fn(alone)[ours], ref[ours]).item()


def _exact_up_to(
    fn: Fn, x: mx.array, single: mx.array, start: int, most: int, offsets: tuple = (0, 3)
) -> int:
    """The largest n <= most such that fn's calls of start+1 .. n rows equal one-row results."""
    n = start
    while n < most and all(
        mx.array_equal(fn(x[s : s + n + 1]), single[s : s + n + 1]).item() for s in offsets
    ):
        n += 1
    return n


def _padded_exact(fn: Fn, x: mx.array, ref: mx.array, rows: int, pad: int) -> bool:
    """Whether `rows` rows zero-padded to `pad` (and shifted by 7) get the reference results."""
    if rows >= pad:
        return True
    zeros = mx.zeros((pad - rows, x.shape[-1]), x.dtype)
    return all(
        mx.array_equal(fn(mx.concatenate([x[s : s + rows], zeros]))[:rows], ref[s : s + rows]).item()
        for s in (0, 7)
    )


def _in_dims(m: nn.Module) -> int:
    return m.weight.shape[-1] * (32 // m.bits) if hasattr(m, "bits") else m.weight.shape[-1]


def _dtype(m: nn.Module) -> mx.Dtype:
    return m.scales.dtype if hasattr(m, "scales") else m.weight.dtype


def turned_form(module: nn.Module) -> Fn | None:
    """`(W @ x.T).T` (+ bias, added as the module adds it) for a float Linear or a float
    Embedding's `as_linear` (tied heads); None for quantized projections."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or not isinstance(
        module, (nn.Linear, nn.Embedding)
    ):
        return None
    weight = module.weight
    if "bias" in module:
        bias = module.bias[:, None]
        return lambda x: mx.addmm(bias, weight, x.T).T
    return lambda x: (weight @ x.T).T


def follow_plan(fn: Fn, plan: RowPlan, block: BlockMode, turned: Fn | None = None) -> Fn:
    """fn over (..., in) with the plan's padding or splitting applied to the flattened rows."""
    if plan.pad_to <= 1 and plan.chunk == 0:
        return fn
    if plan.turned_from:
        assert turned is not None, "a plan with a turned form needs that form"

    def rows_of(flat: mx.array) -> mx.array | None:
        """The plan's calls over flat's rows; None where the plan calls fn as it is."""
        rows = flat.shape[0]
        if block.packed and plan.pack:
            return _packed(fn, flat, plan.pack)
        if plan.as_is(rows):
            return None
        if plan.turns(rows) and not block.on:
            return _pieces(turned, flat, plan.wide)
        if plan.chunk and rows > plan.chunk and not block.on:
            return _pieces(fn, flat, plan.chunk)
        if rows < plan.pad_to:
            zeros = mx.zeros((plan.pad_to - rows, flat.shape[-1]), flat.dtype)
            return fn(mx.concatenate([flat, zeros]))[:rows]
        return None

    def planned(x: mx.array) -> mx.array:
        lead, rows = x.shape[:-1], x.size // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1])
        ragged = block.ragged
        if ragged is not None and rows == ragged.total:  # real slots only (kv/attention.Ragged)
            real = flat[ragged.take]
            y = rows_of(real)
            y = (fn(real) if y is None else y)[ragged.back]
        else:
            y = rows_of(flat)
            if y is None:
                return fn(x)
        return y.reshape(*lead, y.shape[-1])

    return planned


def _packed(fn: Fn, flat: mx.array, sizes: tuple[int, ...]) -> mx.array:
    """fn over flat's rows in calls of the largest size while more rows remain, then of the
    smallest size that holds the rest, zero-padded (every boundary a multiple of the period)."""
    rows, start, out = flat.shape[0], 0, []
    while start < rows:
        left = rows - start
        size = next((s for s in sizes if s >= left), sizes[-1])
        piece = flat[start : start + size]
        if size > left:
            piece = mx.concatenate([piece, mx.zeros((size - left, flat.shape[-1]), flat.dtype)])
        out.append(fn(piece))
        start += size
    y = out[0] if len(out) == 1 else mx.concatenate(out)
    return y[:rows]


def pack_alignment(stable: nn.Module) -> int:
    """The offset unit a packed prefill lays each prompt out at (the periods' least common
    multiple), or 0 where some projection cannot be packed: then prompts prefilled
    together keep the invariant pieces."""
    unit = 1
    for name, m in stable.named_modules():
        if name.split(".")[-1] == HEAD:
            continue
        if isinstance(m, RowStableProjection) and m.plan.chunk:
            if not m.plan.pack:
                return 0
            unit = math.lcm(unit, m.plan.period)
    return unit


def row_quantum(stable: nn.Module) -> int:
    """The most rows one call of every planned projection takes in a decode or verify
    forward (0: no projection splits its calls). A forward of T rows calls each of those
    ceil(T / quantum) times, each call streaming the weight again."""
    sizes = [m.plan.wide if m.plan.turned_from else m.plan.chunk
             for m in stable.modules() if isinstance(m, RowStableProjection)]
    return min((q for q in sizes if q), default=0)


def small_turned(stable: nn.Module) -> int:
    """The most rows of a call that every planned projection (the LM head aside) runs
    turned as a small call (`RowPlan.turned_small`; 0: none): a verify of 2 .. this many
    real slots costs about one row's step, more slots a step of their own."""
    sizes = [m.plan.turned_small for name, m in stable.named_modules()
             if isinstance(m, RowStableProjection) and name.split(".")[-1] != HEAD]
    return min(sizes, default=0)


def _pieces(fn: Fn, flat: mx.array, most: int) -> mx.array:
    """fn over flat's rows in even pieces of at most `most` rows (every such size is exact)."""
    rows = flat.shape[0]
    if rows <= most:
        return fn(flat)
    size = -(-rows // -(-rows // most))
    return mx.concatenate([fn(flat[i : i + size]) for i in range(0, rows, size)])


class RowStableProjection(nn.Module):
    """A Linear / QuantizedLinear whose calls follow its probed RowPlan."""

    def __init__(self, inner: nn.Module, plan: RowPlan, block: BlockMode) -> None:
        super().__init__()
        self.inner = inner
        self.plan = plan
        self._call = follow_plan(inner, plan, block, turned_form(inner))

    def __call__(self, x: mx.array) -> mx.array:
        return self._call(x)


class RowStableEmbedding(nn.Embedding):
    """A float Embedding whose tied-head use (`as_linear`) follows its probed RowPlan; looking
    tokens up is unchanged. Made by `stable_projections` from a copy (weights shared)."""

    _as_linear: Fn
    plan: RowPlan

    def as_linear(self, x: mx.array) -> mx.array:
        return self._as_linear(x)


def _stable_embedding(module: nn.Embedding, plan: RowPlan, block: BlockMode) -> nn.Module:
    if plan == RowPlan():
        return module
    out = copy.copy(module)
    out.__class__ = RowStableEmbedding
    out.plan = plan
    out._as_linear = follow_plan(module.as_linear, plan, block, turned_form(module))
    return out


def stable_projections(
    model: nn.Module, block: BlockMode, plans: dict[tuple, RowPlan] | None = None
) -> tuple[nn.Module, dict[tuple, RowPlan]]:
    """A copy of `model` (sharing every array) whose projections (and, for a tied head, the
    float embedding's `as_linear`) follow their probed plans. `plans` (kind and shape ->
    plan; filled in here) lets later copies of the same model skip the probes: a plan
    depends on the BLAS and the shape only, and probing a 262k-row head takes seconds."""
    plans = {} if plans is None else plans
    head = _token_embedding(model) if is_tied(model) else None
    threads = blas_threads()

    def plan(m: nn.Module, fn: Fn, packable: bool, is_head: bool = False) -> RowPlan:
        key = (type(m).__name__, tuple(m.weight.shape), getattr(m, "bits", None), "bias" in m,
               str(_dtype(m)), packable, threads)
        if key not in plans:
            plans[key] = probe_plan(fn, _in_dims(m), _dtype(m), turned_form(m), packable)
        # the LM head's 2-3-row calls stay as they are: turned they are no faster, and an
        # as-is call lets a greedy verify read the exact logits instead of certifying picks
        # from a second, fast call (engine/runner.greedy_picks): measured, BENCHMARKS session 26
        return replace(plans[key], turned_small=0) if is_head else plans[key]

    def rebuild(module: nn.Module, packable: bool = True) -> nn.Module:
        """`packable`: runs in packed prefills (every projection but the LM head, which a
        prefill never calls)."""
        if isinstance(module, PROJECTIONS):
            p = plan(module, module, packable, is_head=not packable)
            return module if p == RowPlan() else RowStableProjection(module, p, block)
        if module is head and type(module) is nn.Embedding:
            linear_plan = plan(module, module.as_linear, False, is_head=True)
            return _stable_embedding(module, linear_plan, block)
        out = copy.copy(module)  # shares arrays; children replaced below, never mutated
        for key, value in module.items():
            if isinstance(value, nn.Module):
                out[key] = rebuild(value, key != HEAD)
            elif isinstance(value, list) and any(isinstance(v, nn.Module) for v in value):
                out[key] = [rebuild(v) if isinstance(v, nn.Module) else v for v in value]
        return out

    return rebuild(model), plans


def _token_embedding(model: nn.Module) -> nn.Module | None:
    backbone = model
    for name in backbone_path(model):
        backbone = backbone[name]
    return next((backbone[n] for n in ("embed_tokens", "embeddings") if n in backbone), None)


def head_plan(stable: nn.Module) -> RowPlan | None:
    """The plan `stable_projections` gave the LM head's matmul (a tied float embedding's
    `as_linear` or an `lm_head` projection; RowPlan(): calls as they are), or None where it
    planned none (e.g. a tied quantized embedding: the runner plans that head itself)."""
    if is_tied(stable):
        head = _token_embedding(stable)
        return head.plan if isinstance(head, RowStableEmbedding) else None
    head = stable.get("lm_head")
    if isinstance(head, RowStableProjection):
        return head.plan
    return RowPlan() if isinstance(head, PROJECTIONS) else None


def row_stable(
    model: nn.Module, block: BlockMode | None = None, plans: dict[tuple, RowPlan] | None = None
) -> tuple[nn.Module, dict[tuple, RowPlan]]:
    """The rows engine's copy of `model` (projections following their plans, MLP activations
    vectorised (models/activations.py), attention routed to the row caches) and the plans
    (`plans`: see stable_projections). Raises ValueError for a model with an attention layer
    that does not route."""
    block = block or BlockMode()
    stable, plans = stable_projections(model, block, plans)
    return rows_model(vectorised_activations(stable), block), plans
