"""KV codecs: every codec is span-append-safe (a span's encode == its tokens' encodes, bitwise)
and a per-span-scale codec is caught; names are validated before any state; under each codec
a row's attention and tokens are the same alone, batched, after rewind, and speculative."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from mlx_tandem import SamplingParams
from mlx_tandem.drafters.prompt_lookup import PromptLookupSource
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.runner import ModelRunner
from mlx_tandem.kv.calibrated import Centered, LayerStats, Scaled
from mlx_tandem.kv.codec import (
    AffineCodec,
    KVCodec,
    codec_from_flags,
    parse_codec,
    span_append_mismatch,
)
from mlx_tandem.kv.row_cache import RowKVCache
from mlx_tandem.kv.turbo import _poly_levels, codebook, lloyd_max, pack_indices, unpack_indices

from conftest import run_with_gaps

CODECS = ("affine8:g32", "affine4:g32", "affine4:g32,rot", "turbo-k8v4", "turbo-k4v4",
          "turbo-k3v2", "turbo-k2v3")


@dataclass(frozen=True)
class SpanScaleAffine(AffineCodec):
    """Deliberately unsafe: one scale per appended span (its max |x|), not per vector."""

    span_append_safe = True  # the lie span_append_mismatch must catch

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        scale = mx.max(mx.abs(x), axis=(2, 3), keepdims=True) + 1e-6
        w, s, b = super().encode(x / scale)
        return (w, s, b, mx.broadcast_to(scale, (*x.shape[:3], 1)).astype(mx.float16))

    def decode(self, parts: tuple[mx.array, ...], dtype: mx.Dtype) -> mx.array:
        return super().decode(parts[:3], dtype) * parts[3].astype(dtype)

    def packed(self, parts: tuple[mx.array, ...]) -> None:
        return None  # its codes are not plain affine ones


def vectors(shape: tuple[int, ...], seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)) * 3.0


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dim", [32, 64, 256])
def test_every_codec_is_span_append_safe_bitwise(name, dim):
    codec = parse_codec(name).for_layer(3, None, edge=False)
    x = vectors((2, 3, 5, dim), seed=dim)
    assert codec.span_append_safe
    assert not span_append_mismatch(codec.key, x) and not span_append_mismatch(codec.value, x)


def test_a_per_span_scale_codec_is_caught():
    x = vectors((2, 3, 5, 64), seed=1)
    assert span_append_mismatch(SpanScaleAffine(4, 32), x)


def test_the_span_check_matters_for_the_cache():
    """With the unsafe codec, a 5-token block's attention differs from one token at a time."""
    unsafe = SpanScaleAffine(4, 32)
    codec = KVCodec("unsafe", unsafe, unsafe)
    q, k, v = (vectors((1, 4, 5, 32), s) for s in (1, 2, 3))
    block = RowKVCache(codec=codec)
    block.ends = [0]
    mask = block.make_mask(5)
    out = block.attend(q, *block.update_and_fetch(k, v), scale=0.2, mask=mask)
    single = RowKVCache(codec=codec)
    single.ends = [0]
    steps = []
    for i in range(5):
        mask = single.make_mask(1)
        kv = single.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        steps.append(single.attend(q[:, :, i : i + 1], *kv, scale=0.2, mask=mask))
    assert not mx.array_equal(out, mx.concatenate(steps, axis=2)).item()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packing_round_trips(bits):
    idx = mx.random.randint(0, 1 << bits, (2, 3, 4, 64), key=mx.random.key(bits)).astype(mx.uint32)
    packed = pack_indices(idx, bits)
    assert packed.dtype == mx.uint8 and packed.shape[-1] == 64 * bits // 8
    assert mx.array_equal(unpack_indices(packed, bits), idx).item()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_the_codebook_polynomial_gives_the_table_exactly(bits):
    """Decode picks gather or polynomial by size: both must give identical levels."""
    coeffs, levels, _ = codebook(64, bits)
    idx = mx.tile(mx.arange(1 << bits, dtype=mx.uint32), (300,))
    assert mx.array_equal(_poly_levels(idx, bits, coeffs), mx.array(levels)[idx]).item()
    assert np.all(np.diff(levels) > 0) and np.allclose(lloyd_max(64, bits)[0], levels, atol=0.02)


def test_lloyd_max_matches_the_gaussian_codebook():
    levels, _ = lloyd_max(128, 2)  # ≈ ±0.453/√d, ±1.51/√d (SPEC_REFERENCE §2)
    assert np.allclose(levels * np.sqrt(128), [-1.51, -0.453, 0.453, 1.51], atol=0.01)


