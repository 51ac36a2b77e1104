"""KV codecs: how a row cache stores each committed K/V vector, and how attention reads it.

A codec is a pair of `VectorCodec`s (keys, values). A vector codec turns a span
(B, H, L, D) of vectors into a tuple of arrays ("parts", each (B, H, L, ·)) and
back; the row cache stores the parts column by column and attends over the
decoded vectors (dequantize-then-attend). Three kinds:

  * `fp`: the vector itself (today's arithmetic, bit for bit);
  * `affineB[:gG]`: MLX affine quantization (`mx.quantize`, B bits, groups of G
    along head_dim, float16 scales and biases); `,rot` quantizes the vector after
    turbo's rotation instead (attention then runs in the rotated space). For B in
    2, 4, 8 attention multiplies the codes as they are (kv/attention.Packed)
    instead of decoding every column each step;
  * `turbo-kKvV`: TurboQuant (SPEC_REFERENCE §2): a fixed random-sign Hadamard
    rotation per layer, a float16 norm per vector and Lloyd-Max codebook indices
    of the rotated direction (K / V bits in {2, 3, 4, 8}), packed into uint8
    (kv/turbo.py).
    The cache decodes keys and values in the *rotated* space; attention rotates
    the queries once and un-rotates its output once (q·k and sum p·v commute with
    an orthogonal rotation), so no step rotates the whole cache.

Every kind encodes each vector on its own, so appending a multi-token span (a
verify block, a prefill chunk) stores exactly what appending its tokens one by
one would (`span_append_safe`; checked by `span_append_mismatch`). The rows
engine refuses a codec that does not declare it.

A codec name may carry per-layer options: `,fp-edges` keeps the first and last
attention layers in float, `,fp-sliding` keeps sliding-window layers in float;
`,center` (`,vcenter`) stores each key (value) minus its layer's per-head mean and
`,eq` divides keys by per-channel scales (queries multiplied by them), all fixed model
constants measured once by the runner on `CALIBRATION` (kv/calibrated.py).
Named layers can differ: `,fp@0+17` keeps layers 0 and 17 in float, `,k8@3+5` stores
layers 3 and 5's keys at 8 bits (the kind's bit widths; values keep theirs) — where a
model's error concentrates, a few layers' keys buy more than more bits everywhere.
`parse_codec` validates a name before any engine state exists; `check_dims`
validates it against a model's head dims (and a family's declared kinds).

Oracle: tests/test_kv_codecs.py (span == concat of single-token encodes, bitwise;
a per-span-scale variant is caught; rows alone == batched under each codec).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from mlx_tandem.kv.attention import Packed
from mlx_tandem.kv.calibrated import Centered, LayerStats, Scaled
from mlx_tandem.kv.turbo import Rotated, TurboCodec

TURBO_BITS = (2, 3, 4, 8)
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)
KINDS = ("fp", "affine", "turbo")
NAMES_HELP = (
    "fp, affineB[:g32|g64|g128] (B in 2-8), turbo-kKvV (K,V in 2,3,4,8)"
    "[,rot (affine)][,fp-edges][,fp-sliding][,center][,vcenter][,eq][,fp@L+L..][,kB@L+L..]"
)


class VectorCodec(Protocol):
    """How one tensor (keys or values) of a layer is stored and read back."""

    kind: str
    span_append_safe: bool

    def encode(self, x: mx.array) -> tuple[mx.array, ...]: ...

    def decode(self, parts: tuple[mx.array, ...], dtype: mx.Dtype) -> mx.array:
        """Vectors in the codec's attention space (rotated for turbo)."""
        ...

    def rotate(self, x: mx.array) -> mx.array:
        """Queries into the attention space (keys' codec) — q·k is unchanged."""
        ...

    def embed(self, x: mx.array) -> mx.array:
        """Stored vectors (model space) into the attention space (what decode returns)."""
        ...

    def unrotate(self, x: mx.array) -> mx.array:
        """Attention space back to the model's (fetch; the output, for values)."""
        ...

    def packed(self, parts: tuple[mx.array, ...]) -> Packed | None:
        """The stored parts as MLX affine codes that attention multiplies without decoding
        (what `decode` would return, to rounding); None where the codec has none."""
        ...

    def bytes_per_vector(self, dim: int) -> float: ...

    def check(self, dim: int) -> str | None:
        """Why this codec cannot store vectors of `dim` (None: it can)."""
        ...


