"""SamplingParams validation and the keyed per-row sampler."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_tandem.engine.sampling import (
    MIN_SCALE,
    PURPOSE_SAMPLE,
    Grammar,
    InvalidParameter,
    RowSampler,
    SamplingParams,
    key_uniforms,
    keyed_draws,
    keyed_picks,
    knobs,
    position_key,
    position_keys,
)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 1.01),
        ("top_k", -1),
        ("min_p", 2.0),
        ("repetition_penalty", 1e-9),
        ("presence_penalty", 3.0),
        ("frequency_penalty", float("inf")),
        ("logprobs", 21),
        ("stop", ("",)),
        ("stop_token_ids", (-1,)),
        ("stop_token_ids", tuple(range(65))),
        ("seed", "x"),
        ("logit_bias", {-3: 1.0}),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value) or "logit_bias" in str(err.value)


def test_the_library_reads_values_as_flags_and_requests_do():
    """Lists where tuples are kept, and a knob's `off` value (0 for the penalties) as off —
    what `--repetition-penalty 0` and `"repetition_penalty": 0` mean too."""
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[3], repetition_penalty=0.0,
                            presence_penalty=0)
    assert (params.stop, params.stop_token_ids) == (("a", "b"), (3,))
    assert params.repetition_penalty is None and params.presence_penalty is None


def test_a_json_logit_bias_names_each_token_once_with_a_number():
    from mlx_tandem.engine.sampling import bias_from_json

    assert bias_from_json({"5": 1, "7": -2.5}) == {5: 1.0, 7: -2.5}
    for bad, why in (({"5": 1, "05": 2}, "named twice"), ({"5": True}, "must be a number"),
                     ({"x": 1}, "not a token id"), ({"5": "1"}, "must be a number")):
        with pytest.raises(InvalidParameter, match=why) as err:
            bias_from_json(bad)
        assert err.value.field == "logit_bias"


def test_a_keyed_draw_is_the_inverse_cdf_at_its_keys_uniform_and_depends_on_position():
    logits = mx.random.normal((1, 300), key=mx.random.key(3)) * 2
    sampler = RowSampler(SamplingParams(temperature=0.7, seed=5), vocab_size=300)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = np.exp(np.array(logprobs[0], dtype=np.float64) / 0.7)
    sums = np.cumsum(p)
    draws = []
    for position in range(50):
        ours = sampler.sample(logprobs, position)
        u = key_uniforms(position_key(5, position)[None]).item()
        assert ours.shape == (1,) and ours.item() == np.searchsorted(sums, u * sums[-1], "right")
        draws.append(ours.item())
    assert len(set(draws)) > 5  # different positions draw independently


def _chi_square(draws: np.ndarray, p: np.ndarray) -> float:
    expected = p * len(draws)
    return float((((np.bincount(draws, minlength=len(p)) - expected) ** 2) / expected).sum())


def test_keyed_draws_follow_the_distribution():
    """Chi-square over 100,000 keys on a peaked distribution with a 0.5% token (7 degrees of
    freedom: 24.3 at p = 0.001). Control: the same test rejects draws from p^1.1."""
    p = np.array([0.5, 0.2, 0.1, 0.1, 0.05, 0.03, 0.015, 0.005])
    n = 100_000
    keys = position_keys([123] * n, np.arange(n)[:, None], PURPOSE_SAMPLE)[:, 0]
    logits = mx.broadcast_to(mx.array(np.log(p), dtype=mx.float32), (n, len(p)))
    assert _chi_square(np.array(keyed_draws(keys, logits)), p) < 24.3
    assert _chi_square(np.array(keyed_draws(keys, logits * 1.1)), p) > 24.3


def test_keyed_draws_never_take_a_zero_weight_token_and_are_the_same_alone_and_batched():
    V = 64
    rows = mx.random.normal((6, V), key=mx.random.key(8)) * 3
    masked = mx.arange(V) % 3 == 1
    rows = mx.concatenate([mx.where(masked, -mx.inf, rows[:3]), rows[3:]])
    keys = position_keys(list(range(6)), np.full((6, 1), 17), PURPOSE_SAMPLE)[:, 0]
    batched = keyed_draws(keys, rows).tolist()
    assert batched == [keyed_draws(keys[i : i + 1], rows[i : i + 1]).item() for i in range(6)]
    n = 3000
    many = position_keys([9] * n, np.arange(n)[:, None], PURPOSE_SAMPLE)[:, 0]
    draws = np.array(keyed_draws(many, mx.broadcast_to(rows[0], (n, V))))
    assert not np.array(masked)[draws].any() and len(set(draws.tolist())) > 5
    # the extreme uniforms (2^-24 and 1 - 2^-24) land on the outermost tokens of positive weight
    weights = mx.array([[0.0, 0.0, 5.0, 1.0, 2.0, 0.0, 0.0]] * 2)
    extremes = mx.array([[0, 0], [0xFFFFFFFF, 0xFFFFFFFF]], dtype=mx.uint32)
    assert keyed_picks(extremes, weights).tolist() == [2, 4]


def test_truncation_filters_restrict_the_support():
    logits = mx.array([[5.0, 4.0, 3.0, -2.0, -3.0]])
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    top_k = RowSampler(SamplingParams(temperature=1.0, top_k=2, seed=1), 5)
    assert {top_k.sample(logprobs, p).item() for p in range(200)} == {0, 1}
    top_p = RowSampler(SamplingParams(temperature=1.0, top_p=0.5, seed=1), 5)
    assert {top_p.sample(logprobs, p).item() for p in range(200)} == {0}
    min_p = RowSampler(SamplingParams(temperature=1.0, min_p=0.3, seed=1), 5)
    assert {min_p.sample(logprobs, p).item() for p in range(300)} == {0, 1}


def test_unseeded_rows_get_distinct_seeds():
    a = RowSampler(SamplingParams(temperature=1.0), 10)
    b = RowSampler(SamplingParams(temperature=1.0), 10)
    assert a.seed != b.seed


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 1e-45),  # 1/T overflows float32: every scaled logit would be -inf
        ("temperature", 5e-7),
        ("repetition_penalty", 1e-45),  # positive logits / penalty overflow
        ("max_tokens", True),  # bool is not a number
        ("top_k", 2.0),
        ("logit_bias", {3: 101.0}),
        ("stop", ("a",) * 17),
    ],
)
def test_values_without_a_distribution_or_of_the_wrong_type_raise_invalid_parameter(field, value):
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field and field in str(err.value)


def test_smallest_allowed_scales_still_sample():
    logits = mx.array([[2.0, 1.0, 0.5, -1.0]])
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    cold = RowSampler(SamplingParams(temperature=MIN_SCALE, seed=2), 4)
    assert mx.all(mx.isfinite(cold.sample_logits(logprobs)[:, :1])).item()
    assert {cold.sample(logprobs, p).item() for p in range(20)} == {0}


def test_every_knob_is_declared_once_and_derived_everywhere():
    import argparse

    from mlx_tandem.cli.options import add_sampling_flags, sampling_values
    from mlx_tandem.server.schemas import ChatCompletionRequest

    parser = argparse.ArgumentParser()
    add_sampling_flags(parser)
    flags = {f for a in parser._actions for f in a.option_strings}
    fields = ChatCompletionRequest.model_fields
    for name, (k, _) in knobs().items():
        assert set(k.flags) <= flags, name
        assert all(w in fields and fields[w].description == k.help for w in k.wire), name
        if k.flags:
            assert name in sampling_values(parser.parse_args([])), name
    assert {"--max-tokens", "-m", "--temp", "--top-p", "--top-k", "--min-p", "--seed"} <= flags
    assert SamplingParams(**sampling_values(parser.parse_args(["--temp", "0.5"]))).temperature == 0.5


def test_a_grammar_cannot_ignore_eos():
    """A complete grammar allows only EOS next: ignoring it would emit EOS as text and break
    the parser (and speculation would cut it elsewhere than plain decoding)."""
    grammar = Grammar("json_object")
    SamplingParams(grammar=grammar)
    with pytest.raises(InvalidParameter, match="ignore_eos"):
        SamplingParams(grammar=grammar, ignore_eos=True)