@pytest.mark.parametrize("name,bound", [("turbo-k8v8", 1e-3), ("turbo-k4v4", 0.012),
                                        ("turbo-k3v3", 0.04), ("turbo-k2v2", 0.13),
                                        ("affine4", 0.012), ("affine8", 1e-4),
                                        ("affine4,rot", 0.012)])
def test_reconstruction_error_is_near_the_paper(name, bound):
    codec = parse_codec(name).for_layer(0, None, edge=False)
    x = vectors((1, 4, 64, 64), seed=7)
    back = codec.key.unrotate(codec.key.decode(codec.key.encode(x), mx.float32))
    assert (mx.sum((back - x) ** 2) / mx.sum(x * x)).item() < bound


def test_bytes_per_token():
    assert parse_codec("affine4").for_layer(0, None, False).bytes_per_token(3, 64, 64) == 3 * 2 * 36
    assert parse_codec("turbo-k8v4").for_layer(0, None, False).bytes_per_token(1, 64, 64) == 66 + 34
    assert parse_codec("fp").for_layer(0, None, False).bytes_per_token(1, 64, 64) == 512


@pytest.mark.parametrize("bad", ["turbo-k5v4", "affine7", "affine4:g48", "fp8", "turbo-k8v4,x",
                                 "turbo-k4v4,k5@1", "turbo-k4v4,k8@1,fp@1", "turbo-k4v4,k8@",
                                 "affine4,k7@0"])
def test_unknown_codecs_are_refused_before_any_state(bad):
    with pytest.raises(ValueError, match="kv codec"):
        RuntimeConfig.resolve(environ={}, kv_codec=bad)


def test_mlx_lm_flag_spelling():
    assert codec_from_flags(None, 4, 32) == "affine4:g32"
    assert codec_from_flags(None, 8, None) == "affine8:g64"
    assert codec_from_flags("turbo-k8v4", None, None) == "turbo-k8v4"
    with pytest.raises(ValueError):
        codec_from_flags("fp", 4, None)
    with pytest.raises(ValueError):
        codec_from_flags(None, None, 32)


def test_a_model_whose_head_dim_a_codec_cannot_store_is_refused(tiny_model):
    model = tiny_model("llama")  # head dim 16: no affine group fits
    with pytest.raises(ValueError, match="group size"):
        ModelRunner(model, kv_codec="affine4")
    ModelRunner(model, kv_codec="turbo-k4v4")  # fine


def test_a_models_codec_declaration_is_honoured(tiny_model):
    model = tiny_model("llama", head_dim=32)
    model.kv_codecs = ("fp", "affine")
    try:
        with pytest.raises(ValueError, match="supports the kv codecs"):
            ModelRunner(model, kv_codec="turbo-k8v4")
        ModelRunner(model, kv_codec="affine8:g32")
    finally:
        del model.kv_codecs


def test_per_layer_plan(tiny_model):
    runner = ModelRunner(tiny_model("gemma3_text", head_dim=32), kv_codec="turbo-k4v4,fp-sliding")
    kinds = [(c.window, c.codec.name) for c in runner.empty_rows().leaves()]
    assert all((w is None) == (n != "fp") for w, n in kinds) and any(w is None for w, _ in kinds)
    runner = ModelRunner(tiny_model("llama", head_dim=32), kv_codec="affine8:g32,fp-edges")
    names = [c.codec.name for c in runner.empty_rows().leaves()]
    assert names[0] == names[-1] == "fp" and set(names[1:-1]) == {"affine8:g32,fp-edges"}


def test_named_layers_get_their_own_codec(tiny_model):
    """`,fp@L` keeps layer L in float; `,kB@L+M` gives layers L and M B-bit keys (values
    keep the base bits); bytes per token follow."""
    spec = parse_codec("turbo-k4v4,fp@0,k8@1+3")
    assert spec.fp_at == (0,) and spec.key_bits_at == ((8, (1, 3)),)
    assert spec.named_layers == (0, 1, 3)
    runner = ModelRunner(tiny_model("llama", head_dim=32), kv_codec=spec)
    codecs = [c.codec for c in runner.empty_rows().leaves()]
    assert codecs[0].is_fp
    assert [c.key.bits for c in codecs[1:4]] == [8, 4, 8]
    assert {c.value.bits for c in codecs[1:4]} == {4}
    size = [c.bytes_per_token(1, 32, 32) for c in codecs]
    assert size[1] == size[3] > size[2] and size[0] == 2 * 32 * 4
    affine = parse_codec("affine4:g32,k8@2").for_layer(2, None, False)
    assert (affine.key.bits, affine.value.bits) == (8, 4)


