"""Batch-invariant attention: the arithmetic the rows engine's row caches attend with.

Under a fast BLAS a matmul's per-row result depends on the call's shape, and on
some kernels (OpenBLAS's Haswell sgemm, measured on this machine) also on the
row's position inside the call: identical rows 0-5 and 6-11 of one call differ.
So `softmax(q k^T) v` for a row would change with the batch size, the number
of query positions and where the row sits. `invariant_attention` removes every
such dependence:
  * each (row, kv head)'s query rows (rep heads x L positions, flattened) are
    cut into groups of exactly `group_rows` rows (the last padded with zeros),
    and every group is its own matmul of one fixed shape, so a query row's
    scores never depend on how many queries, rows or positions share the call;
    for float keys and values, where more rows are exact turned (`keys @ q^T`,
    `v^T @ p^T`: the queries on the BLAS call's other side, where every call of
    1 .. `stable_turned_rows` rows gives a row its one-row bits, 7 here against
    3 as it is), the groups are turned and even, up to that many rows: a 2-token
    verify's 6 query rows per kv head take one call instead of two;
  * `p v` is summed over fixed KEY_CHUNK-wide key chunks, each a matmul of one
    shape, added in order (a BLAS splits a long inner dimension at points that
    depend on its total length; trailing masked chunks add exact zeros); the last
    chunk reads only the scored keys' spans where a probe finds that dropping
    zero-weighted trailing columns keeps the bits (`narrow_chunks_exact`: one K
    block accumulated in order, as OpenBLAS does), so short rows do not pay for
    a whole chunk;
  * scores and softmax cover only the keys given (callers read whole KEY_SPAN
    spans, narrower than a chunk: the scalar `exp` of masked columns was most
    of a short row's attention); a masked column's weight is exactly 0 however
    many follow, and the weights are zero-padded to whole chunks for `p v`
    (values may come that wide already: a row cache hands them so); the softmax's
    exp is `masked_softmax`'s fused polynomial (exp itself runs scalar on a CPU).
Keys or values may come `Packed` (MLX affine codes, kv/codec.py's affine codecs),
multiplied in the same groups and key chunks without decoding every stored column
each step: scores as fixed-shape matmuls over the integer codes with the scales and
biases applied to the scores (`Packed.scores`), `p v` as `mx.quantized_matmul`.
`stable_group_rows` probes, once per head shape, which group sizes are exact
here and picks one. `block_attention` is the other arithmetic: mlx's fused
attention over one row's own prefill chunk, whose shape is fixed by that row's
chunk boundaries alone (see kv/row_cache.RowKVCache.block). `BlockMode` and
`Ragged` say what the running forward is (one row's chunk, a packed prefill, a
verify block's real slots) to the projections and attention routes that read it.

Oracle: tests/test_invariance.py (a row's output alone == batched == one query
at a time, as it is and turned; the probes' choices are needed: one shared matmul,
or one turned call past the probed rows, is not exact here;
a ragged call keeps real slots' bits; a narrowed last chunk gives the whole
chunk's bits, and the probe refuses a product that splits K by its length).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlx_tandem._blas import blas_threads

GROUP_ROW_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16)  # rows of one score / p.v matmul
KEY_CHUNK = 256  # `p v` is summed over fixed-size key chunks, in order
KEY_SPAN = 64  # scores and softmax read key columns in whole spans (callers' widths)
TURNED_ROWS_MOST = 16  # the most query rows one turned product may take (probed down)
PROBE_KEYS = (70, 300, 2000, 3)  # the rows' key counts the exactness probes attend


@dataclass
class BlockMode:
    """On while one row's own prefill chunk runs: its shape depends on that row alone, so it
    may use block arithmetic (fused attention, one projection call of any size). Owned by
    the runner; read by the rows engine's projections and attention routes."""

    on: bool = False
    recurrence: bool = False  # rows prefilled together: recurrent layers in block form
    packed: bool = False  # rows prefilled together, laid out for packed projection calls
    ragged: Ragged | None = None  # a forward's real slots: projections skip the padding


