"""Calibrated KV codec wrappers: fixed per-layer constants that make a vector codec's bits
count where attention looks.

Two per-vector transforms, each a model constant measured once (the runner feeds
`CALIBRATION` through float rows and reads each attention layer's K, V and queries):

  * `Centered`: store x - mean (per kv head). Keys and values share a large common
    component that costs bits but carries little; decoding adds it back.
  * `Scaled` (keys): store k / s and attend with q * s, per kv head and channel, with
    s_c^2 = rms(k_c) / rms(q_c) (normalised). q·k is unchanged, and a rotated codec's
    error, spread evenly over channels, then weighs what the queries weigh: the
    Cauchy-Schwarz optimum for the score error |q·e|. (Gemma 3's k/q norms have very
    different per-channel weights.)

Both are per vector, so a wrapped codec stays span-append-safe. The wrappers speak the
vector-codec protocol of kv/codec.py (`encode`, `decode`, `rotate`, `embed`, `unrotate`).

Oracle: tests/test_kv_codecs.py (span-safe; centering removes a common component; the
runner calibrates per layer; engine exactness under `turbo-k3v4,center`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

CALIBRATION = (
    "The committee met on a cold morning to review the plans for the new library. Several "
    "members asked how the building would be heated, who would pay for the books, and whether "
    "the old reading room could be kept. After a long discussion they agreed to publish the "
    "budget, invite comments from the town, and vote again in the spring. def mean(xs):\n"
    "    return sum(xs) / len(xs)\n"
)


@dataclass(frozen=True, eq=False)
class LayerStats:
    """One attention layer's calibration: per kv head (Hkv, 1, D) arrays."""

    key_mean: mx.array
    value_mean: mx.array
    key_scale: mx.array


def layer_stats(keys: mx.array, values: mx.array, queries: mx.array) -> LayerStats:
    """From one row's calibration K/V (1, Hkv, T, D) and queries (1, H, T, D); the first
    position (often an attention sink) is left out."""
    k, v, q = keys[0, :, 1:], values[0, :, 1:], queries[0, :, 1:]
    hkv = k.shape[0]
    rk = mx.sqrt(mx.mean(k * k, axis=1))
    rq = mx.sqrt(mx.mean((q * q).reshape(hkv, -1, q.shape[-1]), axis=1))
    s = mx.sqrt(mx.maximum(rk, 1e-6) / mx.maximum(rq, 1e-6))
    s = s / mx.sqrt(mx.mean(s * s, axis=-1, keepdims=True))
    out = LayerStats(mx.mean(k, axis=1, keepdims=True), mx.mean(v, axis=1, keepdims=True),
                     s[:, None, :].astype(keys.dtype))
    mx.eval(out.key_mean, out.value_mean, out.key_scale)
    return out


@dataclass(frozen=True, eq=False)
class Wrapped:
    """A vector codec around another: everything the wrapper does not change is the inner's."""

    inner: Any  # a kv/codec.py VectorCodec

    @property
    def kind(self) -> str:
        return self.inner.kind

    @property
    def span_append_safe(self) -> bool:
        return self.inner.span_append_safe

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        return self.inner.encode(x)

    def decode(self, parts: tuple[mx.array, ...], dtype: mx.Dtype) -> mx.array:
        return self.inner.decode(parts, dtype)

    def rotate(self, x: mx.array) -> mx.array:
        return self.inner.rotate(x)

    def embed(self, x: mx.array) -> mx.array:
        return self.inner.embed(x)

    def unrotate(self, x: mx.array) -> mx.array:
        return self.inner.unrotate(x)

    def packed(self, parts: tuple[mx.array, ...]) -> Any:
        return self.inner.packed(parts)

    def bytes_per_vector(self, dim: int) -> float:
        return self.inner.bytes_per_vector(dim)

    def check(self, dim: int) -> str | None:
        return self.inner.check(dim)


@dataclass(frozen=True, eq=False)
class Centered(Wrapped):
    """Stores x - center; decoding adds the center back (in the attention space)."""

    center: mx.array  # (Hkv, 1, D)
    embedded: mx.array  # the center in the inner codec's attention space

    @classmethod
    def of(cls, inner: Any, center: mx.array) -> Centered:
        embedded = inner.embed(center)
        mx.eval(embedded)
        return cls(inner, center, embedded)

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        return self.inner.encode(x - self.center)

    def decode(self, parts: tuple[mx.array, ...], dtype: mx.Dtype) -> mx.array:
        return self.inner.decode(parts, dtype) + self.embedded.astype(dtype)

    def packed(self, parts: tuple[mx.array, ...]) -> Any:
        inner = self.inner.packed(parts)
        if inner is None:
            return None
        center = self.embedded if inner.center is None else inner.center + self.embedded
        return dataclasses.replace(inner, center=center)


@dataclass(frozen=True, eq=False)
class Scaled(Wrapped):
    """Keys only: stores k / scale, attends with q * scale (per kv head and channel)."""

    scale: mx.array  # (Hkv, 1, D)

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        return self.inner.encode(x / self.scale)

    def rotate(self, x: mx.array) -> mx.array:
        B, H, L, D = x.shape  # query head h reads kv head h // rep
        Hkv = self.scale.shape[0]
        scaled = (x.reshape(B, Hkv, H // Hkv, L, D) * self.scale[:, None]).reshape(B, H, L, D)
        return self.inner.rotate(scaled)

    def embed(self, x: mx.array) -> mx.array:
        return self.inner.embed(x / self.scale)

    def unrotate(self, x: mx.array) -> mx.array:
        return self.inner.unrotate(x) * self.scale