def test_a_named_layer_the_model_lacks_is_refused(tiny_model):
    model = tiny_model("llama", head_dim=32)
    layers = len(model.model.layers)
    with pytest.raises(ValueError, match=f"names layers \\[{layers}\\]"):
        ModelRunner(model, kv_codec=f"turbo-k4v4,k8@{layers}")


# --- the cache and the engine under each codec ------------------------------------------
@pytest.mark.parametrize("sinks", [False, True])
def test_affine_codes_are_attended_without_decoding(sinks, monkeypatch):
    """Affine codes go to `mx.quantized_matmul` as they are (centers added back, eq-scaled
    queries): the attention equals attending over the decoded K/V, to rounding."""
    import mlx_tandem.kv.attention as attention

    inner = AffineCodec(4, 32)
    stats = LayerStats(vectors((2, 1, 32), 5), vectors((2, 1, 32), 6),
                       mx.abs(vectors((2, 1, 32), 7)) / 3 + 0.5)
    codec = KVCodec("a", Centered.of(Scaled(inner, stats.key_scale), stats.key_mean),
                    Centered.of(inner, stats.value_mean))
    cache = RowKVCache(codec=codec)
    cache.ends = [0, 0]
    cache.update_and_fetch(vectors((2, 2, 300, 32), 1), vectors((2, 2, 300, 32), 2))
    cache.set_ends([300, 170])
    q, k, v = vectors((2, 4, 3, 32), 3), vectors((2, 2, 3, 32), 4), vectors((2, 2, 3, 32), 8)
    mask = cache.make_mask(3)
    keys, values = cache.update_and_fetch(k, v)
    extra = {"sinks": mx.array([0.5, -1.0, 2.0, 0.0])} if sinks else {}
    got = cache.attend(q, keys, values, scale=0.2, mask=mask, **extra)
    calls = []
    real = attention.Packed.scores
    monkeypatch.setattr(attention.Packed, "scores", lambda self, q: calls.append(1) or real(self, q))
    cache.attend(q, keys, values, scale=0.2, mask=mask, **extra)
    assert calls, "the packed path did not run"
    decoded = cache._decoded(keys.shape[2], max(cache.ends))
    want = codec.value.unrotate(attention.invariant_attention(
        codec.key.rotate(q), *decoded, 0.2, mask, **extra))
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    packed = cache._stored(keys, values, block=False)
    no_center = dataclasses.replace(packed[1], center=None)
    wrong = attention.invariant_attention(codec.key.rotate(q), packed[0],
                                          no_center, 0.2, mask, **extra)
    assert not mx.allclose(wrong, want, atol=1e-2).item()  # the center term matters


def test_a_quantized_cache_refuses_keys_the_model_changed():
    """A quantized cache hands out stand-ins and attends its stored parts: keys the model
    altered after update_and_fetch would be ignored, so they are refused by name."""
    cache = RowKVCache(codec=parse_codec("affine4:g32").for_layer(1, None, edge=False))
    cache.ends = [0]
    mask = cache.make_mask(3)
    keys, values = cache.update_and_fetch(vectors((1, 2, 3, 32), 1), vectors((1, 2, 3, 32), 2))
    q = vectors((1, 4, 3, 32), 3)
    assert cache.attend(q, keys, values, scale=0.2, mask=mask).shape == (1, 4, 3, 32)
    with pytest.raises(ValueError, match="changes them first"):
        cache.attend(q, keys * 2, values, scale=0.2, mask=mask)