@dataclass(frozen=True)
class Ragged:
    """Which slots of a (B, L) forward are real (row i's first lengths[i]): a projection
    runs on those rows only and hands every padding slot its row's last real result, a
    finite stand-in that no real slot reads (causal masks; verify reads real slots only).
    Exact because every projection plan gives a row the same bits in any call
    (models/invariance.py), so fewer rows per call change no real row's result."""

    take: mx.array  # (T,) flat indices of the real slots, row-major
    back: mx.array  # (B * L,) each slot's index into the T results
    total: int  # B * L

    @staticmethod
    def of(lengths: list[int], width: int) -> Ragged | None:
        """None when no slot is padding (or a row has none: nothing to stand in)."""
        if all(n == width for n in lengths) or min(lengths) < 1:
            return None
        take, back = [], []
        for i, n in enumerate(lengths):
            first = len(take)
            take.extend(range(i * width, i * width + n))
            back.extend(first + min(j, n - 1) for j in range(width))
        return Ragged(mx.array(take, dtype=mx.int32), mx.array(back, dtype=mx.int32),
                      len(lengths) * width)


@dataclass(frozen=True, eq=False)
class Packed:
    """Keys or values (B, Hkv, W, D) kept as MLX affine codes, multiplied without decoding
    them first; `center` (Hkv, 1, D), if given, is added back to every vector."""

    w: mx.array  # (B, Hkv, W, D * bits / 32) uint32
    scales: mx.array  # (B, Hkv, W, D / group)
    biases: mx.array
    group: int
    bits: int
    center: mx.array | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, H, W, packed = self.w.shape
        return B, H, W, packed * 32 // self.bits

    def padded(self, extra: int) -> Packed:
        """`extra` more columns of zero codes (they decode to zero vectors, masked anyway)."""
        grow = [mx.zeros((*a.shape[:2], extra, a.shape[3]), a.dtype)
                for a in (self.w, self.scales, self.biases)]
        w, s, b = (mx.concatenate([a, z], axis=2)
                   for a, z in zip((self.w, self.scales, self.biases), grow, strict=True))
        return Packed(w, s, b, self.group, self.bits, self.center)

    def scores(self, q: mx.array) -> mx.array:
        """q (B, Hkv, G, rows, D) -> q k^T (B, Hkv, G, rows, W).

        k = s * c + b per group of channels, so q.k = sum_g s_g (q_g . c_g) + b_g sum(q_g):
        the integer codes c go through the same fixed-shape matmuls as float keys (each
        byte's j-th code field meets the query channels j, j + per, ...), and the scales
        and biases are applied to the scores, never to W x D decoded keys. (MLX's CPU
        `quantized_matmul` with a transposed operand is a scalar loop without 8-wide SIMD.)"""
        B, H, G, R, D = q.shape
        W, group, per = self.w.shape[2], self.group, 8 // self.bits
        ng = D // group
        codes = self.w.view(mx.uint8).reshape(B, H, 1, W, ng, group // per)
        codes = codes.transpose(0, 1, 2, 4, 5, 3)  # (B, H, 1, ng, group / per, W)
        qg = q.reshape(B, H, G, R, ng, group).transpose(0, 1, 2, 4, 3, 5)  # (.., ng, R, group)
        raw = None
        for j in range(per):  # summed in a fixed order
            field = codes >> (self.bits * j) if j else codes
            if j < per - 1:
                field = field & ((1 << self.bits) - 1)
            c = mx.broadcast_to(field.astype(q.dtype), (B, H, G, ng, group // per, W))
            part = (qg[..., j::per] if per > 1 else qg) @ c
            raw = part if raw is None else raw + part
        assert raw is not None
        scales, biases = (a.astype(q.dtype).swapaxes(-1, -2)[:, :, None, :, None]
                          for a in (self.scales, self.biases))  # (B, H, 1, ng, 1, W)
        terms = raw * scales + mx.sum(qg, axis=-1, keepdims=True) * biases
        out = terms.reshape(B, H, G, R, W) if ng == 1 else terms[:, :, :, 0]
        for g in range(1, ng):
            out = out + terms[:, :, :, g]
        if self.center is not None:
            out = out + q @ self.center[None, :, None].swapaxes(-1, -2)
        return out

    def weighted(self, probs: mx.array) -> mx.array:
        """probs (B, Hkv, G, n, rows, K) over n key chunks of K -> per chunk p v
        (B, Hkv, G, n, rows, D); the center is not added (see `center_term`)."""
        B, H, _, n, _, K = probs.shape
        parts = tuple(a.reshape(B, H, 1, n, K, a.shape[-1])
                      for a in (self.w, self.scales, self.biases))
        return mx.quantized_matmul(probs, *parts, transpose=False, group_size=self.group,
                                   bits=self.bits)

    def center_term(self, probs: mx.array) -> mx.array | None:
        """sum_w p_w * center (B, Hkv, G, rows, D), or None without a center."""
        if self.center is None:
            return None
        mass = mx.sum(mx.sum(probs, axis=-1), axis=3)  # (B, Hkv, G, rows)
        return mass[..., None] * self.center[None, :, None]


def invariant_attention(
    queries: mx.array,
    keys: mx.array | Packed,
    values: mx.array | Packed,
    scale: float,
    valid: mx.array,
    group_rows: int | None = None,
    sinks: mx.array | None = None,
    softcap: float | None = None,
    turned_rows: int | None = None,
) -> mx.array:
    """queries (B, H, L, D); keys/values (B, Hkv, W, D); valid (B, 1, L, W) bool -> (B, H, L, D).

    sinks (H,): attention sinks (gpt_oss), one logit per query head that joins every
    softmax as column 0 and takes no value. softcap: scores become
    `tanh(scores / softcap) * softcap` before the mask (Gemma 2). group_rows / turned_rows:
    the two forms' groupings (probed where None; turned_rows 0: the as-is form only)."""
    B, H, L, D = queries.shape
    Hkv, Dv = keys.shape[1], values.shape[3]
    rep = H // Hkv
    dtype = str(queries.dtype)
    if group_rows is None:
        group_rows = stable_group_rows(D, H, Hkv, dtype)
    turned = 0
    if not isinstance(keys, Packed) and not isinstance(values, Packed):
        turned = stable_turned_rows(D, Dv, dtype) if turned_rows is None else turned_rows
    turned = turned if turned > group_rows else 0  # turned only where it takes fewer calls
    W = keys.shape[2]  # scores and softmax: the keys given (trailing masked ones weigh 0)
    R = rep * L
    # as it is, every group holds exactly `group_rows` rows; turned, a group may hold any
    # number up to `turned` (each row gets its one-row bits): even groups, fewest calls
    size = -(-R // -(-R // turned)) if turned else group_rows
    G = -(-R // size)
    pad = G * size - R
    q = (queries * scale).reshape(B, Hkv, R, D)
    ok = mx.broadcast_to(valid[:, :, None], (B, 1, rep, L, W)).reshape(B, 1, R, W)
    if pad:  # padding rows only fill the last group; they see one key so softmax stays finite
        q = mx.concatenate([q, mx.zeros((B, Hkv, pad, D), q.dtype)], axis=2)
        first_key = mx.broadcast_to(mx.arange(W) == 0, (B, 1, pad, W))
        ok = mx.concatenate([ok, first_key], axis=2)
    q = q.reshape(B, Hkv, G, size, D)
    if isinstance(keys, Packed):
        scores = keys.scores(q).reshape(B, Hkv, G * size, W)
    else:
        kt = mx.broadcast_to(keys.swapaxes(-1, -2)[:, :, None], (B, Hkv, G, D, W))
        scores = _times(q, kt, turned).reshape(B, Hkv, G * size, W)
    if softcap:
        scores = mx.tanh(scores / softcap) * softcap
    if sinks is not None:  # query row r of kv head k is head k * rep + r // L
        scores = mx.where(ok, scores, mx.array(-mx.inf, scores.dtype))
        col = mx.repeat(sinks.astype(scores.dtype).reshape(Hkv, rep), L, axis=1)
        col = mx.concatenate([col, mx.zeros((Hkv, pad), col.dtype)], axis=1)
        col = mx.broadcast_to(col[None, :, :, None], (B, Hkv, G * size, 1))
        probs = mx.softmax(mx.concatenate([col, scores], axis=-1), axis=-1, precise=True)
        probs = probs[..., 1:]
    else:
        probs = masked_softmax(scores, ok)
    probs = probs.reshape(B, Hkv, G, size, W)
    if isinstance(values, Packed):
        out = _packed_values(probs, values)  # (B, Hkv, G, size, Dv)
    else:
        out = _float_values(probs, values, turned)
    out = out.reshape(B, Hkv, G * size, Dv)[:, :, :R]
    return out.reshape(B, H, L, Dv)


LOG2E = 1.4426950408889634
_ROUNDER = 12582912.0  # 1.5 * 2^23: y + it rounds y to an integer, |y| < 2^22, in float32
_EXP2 = tuple(math.log(2) ** i / math.factorial(i) for i in range(7))  # 2^f, |f| <= 1/2


def pow2(y: mx.array) -> mx.array:
    """2^y for float32 y in [-126, 126]: 2^n * p(f) (n = round(y), f = y - n; p the degree-6
    Taylor polynomial of 2^f, within 2 ulp of exp), element-wise multiply-adds that
    `mx.compile` fuses into one vectorised loop, where this CPU's `exp` is scalar (~11 ns
    an element here). Callers clamp y."""
    n = (y + _ROUNDER) - _ROUNDER  # round(y), half to even, fused (MLX's round is its own pass)
    f = y - n
    p = mx.array(_EXP2[-1], mx.float32)
    for c in reversed(_EXP2[:-1]):
        p = p * f + c
    return p * ((n.astype(mx.int32) + 127) << 23).view(mx.float32)


def _masked_softmax(scores: mx.array, ok: mx.array) -> mx.array:
    """Softmax over the last axis of `scores` where `ok`, exactly 0 elsewhere, in float32.
    exp is `pow2` of y = (x - max) log2 e (a step's softmax took 2-3x longer with `mx.exp`).
    Each entry depends on its own row only, and masked trailing columns add exact zeros to
    the row's sum (tests/test_invariance.py)."""
    x = mx.where(ok, scores.astype(mx.float32), -mx.inf)
    y = mx.maximum((x - mx.max(x, axis=-1, keepdims=True)) * LOG2E, -126.0)
    e = mx.where(ok, pow2(y), 0.0)
    return (e / mx.sum(e, axis=-1, keepdims=True)).astype(scores.dtype)


masked_softmax = mx.compile(_masked_softmax)


def _chunked_probs(probs: mx.array, width: int) -> mx.array:
    """probs (B, Hkv, G, rows, W) zero-padded to `width` (whole KEY_CHUNKs) ->
    (B, Hkv, G, n, rows, KEY_CHUNK)."""
    B, Hkv, G, rows, W = probs.shape
    if width > W:  # columns past the scored ones weigh exactly 0
        probs = mx.concatenate([probs, mx.zeros((B, Hkv, G, rows, width - W), probs.dtype)], -1)
    probs = probs.reshape(B, Hkv, G, rows, width // KEY_CHUNK, KEY_CHUNK)
    return probs.transpose(0, 1, 2, 4, 3, 5)


def _in_order(parts: mx.array) -> mx.array:
    """parts (B, Hkv, G, n, rows, Dv) summed over the n key chunks, first to last."""
    out = parts[:, :, :, 0]
    for c in range(1, parts.shape[3]):
        out = out + parts[:, :, :, c]
    return out


def _times(a: mx.array, b: mx.array, turned: int) -> mx.array:
    """a @ b, or where `turned`, `(b^T @ a^T)^T`: a's rows on the BLAS call's other side."""
    if not turned:
        return a @ b
    return (b.swapaxes(-1, -2) @ a.swapaxes(-1, -2)).swapaxes(-1, -2)


def _float_values(probs: mx.array, values: mx.array, turned: int = 0) -> mx.array:
    """p v over whole KEY_CHUNKs, the last one only as wide as the scored keys need (whole
    KEY_SPANs): a chunk's product does not change when zero-weighted columns are dropped
    from its end (one K block of the BLAS, accumulated in order; probed by
    tests/test_invariance.py), and chunks wholly past the scored keys would add exact
    zeros. Short rows read a fraction of a chunk's values. `turned`: the products run
    turned (`_times`), in groups of at most that many rows."""
    B, Hkv, G, rows, W = probs.shape
    Dv = values.shape[3]
    unit = KEY_SPAN if narrow_chunks_exact(Dv, str(values.dtype), turned) else KEY_CHUNK
    need = -(-W // unit) * unit
    if need > W:  # columns past the scored ones weigh exactly 0
        probs = mx.concatenate([probs, mx.zeros((B, Hkv, G, rows, need - W), probs.dtype)], -1)
    if values.shape[2] < need:
        values = mx.concatenate([values, mx.zeros((B, Hkv, need - values.shape[2], Dv),
                                                  values.dtype)], axis=2)
    whole = need // KEY_CHUNK * KEY_CHUNK
    out = None
    if whole:
        v = values[:, :, :whole].reshape(B, Hkv, 1, whole // KEY_CHUNK, KEY_CHUNK, Dv)
        out = _in_order(_times(_chunked_probs(probs[..., :whole], whole), v, turned))
    if need > whole:  # the last chunk, narrowed
        part = _times(probs[..., whole:], values[:, :, None, whole:need], turned)
        out = part if out is None else out + part
    assert out is not None
    return out


def _packed_values(probs: mx.array, values: Packed) -> mx.array:
    """p v over the affine codes, in whole KEY_CHUNKs (zero codes pad the last one)."""
    W = probs.shape[-1]
    width = -(-max(W, values.shape[2]) // KEY_CHUNK) * KEY_CHUNK
    if values.shape[2] < width:
        values = values.padded(width - values.shape[2])
    chunked = _chunked_probs(probs, width)
    out = _in_order(values.weighted(chunked))
    if (term := values.center_term(chunked)) is not None:
        out = out + term
    return out


def block_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    valid: mx.array,
    sinks: mx.array | None = None,
    softcap: float | None = None,
) -> mx.array:
    """Fused attention for one row's own block of queries (its shape depends on that row only).
    Soft-capped scores (no fused kernel has them) are computed in one plain pass."""
    if softcap:
        B, H, L, _ = queries.shape
        Hkv = keys.shape[1]
        q = (queries * scale).reshape(B, Hkv, H // Hkv, L, -1)
        scores = q @ keys[:, :, None].swapaxes(-1, -2)
        scores = mx.tanh(scores / softcap) * softcap
        scores = mx.where(valid[:, :, None], scores, mx.array(-mx.inf, scores.dtype))
        probs = mx.softmax(scores, axis=-1, precise=True)
        return (probs @ values[:, :, None]).reshape(B, H, L, -1)
    if sinks is None:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=valid)
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=valid, sinks=sinks.astype(queries.dtype)
    )


def attention_mismatches(
    group_rows: int,
    lens: Sequence[int],
    L: int,
    H: int,
    Hkv: int,
    D: int,
    dtype: mx.Dtype = mx.float32,
    turned_rows: int | None = None,
) -> int:
    """How many (row, query) outputs differ between one batched block call and one-query calls
    (`turned_rows` as invariant_attention takes it)."""
    k1, k2, k3 = mx.random.split(mx.random.key(sum(lens) + L), 3)
    B, S = len(lens), max(lens) + L
    q = mx.random.normal((B, H, L, D), key=k1).astype(dtype)
    k = mx.random.normal((B, Hkv, S, D), key=k2).astype(dtype)
    v = mx.random.normal((B, Hkv, S, D), key=k3).astype(dtype)
    qpos = mx.array(lens)[:, None] + mx.arange(L)[None]
    valid = (mx.arange(S)[None, None] <= qpos[:, :, None])[:, None]
    out = invariant_attention(q, k, v, 0.125, valid, group_rows, turned_rows=turned_rows)
    bad = 0
    for i, n in enumerate(lens):
        for j in range(L):
            w = n + j + 1
            va = (mx.arange(w)[None, None] <= n + j)[:, None]
            alone = invariant_attention(
                q[i : i + 1, :, j : j + 1],
                k[i : i + 1, :, :w],
                v[i : i + 1, :, :w],
                0.125,
                va,
                group_rows,
                turned_rows=turned_rows,
            )
            bad += not mx.array_equal(alone, out[i : i + 1, :, j : j + 1]).item()
    return bad


@functools.cache
def narrow_chunks_exact(Dv: int, dtype: str, turned: int = 0) -> bool:
    """Whether `p v` over a key chunk whose trailing columns weigh 0 gives the same bits with
    those columns dropped (whole KEY_SPANs kept), here: probed once per value shape and
    form (`turned`: the turned products, groups of 1 .. that many rows). True for a BLAS
    that accumulates one K block in order (OpenBLAS here); a kernel that splits K by its
    length (a GPU's reduction) keeps whole chunks."""
    if not turned:
        return narrowing_exact(mx.matmul, Dv, _dtype(dtype))
    return narrowing_exact(lambda a, b: _times(a, b, turned), Dv, _dtype(dtype),
                           tuple(range(1, turned + 1)))


def _dtype(name: str) -> mx.Dtype:
    return getattr(mx, name.rsplit(".", 1)[-1])


def narrowing_exact(matmul: Callable[[mx.array, mx.array], mx.array], Dv: int,
                    dtype: mx.Dtype, group_rows: tuple[int, ...] = GROUP_ROW_CHOICES) -> bool:
    """The probe behind `narrow_chunks_exact`, for any matmul: every group size, narrowed
    widths and rows using 1 .. width columns, batched as the rows attention calls it."""
    k1, k2 = mx.random.split(mx.random.key(Dv))
    values = mx.random.normal((2, 3, 1, KEY_CHUNK, Dv), key=k2).astype(dtype)
    for rows in group_rows:
        probs = mx.random.uniform(shape=(2, 3, 4, rows, KEY_CHUNK), key=k1).astype(dtype)
        for width in range(KEY_SPAN, KEY_CHUNK, KEY_SPAN):
            for used in (1, width - KEY_SPAN + 1, width):
                p = mx.where(mx.arange(KEY_CHUNK) < used, probs, 0)
                narrow = matmul(p[..., :width], values[..., :width, :])
                if not mx.array_equal(matmul(p, values), narrow).item():
                    return False
    return True


@functools.cache
def stable_group_rows(D: int, H: int, Hkv: int, dtype: str) -> int:
    """The query-group size for this head shape: exact here (probed once), and cheapest.

    Among the exact sizes, the smallest that holds one position's rep query rows
    (one decode step is one matmul); else the largest exact size below it.
    """
    mxdtype = _dtype(dtype)
    rep = H // Hkv
    exact = [
        rows
        for rows in GROUP_ROW_CHOICES
        if all(
            # a 2,000-key row: OpenBLAS's AVX-512 sgemm changes a short row's scores
            # only when a row that long shares its call (tests/test_blas.py)
            attention_mismatches(rows, PROBE_KEYS, L, H, Hkv, D, mxdtype, turned_rows=0) == 0
            for L in (1, 3, 9)
        )
    ]
    if not exact:
        raise RuntimeError(
            f"no batch-invariant attention grouping exists for head dim {D}, {H}/{Hkv} heads "
            f"under this BLAS; run with TANDEM_BATCH_INVARIANT=0 (not exact)"
        )
    holding = [rows for rows in exact if rows >= rep]
    return min(holding) if holding else max(exact)


def stable_turned_rows(D: int, Dv: int, dtype: str) -> int:
    """The most query rows one turned product takes (`keys @ q^T`, `v^T @ p^T`; at most
    TURNED_ROWS_MOST): every call of 1 .. that many rows gives each row its one-row bits
    at key widths from a few to thousands, and whole attentions in such groups equal one
    query at a time (probed once per head shape and BLAS thread count; 7 here). 0 where
    that is one row, or values are not keys' width (BENCHMARKS, session 27)."""
    return _turned_rows(D, Dv, dtype, blas_threads())


@functools.cache
def _turned_rows(D: int, Dv: int, dtype: str, threads: int) -> int:
    mxdtype = _dtype(dtype)
    k1, k2, k3, k4 = mx.random.split(mx.random.key(D + Dv), 4)
    q = mx.random.normal((TURNED_ROWS_MOST, D), key=k1).astype(mxdtype)
    p = mx.random.uniform(shape=(TURNED_ROWS_MOST, KEY_CHUNK), key=k2).astype(mxdtype)
    most = TURNED_ROWS_MOST
    for width in (*PROBE_KEYS, KEY_SPAN, KEY_CHUNK, 640):
        keys = mx.random.normal((width, D), key=k3).astype(mxdtype)
        most = _turned_exact_up_to(keys, q, most)
    for width in range(KEY_SPAN, KEY_CHUNK + 1, KEY_SPAN):
        values_t = mx.random.normal((width, Dv), key=k4).astype(mxdtype).T
        most = _turned_exact_up_to(values_t, p[:, :width], most)
    if most <= 1 or Dv != D:  # the whole-attention probe below attends with Dv == D
        return 0
    # one position's query rows fill a group (rep = most); three positions, three groups
    if any(attention_mismatches(1, PROBE_KEYS, L, 3 * most, 3, D, mxdtype, turned_rows=most)
           for L in (1, 3)):
        return 0
    return most


def _turned_exact_up_to(a: mx.array, x: mx.array, most: int) -> int:
    """The largest n <= most such that `a @ x[:m].T` for every m <= n gives each column the
    bits of its own one-column call."""
    single = mx.concatenate([a @ x[j : j + 1].T for j in range(most)], axis=1)
    for m in range(2, most + 1):
        if not mx.array_equal(a @ x[:m].T, single[:, :m]).item():
            return m - 1
    return most
