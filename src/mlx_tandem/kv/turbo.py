"""TurboQuant's parts (SPEC_REFERENCE §2): the per-layer random-sign Hadamard rotation,
Lloyd-Max codebooks for a rotated unit vector's coordinates, index packing, and the
`TurboCodec` itself. kv/codec.py names and plans codecs; this module owns the arithmetic.

Oracle: tests/test_kv_codecs.py (packing round-trips; the codebook polynomial gives the
table exactly; Lloyd-Max matches the Gaussian codebook; reconstruction error near the paper).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from mlx_tandem.kv.attention import Packed


@functools.lru_cache(maxsize=64)
def lloyd_max(dim: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd-Max levels and boundaries for one coordinate of a random unit vector in R^dim.

    The coordinate's density is proportional to (1 - x^2)^((dim - 3) / 2) on [-1, 1]
    (≈ N(0, 1/dim)). Computed once per (dim, bits) on a fine grid.
    """
    n = 1 << bits
    grid = np.linspace(-1.0, 1.0, 1 << 18)
    dens = np.clip(1.0 - grid * grid, 0.0, None) ** ((dim - 3) / 2) if dim > 3 else np.ones_like(grid)
    mass = np.cumsum(dens)
    moment = np.cumsum(dens * grid)
    compander = np.cumsum(dens ** (1 / 3))  # Panter-Dite: near-optimal levels to start from
    levels = np.interp((np.arange(n) + 0.5) / n, compander / compander[-1], grid)
    for _ in range(500):
        bounds = (levels[1:] + levels[:-1]) / 2
        cut = np.concatenate([[0], np.searchsorted(grid, bounds), [len(grid)]])
        m = np.diff(np.concatenate([[0.0], mass])[cut])
        s = np.diff(np.concatenate([[0.0], moment])[cut])
        new = np.where(m > 0, s / np.maximum(m, 1e-300), levels)
        if np.max(np.abs(new - levels)) < 1e-9:
            levels = new
            break
        levels = new
    levels = np.sort(levels)
    return levels.astype(np.float32), ((levels[1:] + levels[:-1]) / 2).astype(np.float32)


@functools.lru_cache(maxsize=256)
def random_signs(seed: int, dim: int) -> mx.array:
    """The rotation's fixed signs (an immutable array, made once per layer and dim)."""
    signs = np.where(np.random.default_rng(seed).random(dim) < 0.5, -1.0, 1.0)
    return mx.array(signs.astype(np.float32))


def pack_indices(idx: mx.array, bits: int) -> mx.array:
    """(..., D) indices < 2^bits (D % 8 == 0) -> (..., D * bits / 8) uint8.

    Each 8 indices become one word (index k at bit bits*k), stored as its low `bits` bytes:
    shifts and sums only, no gathers (MLX's CPU gather is ~50x slower than an add).
    """
    if bits == 8:
        return idx.astype(mx.uint8)
    v = idx.astype(mx.uint32).reshape(*idx.shape[:-1], -1, 8)
    word = (v << mx.arange(0, 8 * bits, bits, dtype=mx.uint32)).sum(axis=-1, keepdims=True)
    out = (word >> mx.arange(0, 8 * bits, 8, dtype=mx.uint32)) & 0xFF
    return out.astype(mx.uint8).reshape(*idx.shape[:-1], -1)


def unpack_indices(packed: mx.array, bits: int) -> mx.array:
    """The inverse of pack_indices: (..., D * bits / 8) uint8 -> (..., D) uint32."""
    if bits == 8:
        return packed.astype(mx.uint32)
    b = packed.astype(mx.uint32).reshape(*packed.shape[:-1], -1, bits)
    word = (b << mx.arange(0, 8 * bits, 8, dtype=mx.uint32)).sum(axis=-1, keepdims=True)
    v = (word >> mx.arange(0, 8 * bits, bits, dtype=mx.uint32)) & ((1 << bits) - 1)
    return v.reshape(*packed.shape[:-1], -1)


POLY_DEGREE = {2: 3, 3: 7, 4: 7, 8: 11}
GATHER_MAX = 1 << 16  # decode by table gather up to this many coordinates


@functools.lru_cache(maxsize=64)
def codebook(dim: int, bits: int) -> tuple[tuple[float, ...], np.ndarray, np.ndarray]:
    """The codebook the turbo codec uses: (odd polynomial coefficients, levels, boundaries).

    Levels are `level(i) = t * P(t^2)`, t = (i - (n-1)/2) / (n/2), P fitted to the
    Lloyd-Max levels (exact for 2 and 3 bits; MSE within 0.01% at 4 bits, 1% at 8), so
    decoding is a few elementwise multiply-adds instead of a table gather. `levels` are
    what MLX computes from the coefficients, so encode and decode agree bitwise.
    """
    exact, _ = lloyd_max(dim, bits)
    n = 1 << bits
    t = (np.arange(n) - (n - 1) / 2) / (n / 2)
    terms = (POLY_DEGREE[bits] + 1) // 2
    fit = np.linalg.lstsq(
        np.stack([t ** (2 * j + 1) for j in range(terms)], 1), exact.astype(np.float64), rcond=None
    )[0]
    coeffs = tuple(float(np.float32(c)) for c in fit)
    levels = np.array(_poly_levels(mx.arange(n, dtype=mx.uint32), bits, coeffs))
    assert np.all(np.diff(levels) > 0), "codebook levels must increase"
    return coeffs, levels, ((levels[1:] + levels[:-1]) / 2).astype(np.float32)