@pytest.mark.parametrize("name", ["affine4:g32", "turbo-k3v4"])
def test_a_row_attends_the_same_alone_batched_and_after_rewind(name):
    codec = parse_codec(name).for_layer(1, None, edge=False)
    lens = [3, 40, 300]

    def filled() -> RowKVCache:
        rows = []
        for i, n in enumerate(lens):
            c = RowKVCache(codec=codec)
            c.ends = [0]
            c.update_and_fetch(vectors((1, 2, n, 32), i), vectors((1, 2, n, 32), 10 + i))
            rows.append(c)
        return RowKVCache.merge(rows)

    def step(cache, k, v, q):
        mask = cache.make_mask(k.shape[2])
        return cache.attend(q, *cache.update_and_fetch(k, v), scale=0.2, mask=mask)

    q, k, v = vectors((3, 4, 3, 32), 20), vectors((3, 2, 3, 32), 21), vectors((3, 2, 3, 32), 22)
    batched = filled()
    out = step(batched, k, v, q)
    for i in range(len(lens)):
        alone = batched.take_rows([i])
        alone.set_ends([lens[i]])
        one_by_one = [step(alone, k[i : i + 1, :, j : j + 1], v[i : i + 1, :, j : j + 1],
                           q[i : i + 1, :, j : j + 1]) for j in range(3)]
        assert mx.array_equal(mx.concatenate(one_by_one, axis=2), out[i : i + 1]).item(), i
    batched.set_ends(lens)
    assert mx.array_equal(step(batched, k, v, q), out).item()
    keys, _ = batched.fetch(512)  # decoded in the model's space (the assistant reads this)
    assert keys.shape == (3, 2, 512, 32)
    assert (mx.abs(keys[2, :, 300:303] - k[2]).max() / mx.abs(k).max()).item() < 0.2


def _prompts(n: int, seed: int = 0):
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        base = [rng.randrange(3, 250) for _ in range(rng.choice([1, 5, 12, 30]))]
        prompts.append(base + base[:6] * 2)
        params.append(SamplingParams(max_tokens=rng.randrange(4, 12)))
    return prompts, params


@pytest.mark.parametrize(
    "arch,name",
    [("llama", "affine4:g32"), ("llama", "turbo-k8v4"), ("gemma3_text", "turbo-k3v4"),
     ("qwen3", "affine8:g32,fp-edges"), ("llama", "turbo-k3v4,center"),
     ("gemma3_text", "turbo-k4v4,center,eq"), ("gemma3_text", "affine4:g32,rot,center,vcenter,eq"),
     ("llama", "turbo-k4v4,k8@1")],
)
def test_speculative_equals_plain_and_batched_equals_alone(tiny_model, arch, name):
    model = tiny_model(arch, head_dim=32)
    cfg = RuntimeConfig.resolve(environ={}, prefill_chunk=16, kv_codec=name)
    prompts, params = _prompts(6)
    plain = [r.tokens for r in run_with_gaps(EngineCore(model, cfg), prompts, params, 1)]
    spec = EngineCore(model, cfg, drafter=PromptLookupSource())
    assert [r.tokens for r in run_with_gaps(spec, prompts, params, 2)] == plain
    assert sum(spec.stats.accepted.values()) > 0  # blocks of several tokens were committed
    alone = [
        run_with_gaps(EngineCore(model, cfg), [p], [sp], 3)[0].tokens
        for p, sp in zip(prompts[:3], params[:3], strict=True)
    ]
    assert alone == plain[:3]
    assert name in {c.codec.name for c in spec.runner.empty_rows().leaves()}  # really in use


@pytest.mark.slow
@pytest.mark.parametrize("name", ["affine4:g64,rot,center,eq", "turbo-k4v4,center,eq"])
def test_smollm2_speculative_and_batched_are_exact(real_model, name):
    model = real_model("smollm2-135m", "float32")
    cfg = RuntimeConfig.resolve(environ={}, prefill_chunk=64, kv_codec=name)
    questions = ["What is the capital of France? The capital of France is",
                 "List the first five prime numbers: 2, 3,", "def fibonacci(n):"]
    prompts = [model.encode(q) for q in questions]
    params = [SamplingParams(max_tokens=12) for _ in prompts]
    plain = [r.tokens for r in run_with_gaps(EngineCore(model, cfg), prompts, params, 1)]
    spec = EngineCore(model, cfg, drafter=PromptLookupSource())
    assert [r.tokens for r in run_with_gaps(spec, prompts, params, 2)] == plain
    alone = run_with_gaps(EngineCore(model, cfg), prompts[:1], params[:1], 3)[0].tokens
    assert alone == plain[0]


