"""Real SmolLM2 (from PyPI): plain path == mlx-lm, rows engine batch-invariant, speculation lossless."""

import json

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from mlx_tandem import SamplingParams
from mlx_tandem.cli.main import main
from mlx_tandem.drafters.draft_model import DraftModelSource
from mlx_tandem.drafters.prompt_lookup import PromptLookupSource
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import AdaptiveDepth, FixedDepth
from mlx_tandem.engine.generate import decode_steps
from mlx_tandem.engine.sampling import RowSampler

from conftest import count_certified

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
    "List three prime numbers.",
    "Explain photosynthesis in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Rewrite this sentence in the past tense: I walk to the store and I buy bread.",
    "What is 12 times 12?",
]
CFG = RuntimeConfig.resolve(environ={}, prefill_chunk=64)


@pytest.fixture(scope="module")
def smollm2(real_model):
    return real_model("smollm2-135m", "float32")


@pytest.mark.parametrize("dtype", ["float32", "native"])
def test_plain_path_is_bit_identical_to_mlx_lm(real_model, dtype):
    m = real_model("smollm2-135m", dtype)
    prompt = m.encode(QUESTIONS[1])
    sampler = RowSampler(SamplingParams(max_tokens=16), m.graph.vocab_size)
    ours = list(decode_steps(m.graph, prompt, sampler, 16))
    twin, _ = load_model(m.path)  # mlx-lm's own load: no stacked projections (models/fused.py)
    assert (m.graph.fused is not None) == (dtype == "float32")
    theirs = list(generate_step(mx.array(prompt), twin, max_tokens=16))
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    assert all(mx.array_equal(a.reshape(-1), b.reshape(-1)).item()
               for (_, a), (_, b) in zip(ours, theirs, strict=True))


def _params(i):
    if i % 4 == 3:
        return SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=i)
    return SamplingParams(max_tokens=12)


def _run(model, prompts, drafter=None, k=3, first=0):
    engine = EngineCore(model, CFG, drafter=drafter, depth=FixedDepth(k))
    handles = []
    for i, p in enumerate(prompts, start=first):
        handles.append(engine.submit(p, _params(i)))
        engine.step()
    engine.run_until_idle()
    return [h.result().tokens for h in handles], engine


@pytest.fixture(scope="module")
def alone(smollm2):
    prompts = [smollm2.encode(q) for q in QUESTIONS]
    return prompts, [_run(smollm2, [p], first=i)[0][0] for i, p in enumerate(prompts)]


def test_eight_prompts_batched_equal_each_alone(smollm2, alone):
    prompts, expected = alone
    got, _ = _run(smollm2, prompts)
    assert got == expected
    assert "Paris" in smollm2.tokenizer.decode(got[0])


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_speculation_is_lossless_on_smollm2(smollm2, alone, drafter):
    prompts, expected = alone
    source = PromptLookupSource() if drafter == "ngram" else DraftModelSource(smollm2, chunk=64)
    got, engine = _run(smollm2, prompts, source, k=4)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if _params(i).greedy:
            assert g == e, QUESTIONS[i]
    if drafter == "self":
        assert engine.stats.acceptance(source.name) > 0.9


def test_greedy_rows_on_certified_picks_equal_each_alone(smollm2, alone):
    """An all-greedy cohort with the model drafting for itself (verifies of up to 30 slots):
    its picks come from one fast head call, certified (models/certified_head.py), where the
    head's plan would not make that call anyway; every row equals itself alone."""
    prompts, expected = alone
    greedy = [i for i in range(len(prompts)) if _params(i).greedy]
    engine = EngineCore(smollm2, CFG, drafter=DraftModelSource(smollm2, chunk=64),
                        depth=FixedDepth(4))
    calls = count_certified(engine)
    handles = [engine.submit(prompts[i], _params(i)) for i in greedy]
    engine.run_until_idle()
    assert [h.result().tokens for h in handles] == [expected[i] for i in greedy]
    if not engine.runner.head_plan.as_is(len(greedy) * 5):
        assert calls["picks"] > 0