def _poly_levels(idx: mx.array, bits: int, coeffs: tuple[float, ...]) -> mx.array:
    n = 1 << bits
    t = idx.astype(mx.float32) * (2 / n) - (n - 1) / n
    t2 = t * t
    p = mx.full(t.shape, coeffs[-1], mx.float32) if len(coeffs) == 1 else t2 * coeffs[-1]
    for c in reversed(coeffs[1:-1]):
        p = (p + c) * t2
    return (p + coeffs[0]) * t if len(coeffs) > 1 else p * t


def nearest_level(y: mx.array, bounds: np.ndarray) -> mx.array:
    """Index of the level nearest y (= how many boundaries y exceeds): one comparison
    against every boundary for small inputs, a binary search for large ones (same result)."""
    n = len(bounds) + 1
    table = mx.array(bounds)
    if y.size * n <= 1 << 22:
        return (y[..., None] > table).sum(axis=-1).astype(mx.uint32)
    lo = mx.zeros(y.shape, mx.uint32)
    step = n // 2
    while step:
        cand = lo + step
        lo = mx.where(y > table[cand - 1], cand, lo)
        step //= 2
    return lo


class Rotated:
    """Codecs that attend in a rotated space: a fixed random-sign Hadamard rotation (seeded
    per layer), orthogonal, so q·k and sum p·v are unchanged; queries are rotated once and
    the output un-rotated once."""

    seed: int

    def _signs(self, dim: int) -> mx.array:
        return random_signs(self.seed, dim)

    def rotate(self, x: mx.array) -> mx.array:
        d = x.shape[-1]
        y = mx.hadamard_transform(x * self._signs(d), scale=1 / math.sqrt(d))  # float32
        return y if y.dtype == x.dtype else y.astype(x.dtype)

    def embed(self, x: mx.array) -> mx.array:
        return self.rotate(x)

    def unrotate(self, x: mx.array) -> mx.array:
        d = x.shape[-1]
        x32 = x if x.dtype == mx.float32 else x.astype(mx.float32)
        y = mx.hadamard_transform(x32, scale=1 / math.sqrt(d)) * self._signs(d)
        return y if y.dtype == x.dtype else y.astype(x.dtype)

    @staticmethod
    def check_rotation(dim: int) -> str | None:
        if dim < 8 or dim & (dim - 1):
            return f"head dim {dim} is not a power of two >= 8 (the Hadamard rotation)"
        return None


@dataclass(frozen=True)
class TurboCodec(Rotated):
    """TurboQuant (MSE variant): norm in float16, rotated direction by a Lloyd-Max codebook.

    The stored norm is ||x|| / ||decoded unit direction||, so a decoded vector keeps
    the original's length.
    """

    bits: int
    seed: int
    kind = "turbo"
    span_append_safe = True

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        _, levels, bounds = codebook(x.shape[-1], self.bits)
        x32 = x if x.dtype == mx.float32 else x.astype(mx.float32)
        norm = mx.sqrt(mx.sum(x32 * x32, axis=-1, keepdims=True))
        idx = nearest_level(self.rotate(x32 / mx.maximum(norm, 1e-30)), bounds)
        approx = mx.array(levels)[idx]  # the same float32 values decode computes
        length = mx.sqrt(mx.sum(approx * approx, axis=-1, keepdims=True))
        scale = (norm / mx.maximum(length, 1e-30)).astype(mx.float16)
        return (pack_indices(idx, self.bits), scale)

    def decode(self, parts: tuple[mx.array, ...], dtype: mx.Dtype) -> mx.array:
        packed, scale = parts
        coeffs, levels, _ = codebook(packed.shape[-1] * 8 // self.bits, self.bits)
        idx = unpack_indices(packed, self.bits)
        # small inputs: one table gather; large: the polynomial's multiply-adds (~12 ops, but
        # MLX's CPU gather costs ~5 ns an element). Both give the table's exact values.
        if idx.size <= GATHER_MAX:
            out = mx.array(levels)[idx] * scale
        else:
            out = _poly_levels(idx, self.bits, coeffs) * scale
        return out if out.dtype == dtype else out.astype(dtype)

    def packed(self, parts: tuple[mx.array, ...]) -> Packed | None:
        return None  # codebook levels are not affine in the index

    def bytes_per_vector(self, dim: int) -> float:
        return dim * self.bits / 8 + 2

    def check(self, dim: int) -> str | None:
        return self.check_rotation(dim)
