"""SamplingParams validation and the keyed per-row sampler."""

import mlx.core as mx
import pytest

from mlx_tandem.engine.sampling import RowSampler, SamplingParams, position_key


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 1.01),
        ("top_k", -1),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", float("inf")),
        ("logprobs", 21),
        ("stop", ("",)),
        ("stop_token_ids", (-1,)),
        ("seed", "x"),
        ("logit_bias", {-3: 1.0}),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value) or "logit_bias" in str(err.value)


def test_keyed_sampling_equals_categorical_and_depends_on_position():
    logits = mx.random.normal((1, 300), key=mx.random.key(3))
    sampler = RowSampler(SamplingParams(temperature=0.7, seed=5), vocab_size=300)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for position in range(5):
        ours = sampler.sample(logprobs, position)
        ref = mx.random.categorical(logprobs * (1 / 0.7), key=position_key(5, position))
        assert ours.item() == ref.item()
    draws = {sampler.sample(logprobs, p).item() for p in range(50)}
    assert len(draws) > 5  # different positions draw independently


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