class Unrotated:
    """Codecs that attend in the model's own space: rotate, embed and unrotate are identities."""

    def rotate(self, x: mx.array) -> mx.array:
        return x

    def embed(self, x: mx.array) -> mx.array:
        return x

    def unrotate(self, x: mx.array) -> mx.array:
        return x


class FpCodec(Unrotated):
    kind = "fp"
    span_append_safe = True

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        return (x,)

    def decode(self, parts: tuple[mx.array, ...], dtype: mx.Dtype) -> mx.array:
        return parts[0]

    def packed(self, parts: tuple[mx.array, ...]) -> Packed | None:
        return None

    def bytes_per_vector(self, dim: int, itemsize: int = 4) -> float:
        return dim * itemsize

    def check(self, dim: int) -> str | None:
        return None


@dataclass(frozen=True)
class AffineCodec(Unrotated):
    bits: int
    group: int = 64
    kind = "affine"
    span_append_safe = True

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        w, s, b = mx.quantize(x.astype(mx.float16), group_size=self.group, bits=self.bits)
        return (w, s, b)

    def decode(self, parts: tuple[mx.array, ...], dtype: mx.Dtype) -> mx.array:
        w, s, b = parts
        if 32 % self.bits:  # 3, 5, 6 bits straddle words: MLX's own (slower on CPU) kernel
            return mx.dequantize(w, s, b, group_size=self.group, bits=self.bits).astype(dtype)
        shifts = mx.arange(0, 32, self.bits, dtype=mx.uint32)
        q = ((w[..., None] >> shifts) & ((1 << self.bits) - 1)).astype(mx.float32)
        q = q.reshape(*w.shape[:-1], s.shape[-1], self.group)
        out = q * s.astype(mx.float32)[..., None] + b.astype(mx.float32)[..., None]
        return out.reshape(*w.shape[:-1], -1).astype(dtype)

    def packed(self, parts: tuple[mx.array, ...]) -> Packed | None:
        if 32 % self.bits:  # codes that straddle words: decoded instead
            return None
        w, s, b = parts
        return Packed(w, s, b, self.group, self.bits)

    def bytes_per_vector(self, dim: int) -> float:
        return dim * self.bits / 8 + dim // self.group * 4

    def check(self, dim: int) -> str | None:
        if dim % self.group or (dim * self.bits) % 32:
            return f"head dim {dim} is not a multiple of the group size {self.group}"
        return None


@dataclass(frozen=True)
class RotatedAffineCodec(Rotated, AffineCodec):
    """`affineB,rot`: affine codes of the rotated vector (QuaRot-style): the rotation spreads
    a few large channels over all of them, so the group's range fits the bulk; attention
    multiplies the codes as they are, in the rotated space."""

    seed: int = 0

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        return super().encode(self.rotate(x if x.dtype == mx.float32 else x.astype(mx.float32)))

    def check(self, dim: int) -> str | None:
        return self.check_rotation(dim) or super().check(dim)


@dataclass(frozen=True)
class KVCodec:
    """One layer's codec: keys and values (they may differ, e.g. turbo-k8v4)."""

    name: str
    key: VectorCodec
    value: VectorCodec

    @property
    def span_append_safe(self) -> bool:
        return self.key.span_append_safe and self.value.span_append_safe

    @property
    def is_fp(self) -> bool:
        return self.key.kind == "fp" and self.value.kind == "fp"

    def bytes_per_token(self, kv_heads: int, key_dim: int, value_dim: int) -> float:
        return kv_heads * (self.key.bytes_per_vector(key_dim) + self.value.bytes_per_vector(value_dim))