def test_the_assistant_reads_donor_kv_decoded():
    """The assistant drafter's donor read goes through the codec (model space, not rotated)."""
    from mlx_tandem.drafters.assistant import AssistantSource
    from mlx_tandem.kv.state_rows import StateRows

    codec = parse_codec("turbo-k4v4").for_layer(0, None, edge=False)
    cache = RowKVCache(codec=codec)
    cache.ends = [0, 0]
    k, v = vectors((2, 2, 9, 32), 1), vectors((2, 2, 9, 32), 2)
    cache.update_and_fetch(k, v)
    cache.set_ends([9, 5])
    keys, values, valid = AssistantSource._donor_kv(StateRows([cache], 2), 0, None)
    assert mx.array_equal(keys, cache.fetch(keys.shape[2])[0]).item()
    rel = mx.abs(values[:, :, :9] - v).max() / mx.abs(v).max()
    assert rel.item() < 0.2 and valid[1, 0, 0, :6].tolist() == [True] * 5 + [False]


def test_centering_is_span_safe_and_removes_a_common_component():
    inner = parse_codec("turbo-k4v4").for_layer(2, None, edge=False).key
    x = vectors((1, 2, 6, 64), 4) * 0.2 + vectors((2, 1, 64), 5)[None]  # a big per-head mean
    center = mx.mean(x[0], axis=1, keepdims=True)
    stats = LayerStats(center, center, mx.ones_like(center))
    centered = parse_codec("turbo-k4v4,center").for_layer(2, None, False, stats).key
    assert not span_append_mismatch(centered, x)

    def err(c):
        back = c.unrotate(c.decode(c.encode(x), mx.float32))
        return (mx.sum((back - x) ** 2) / mx.sum(x * x)).item()

    assert err(centered) < err(inner) / 5


def test_the_runner_calibrates_per_layer(tiny_model):
    runner = ModelRunner(tiny_model("llama", head_dim=32), kv_codec="turbo-k4v4,center,eq")
    keys = [c.codec.key for c in runner.empty_rows().leaves()]
    assert all(isinstance(k, Centered) and isinstance(k.inner, Scaled) for k in keys)
    values = [c.codec.value for c in runner.empty_rows().leaves()]
    assert not any(isinstance(v, Centered) for v in values)  # only with ,vcenter
    assert all(k.center.shape == k.inner.scale.shape == (2, 1, 32) for k in keys)
    assert not mx.array_equal(keys[0].center, keys[1].center).item()
    assert abs(mx.mean(keys[0].inner.scale ** 2).item() - 1) < 1e-4


def test_scaling_keys_keeps_attention_and_fetch():
    """Stored k / s, attended with q * s: the same attention (to rounding), keys fetched back."""
    from mlx_tandem.kv.codec import FpCodec

    scale = mx.abs(vectors((2, 1, 32), 3)) + 0.5
    scaled = KVCodec("eq", Scaled(FpCodec(), scale), FpCodec())
    q, k, v = vectors((1, 4, 3, 32), 1), vectors((1, 2, 3, 32), 2), vectors((1, 2, 3, 32), 3)
    outs, caches = [], []
    for codec in (scaled, parse_codec("fp").for_layer(0, None, False)):
        cache = RowKVCache(codec=codec)
        cache.ends = [0]
        mask = cache.make_mask(3)
        outs.append(cache.attend(q, *cache.update_and_fetch(k, v), scale=0.2, mask=mask))
        caches.append(cache)
    assert mx.allclose(outs[0], outs[1], atol=1e-5).item()
    assert mx.allclose(caches[0].fetch(3)[0], k, atol=1e-5).item()
    assert not mx.allclose(caches[0].kparts[0][:, :, :3], k, atol=1e-3).item()  # stored k / s
    assert not span_append_mismatch(Scaled(parse_codec("turbo-k3v3").for_layer(
        0, None, False).key, scale), vectors((1, 2, 5, 32), 9))


def test_rot_quantizes_the_rotated_vector():
    """`,rot`: the codes are those of the rotated vector; decoding gives it back in the
    rotated space (attention's), and fetch un-rotates to the model's."""
    x = vectors((1, 2, 8, 64), seed=11)
    codec = parse_codec("affine4,rot").for_layer(3, None, False).key
    plain = parse_codec("affine4").for_layer(3, None, False).key
    parts = codec.encode(x)
    assert mx.array_equal(parts[0], plain.encode(codec.rotate(x))[0]).item()
    back = codec.unrotate(codec.decode(parts, mx.float32))
    assert (mx.sum((back - x) ** 2) / mx.sum(x * x)).item() < 0.012
    assert not mx.array_equal(parts[0], plain.encode(x)[0]).item()
    with pytest.raises(ValueError, match="turbo always rotates"):
        parse_codec("turbo-k4v4,rot")
    assert "power of two" in codec.check(48)
