"""Plain generation vs mlx-lm's generate_step: tokens and per-step logprobs bit-identical
(the compiled one-token step where its family is covered, and the eager step)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from mlx_tandem import SamplingParams, generate, stream_generate
from mlx_tandem.engine.compiled_step import compiled_step
from mlx_tandem.engine.generate import decode_steps
from mlx_tandem.engine.sampling import RowSampler

from conftest import TINY_ARCHS

PROMPT = [258, 71, 68, 75, 75, 78, 220, 86, 78, 81, 75, 67, 30, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def _ours(m, prompt, params, n, step=2048, compiled=True):
    sampler = RowSampler(params, m.graph.vocab_size)
    steps = decode_steps(m.graph, prompt, sampler, n, prefill_step_size=step, compiled=compiled)
    return list(steps)


def _theirs(m, prompt, n, step=2048, processors=None):
    gen = generate_step(
        mx.array(prompt),
        m.model,
        max_tokens=n,
        prefill_step_size=step,
        logits_processors=processors,
    )
    return [(t, lp) for t, lp in gen]


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("prefill_step", [2048, 5])
def test_greedy_matches_generate_step(tiny_model, arch, prefill_step):
    m = tiny_model(arch)
    ours = _ours(m, PROMPT, SamplingParams(max_tokens=40), 40, prefill_step)
    theirs = _theirs(m, PROMPT, 40, prefill_step)
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    for (_, a), (_, b) in zip(ours, theirs, strict=True):
        assert mx.array_equal(a.reshape(-1), b.reshape(-1)).item()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_compiled_step_is_used_and_equals_eager_and_mlx_lm(tiny_model, arch):
    """300 steps: past the KV cache's 256-column growth and the tiny Gemma's 16-token window."""
    m = tiny_model(arch)
    assert compiled_step(m.graph, m.graph.make_cache()) is not None
    params = SamplingParams(max_tokens=300)
    fast = _ours(m, PROMPT, params, 300)
    eager = _ours(m, PROMPT, params, 300, compiled=False)
    theirs = _theirs(m, PROMPT, 300)
    assert [t for t, _ in fast] == [t for t, _ in eager] == [t for t, _ in theirs]
    for (_, a), (_, b), (_, c) in zip(fast, eager, theirs, strict=True):
        assert mx.array_equal(a.reshape(-1), c.reshape(-1)).item()
        assert mx.array_equal(b.reshape(-1), c.reshape(-1)).item()


def test_compiled_step_declines_other_families_and_caches(tiny_model):
    assert compiled_step(tiny_model("qwen3").graph, tiny_model("qwen3").graph.make_cache()) is None
    llama = tiny_model("llama").graph
    assert compiled_step(llama, llama.make_cache()[:1]) is None


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_processors_match_mlx_lm(tiny_model, arch):
    m = tiny_model(arch)
    windows = {"repetition_context_size": 9, "presence_context_size": 4,
               "frequency_context_size": 13}  # three windows, as mlx-lm keeps them
    params = SamplingParams(
        max_tokens=30,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={7: 2.0, 42: -1.5},
        **windows,
    )
    processors = make_logits_processors(
        logit_bias={7: 2.0, 42: -1.5},
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        **windows,
    )
    ours = _ours(m, PROMPT, params, 30)
    theirs = _theirs(m, PROMPT, 30, processors=processors)
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    for (_, a), (_, b) in zip(ours, theirs, strict=True):
        assert mx.array_equal(a.reshape(-1), b.reshape(-1)).item()


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_model):
    m = tiny_model("llama")
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234)
    a = generate(m, PROMPT, params).tokens
    b = generate(m, PROMPT, params).tokens
    c = generate(m, PROMPT, SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=99))
    assert a == b
    assert a != c.tokens


def test_max_tokens_and_length_finish(tiny_model):
    m = tiny_model("llama")
    r = generate(m, PROMPT, max_tokens=7)
    assert len(r.tokens) == 7 and r.finish_reason == "length"
    assert r.text == m.tokenizer.decode(r.tokens)
    assert r.stats.prompt_tokens == len(PROMPT) and r.stats.generation_tokens == 7


def test_eos_and_stop_token_ids_end_the_row(tiny_model):
    m = tiny_model("llama")
    free = generate(m, PROMPT, max_tokens=12).tokens
    stop_at = free[5]
    r = generate(m, PROMPT, max_tokens=12, stop_token_ids=(stop_at,))
    assert r.finish_reason == "stop"
    assert r.tokens == free[: free.index(stop_at)]
    assert stop_at not in r.tokens


def test_stop_string_cuts_text_and_streaming_holds_it_back(tiny_model):
    m = tiny_model("llama")
    free = generate(m, PROMPT, max_tokens=16)
    stop = free.text[6:9]
    assert stop, "tiny model produced too little text for this test"
    chunks = list(stream_generate(m, PROMPT, max_tokens=16, stop=(stop,)))
    streamed = "".join(c.text for c in chunks)
    assert streamed == free.text[: free.text.find(stop)]
    assert chunks[-1].finish_reason == "stop"


def test_logprobs_top_n(tiny_model):
    m = tiny_model("qwen3")
    r = generate(m, PROMPT, max_tokens=5, logprobs=3)
    assert len(r.logprobs) == 5
    for info, token in zip(r.logprobs, r.tokens, strict=True):
        assert info.token == token and len(info.top) == 3
        assert info.top[0][0] == token  # greedy: the chosen token is the most likely
        assert info.top[0][1] >= info.top[1][1] >= info.top[2][1]
        assert info.logprob == pytest.approx(info.top[0][1])


def test_context_window_and_empty_prompt_errors(tiny_model):
    m = tiny_model("llama")
    with pytest.raises(ValueError, match="context window"):
        generate(m, PROMPT, max_tokens=m.context_length)
    with pytest.raises(ValueError, match="empty"):
        generate(m, [], max_tokens=3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(m, PROMPT, max_tokens=3, logit_bias={10**6: 1.0})
    with pytest.raises(ValueError, match="prompt token 999999 is outside the vocabulary"):
        generate(m, [*PROMPT, 999999], max_tokens=3)


def test_prompts_as_arrays_and_bad_arguments(tiny_model):
    """Prompt ids as numpy / MLX arrays run as the list does (mlx-lm takes them); wrong
    argument types, params given twice and a zero prefill step are refused by name."""
    import numpy as np

    from mlx_tandem.engine.config import RuntimeConfig
    from mlx_tandem.engine.core import EngineCore

    m = tiny_model("llama")
    ref = generate(m, PROMPT, max_tokens=4).tokens
    assert generate(m, np.array(PROMPT), max_tokens=4).tokens == ref
    assert generate(m, mx.array(PROMPT), max_tokens=4).tokens == ref
    assert generate(m, [np.int64(t) for t in PROMPT], max_tokens=4).tokens == ref
    with pytest.raises(TypeError, match="NoneType"):
        generate(m, None, max_tokens=4)
    with pytest.raises(TypeError, match="1-D integer"):
        generate(m, np.array([PROMPT]), max_tokens=4)
    with pytest.raises(TypeError, match="SamplingParams, not dict"):
        generate(m, PROMPT, {"max_tokens": 4})
    with pytest.raises(ValueError, match="not both"):
        generate(m, PROMPT, SamplingParams(max_tokens=3), max_tokens=6)
    with pytest.raises(ValueError, match="prefill_step_size"):
        generate(m, PROMPT, max_tokens=3, prefill_step_size=0)
    with pytest.raises(ValueError, match="not an int"):
        generate(m, [*PROMPT, 1.5], max_tokens=3)
    core = EngineCore(m, RuntimeConfig.resolve(environ={}))
    with pytest.raises(ValueError, match="encode the text first"):
        core.submit("text", SamplingParams(max_tokens=3))
    handle = core.submit(np.array(PROMPT), SamplingParams(max_tokens=4))
    core.run_until_idle()
    assert handle.result().tokens == ref


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_compiled_step_on_real_float32_models(real_model, name):
    m = real_model(name, "float32")
    prompt = m.encode("Write a short story about a lighthouse keeper.")
    assert compiled_step(m.graph, m.graph.make_cache()) is not None
    ours = _ours(m, prompt, SamplingParams(max_tokens=12), 12)
    theirs = _theirs(m, prompt, 12)
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    for (_, a), (_, b) in zip(ours, theirs, strict=True):
        assert mx.array_equal(a.reshape(-1), b.reshape(-1)).item()