FP = KVCodec("fp", FpCodec(), FpCodec())


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec name: the base codec and the per-layer options."""

    name: str
    kind: str
    key_bits: int = 32
    value_bits: int = 32
    group: int = 64
    fp_edges: bool = False
    fp_sliding: bool = False
    center: bool = False
    vcenter: bool = False
    eq: bool = False
    rot: bool = False  # affine: codes of the rotated vector
    fp_at: tuple[int, ...] = ()  # layers kept in float
    key_bits_at: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (bits, layers): wider keys

    @property
    def named_layers(self) -> tuple[int, ...]:
        """Every layer index the name mentions (checked against the model's layers)."""
        return tuple(sorted({*self.fp_at, *(i for _, ls in self.key_bits_at for i in ls)}))

    @property
    def calibrated(self) -> bool:
        return self.center or self.vcenter or self.eq

    def for_layer(
        self, layer: int, window: int | None, edge: bool, stats: LayerStats | None = None
    ) -> KVCodec:
        """Cache layer `layer`'s codec; window: a sliding layer's; edge: the first or last
        attention layer; stats: the layer's calibration (with `,center` / `,eq`).
        The turbo rotation's seed is fixed per layer."""
        if (self.kind == "fp" or (self.fp_edges and edge) or (self.fp_sliding and window)
                or layer in self.fp_at):
            return FP
        key_bits = next((b for b, ls in self.key_bits_at if layer in ls), self.key_bits)
        key: VectorCodec
        value: VectorCodec
        seed = 0x7A11 + 2 * layer
        if self.kind == "affine" and self.rot:
            key = RotatedAffineCodec(key_bits, self.group, seed)
            value = RotatedAffineCodec(self.value_bits, self.group, seed + 1)
        elif self.kind == "affine":
            key, value = AffineCodec(key_bits, self.group), AffineCodec(self.value_bits, self.group)
        else:
            key, value = TurboCodec(key_bits, seed), TurboCodec(self.value_bits, seed + 1)
        if stats is not None and self.eq:
            key = Scaled(key, stats.key_scale)
        if stats is not None and self.center:
            key = Centered.of(key, stats.key_mean)
        if stats is not None and self.vcenter:
            value = Centered.of(value, stats.value_mean)
        return KVCodec(self.name, key, value)


_BASE = re.compile(r"^(?:(fp)|affine(\d+)(?::g(\d+))?|turbo-k(\d+)v(\d+))$")
_FLAGS = ("fp-edges", "fp-sliding", "center", "vcenter", "eq", "rot")
_AT = re.compile(r"^(fp|k(\d+))@(\d+(?:\+\d+)*)$")


def _layer_options(text: str, options: list[str], bits_ok: tuple[int, ...]) -> dict:
    """`fp@L+L` / `kB@L+L` options -> CodecSpec fields; ValueError naming a bad one."""
    fp_at: list[int] = []
    key_bits_at: dict[int, list[int]] = {}
    for o in options:
        m = _AT.match(o)
        if m is None:
            continue
        layers = [int(x) for x in m.group(3).split("+")]
        if m.group(2) is None:
            fp_at += layers
        elif int(m.group(2)) not in bits_ok:
            raise ValueError(f"kv codec {text!r}: {o!r} asks for {m.group(2)}-bit keys; "
                             f"this kind has {bits_ok}")
        else:
            key_bits_at.setdefault(int(m.group(2)), []).extend(layers)
    named = fp_at + [i for ls in key_bits_at.values() for i in ls]
    if len(named) != len(set(named)):
        raise ValueError(f"kv codec {text!r}: a layer is named twice")
    return {"fp_at": tuple(sorted(fp_at)),
            "key_bits_at": tuple((b, tuple(sorted(ls))) for b, ls in sorted(key_bits_at.items()))}


def parse_codec(text: str) -> CodecSpec:
    """A codec name -> CodecSpec; ValueError naming the accepted names otherwise."""
    head, *options = [t.strip() for t in str(text).strip().lower().split(",")]
    m = _BASE.match(head)
    bad = [o for o in options if o not in _FLAGS and not _AT.match(o)]
    if m is None or bad:
        raise ValueError(f"unknown kv codec {text!r}; known: {NAMES_HELP}")
    flags = {
        "fp_edges": "fp-edges" in options, "fp_sliding": "fp-sliding" in options,
        "center": "center" in options and not m.group(1),
        "vcenter": "vcenter" in options and not m.group(1),
        "eq": "eq" in options and not m.group(1),
        "rot": "rot" in options and bool(m.group(2)),
    }
    if "rot" in options and m.group(4):
        raise ValueError(f"kv codec {text!r}: ',rot' is for affine codecs (turbo always rotates)")
    if m.group(1):
        return CodecSpec("fp", "fp")
    if m.group(2):
        bits, group = int(m.group(2)), int(m.group(3) or 64)
        if bits not in AFFINE_BITS or group not in AFFINE_GROUPS:
            raise ValueError(
                f"kv codec {text!r}: affine bits must be one of {AFFINE_BITS} and the group "
                f"size one of {AFFINE_GROUPS}"
            )
        name = ",".join([f"affine{bits}:g{group}", *options])
        layers = _layer_options(text, options, AFFINE_BITS)
        return CodecSpec(name, "affine", bits, bits, group, **flags, **layers)
    k, v = int(m.group(4)), int(m.group(5))
    if k not in TURBO_BITS or v not in TURBO_BITS:
        raise ValueError(f"kv codec {text!r}: turbo key/value bits must be in {TURBO_BITS}")
    layers = _layer_options(text, options, TURBO_BITS)
    return CodecSpec(",".join([f"turbo-k{k}v{v}", *options]), "turbo", k, v, **flags, **layers)


def codec_from_flags(codec: str | None, bits: int | None, group: int | None) -> str | None:
    """`--kv-codec` or mlx-lm's `--kv-bits`/`--kv-group-size` spelling -> a codec name."""
    if bits is None:
        if group is not None:
            raise ValueError("--kv-group-size needs --kv-bits")
        return codec
    if codec is not None:
        raise ValueError("give either --kv-codec or --kv-bits, not both")
    name = f"affine{bits}:g{group or 64}"
    parse_codec(name)
    return name


def check_dims(
    spec: CodecSpec, layer: int, codec: KVCodec, key_dim: int, value_dim: int,
    declared: tuple[str, ...] | None = None,
) -> None:
    """ValueError unless `codec` (layer `layer` of `spec`) can store this layer's K/V."""
    if declared is not None and spec.kind not in declared:
        raise ValueError(
            f"this model supports the kv codecs {', '.join(declared)}; not {spec.name!r}"
        )
    for what, c, dim in (("key", codec.key, key_dim), ("value", codec.value, value_dim)):
        why = c.check(dim)
        if why:
            raise ValueError(f"kv codec {spec.name!r} cannot store layer {layer}'s {what}s: {why}")
    if not codec.span_append_safe:
        raise ValueError(
            f"kv codec {codec.name!r} is not span-append-safe: the rows engine appends verify "
            "blocks and prefill chunks whole, and their committed K/V must not depend on that"
        )


def span_append_mismatch(codec: VectorCodec, x: mx.array) -> bool:
    """Whether encoding the span x (B, H, L, D) differs, bitwise, from its L one-token encodes."""
    whole = codec.encode(x)
    singles = [codec.encode(x[:, :, i : i + 1]) for i in range(x.shape[2])]
    for j, part in enumerate(whole):
        joined = mx.concatenate([s[j] for s in singles], axis=2)
        if part.dtype != joined.dtype or not mx.array_equal(part, joined).item():
            return True
    return False