def test_cli_answers_paris(capsys):
    code = main(["generate", "--model", "smollm2-135m", "--prompt", "What is the capital of France?",
                 "--max-tokens", "12", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and "Paris" in out["text"]


GROUNDED = [
    "What is the capital of Australia, and why isn't it Sydney?",
    QUESTIONS[2],
    "Copy this list twice: apples, pears, plums, apples, pears, plums.",
]


def _sampled(i):
    return SamplingParams(max_tokens=16, temperature=1.0, seed=1000 + i)


def _run_sampled(model, prompts, drafter=None, first=0):
    engine = EngineCore(model, CFG, drafter=drafter, depth=AdaptiveDepth(4) if drafter else None)
    handles = []
    for i, p in enumerate(prompts, start=first):
        handles.append(engine.submit(p, _sampled(i)))
        engine.step()
    engine.run_until_idle()
    return [h.result().tokens for h in handles]


@pytest.fixture(scope="module")
def plain_sampled(smollm2):
    """GROUNDED's prompts and their seeded plain samples, each row alone."""
    prompts = [smollm2.encode(q) for q in GROUNDED]
    return prompts, [_run_sampled(smollm2, [p], first=i)[0] for i, p in enumerate(prompts)]


def test_seeded_sampling_under_adaptive_depth_on_smollm2(smollm2, plain_sampled):
    """Adaptive depth (the server's default) never changes a seeded row: with prompt lookup
    the tokens equal plain sampling, alone and batched; with a sampling draft model they are
    identical alone and batched."""
    prompts, plain = plain_sampled
    assert _run_sampled(smollm2, prompts, PromptLookupSource()) == plain
    assert [_run_sampled(smollm2, [p], PromptLookupSource(), first=i)[0]
            for i, p in enumerate(prompts)] == plain
    batched = _run_sampled(smollm2, prompts[:2], DraftModelSource(smollm2, chunk=64))
    assert batched == [_run_sampled(smollm2, [p], DraftModelSource(smollm2, chunk=64), first=i)[0]
                       for i, p in enumerate(prompts[:2])]


def _shipped_assistant(model, mode="greedy"):
    from mlx_tandem.drafters.factory import build_drafter

    return build_drafter(f"assistant:{mode}", model, CFG)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_shipped_assistant_is_lossless_and_accepted_on_smollm2(smollm2, alone, k):
    """Greedy rows token-identical to plain at depth k, batched, rows joining each step; the
    shipped assistant's drafts are accepted (~20% of first drafts here, not none)."""
    prompts, expected = alone
    got, engine = _run(smollm2, prompts, _shipped_assistant(smollm2), k=k)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if _params(i).greedy:
            assert g == e, QUESTIONS[i]
    assert engine.stats.position_acceptance("assistant")[0] > 0.1


def test_shipped_assistant_seeded_sampling_alone_equals_batched(smollm2, plain_sampled):
    """Sampled drafting (q = the assistant's distribution) keeps a seeded row's tokens the same
    alone and batched; greedy drafting keeps them equal to plain sampling."""
    prompts, plain = plain_sampled
    batched = _run_sampled(smollm2, prompts, _shipped_assistant(smollm2, "sample"))
    assert batched == [_run_sampled(smollm2, [p], _shipped_assistant(smollm2, "sample"),
                                    first=i)[0] for i, p in enumerate(prompts)]
    assert _run_sampled(smollm2, prompts, _shipped_assistant(smollm2)) == plain


def test_cli_generate_with_the_shipped_assistant(capsys):
    code = main(["generate", "--model", "smollm2-135m", "--prompt", "Explain what a cloud is.",
                 "--max-tokens", "32", "--draft-model", "assistant", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["speculative"]["accepted"] > 0


def test_lookup_first_with_the_shipped_assistant_is_lossless_on_smollm2(smollm2, alone,
                                                                         plain_sampled):
    """`assistant+ngram`: greedy rows token-identical to plain (batched, joining each step),
    and seeded sampled rows to plain sampling under adaptive depth."""
    from mlx_tandem.drafters.factory import build_drafter

    prompts, expected = alone
    got, engine = _run(smollm2, prompts, build_drafter("assistant+ngram", smollm2, CFG))
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if _params(i).greedy:
            assert g == e, QUESTIONS[i]
    assert engine.stats.acceptance("assistant+ngram") > 0.1
    prompts, plain = plain_sampled
    assert _run_sampled(smollm2, prompts, build_drafter("assistant+ngram", smollm2, CFG)) == plain
