"""Certified greedy picks from one fast LM-head call (models/certified_head.py)."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from mlx_tandem import SamplingParams
from mlx_tandem.drafters.prompt_lookup import PromptLookupSource
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import FixedDepth
from mlx_tandem.engine.generate import generate
from mlx_tandem.engine.verify import TIE_MARGIN
from mlx_tandem.models.certified_head import CertifiedHead, certify_head
from mlx_tandem.models.invariance import RowPlan

from conftest import count_certified, run_with_gaps


def _weight(V: int = 64, D: int = 32, seed: int = 0) -> mx.array:
    return mx.random.normal((V, D), key=mx.random.key(seed))


def test_only_a_head_that_is_a_float32_matmul_gets_a_certificate():
    W = _weight()
    assert certify_head(lambda x: x @ W.T, W) is not None
    assert certify_head(lambda x: mx.tanh((x @ W.T) / 30) * 30, W) is None  # soft-capping
    assert certify_head(lambda x: (x @ W.T) * 0.5, W) is None  # logit scaling
    assert certify_head(lambda x: x @ W.T + 1.0, W) is None  # a bias
    W16 = W.astype(mx.float16)
    assert certify_head(lambda x: x @ W16.T, W16) is None
    assert certify_head(lambda x: x @ W.T, None) is None


def _near_ties(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Hidden rows and a head whose rows come in near-identical pairs: many slots' runner-up
    lies within the rounding bound of the top, others lead clearly."""
    rng = np.random.default_rng(seed)
    V, D, N = 96, 64, 400
    W = rng.normal(size=(V, D))
    spread = 10.0 ** rng.uniform(-8, -4, size=(24, 1))  # pairs apart by ~1e-8 .. 1e-4
    W[1:48:2] = W[0:48:2] + rng.normal(size=(24, D)) * spread
    x = rng.normal(size=(N, D)) * rng.choice([0.3, 1.0, 3.0], size=(N, 1))
    return x.astype(np.float32).astype(np.float64), W.astype(np.float32).astype(np.float64)


def _adversaries(x: np.ndarray, W: np.ndarray, gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """Two results of the same logits, each within 0.9·γ‖x‖‖w‖ of the real value (float32
    rounding stays inside the bound), pushed apart as far as that allows: the fast one
    favours the real top, the exact one every other token."""
    real = x @ W.T
    bound = 0.9 * gamma * np.linalg.norm(x, axis=1)[:, None] * np.linalg.norm(W, axis=1)[None]
    top = real.argmax(axis=1)[:, None] == np.arange(W.shape[0])[None]
    fast = np.where(top, real + bound, real - bound)
    exact = np.where(top, real - bound, real + bound)
    return fast.astype(np.float32), exact.astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_fast_head_off_by_the_rounding_bound_never_changes_a_certified_pick(seed):
    x, W = _near_ties(seed)
    head = certify_head(lambda h: h @ mx.array(W, mx.float32).T, mx.array(W, mx.float32))
    assert head is not None
    fast, exact = _adversaries(x, W, head.gamma)
    picks, unsure = head.judge(mx.array(fast), mx.array(x, mx.float32), TIE_MARGIN)
    picks, unsure = np.array(picks), np.array(unsure)
    sure = ~unsure
    assert 0.1 < unsure.mean() < 0.9  # both kinds of slot are exercised
    ordered = np.sort(exact, axis=1)
    assert (picks[sure] == exact.argmax(axis=1)[sure]).all()
    assert (ordered[sure, -1] - ordered[sure, -2] > TIE_MARGIN).all()  # no tie in the exact path
    # negative controls: without the rounding bound, or with 0.6 of it, some "sure" picks
    # are wrong
    for scale, tie in ((0.0, 0.0), (0.6, TIE_MARGIN)):
        weak = CertifiedHead(head.weight, head.norms, head.gamma * scale)
        w_picks, w_unsure = (np.array(a) for a in weak.judge(mx.array(fast), mx.array(x, mx.float32), tie))
        assert (w_picks[~w_unsure] != exact.argmax(axis=1)[~w_unsure]).any(), scale


def _greedy_case(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        base = [rng.randrange(3, 250) for _ in range(rng.choice([2, 9, 30]))]
        prompts.append(base + base[:5] * 2)
    return prompts, [SamplingParams(max_tokens=rng.randrange(6, 14)) for _ in range(n)]


def test_greedy_cohorts_with_sure_and_unsure_picks_equal_plain_decoding(tiny_model):
    model = tiny_model("llama")
    prompts, params = _greedy_case(6, seed=5)
    expected = [generate(model, p, sp).tokens for p, sp in zip(prompts, params, strict=True)]
    config = RuntimeConfig.resolve(environ={}, prefill_chunk=16, max_rows=8)
    for mode in ("certified", "every slot unsure", "exact head"):
        engine = EngineCore(model, config, drafter=PromptLookupSource(), depth=FixedDepth(3))
        head = engine.runner.certified
        assert head is not None  # a tiny float32 llama has a plain tied head
        # certified picks whenever the exact head would not be one call as it is; here that
        # is every call of two slots or more, whatever this machine's plan for the head
        engine.runner.head_plan = RowPlan(chunk=1)
        if mode == "every slot unsure":
            engine.runner.certified = CertifiedHead(head.weight, head.norms, 1.0)
        elif mode == "exact head":
            engine.runner.certified = None
        calls = count_certified(engine)
        results = run_with_gaps(engine, prompts, params, seed=1)
        assert [r.tokens for r in results] == expected, mode
        assert sum(r.stats.accepted for r in results) > 0
        assert calls["picks"] > 0 if mode != "exact head" else calls["picks"] == 0
        # unsure rows are decided on their own exact logits, and only they
        assert calls["rows"] > 0 if mode == "every slot unsure" else calls["rows"] == 0


def test_rows_that_read_their_logits_keep_the_exact_head(tiny_model):
    """A row reporting logprobs in the cohort: no certified picks that step, and its
    logprobs are the ones it gets alone (the same exact head)."""
    model = tiny_model("llama")
    prompts, params = _greedy_case(3, seed=9)
    params[1] = SamplingParams(max_tokens=params[1].max_tokens, logprobs=3)
    config = RuntimeConfig.resolve(environ={}, prefill_chunk=16, max_rows=4)
    engine = EngineCore(model, config)
    engine.runner.head_plan = RowPlan(chunk=1)  # as above: certified wherever allowed
    calls = count_certified(engine)
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while len(engine.running) < 3:
        engine.step()
    engine.step()
    assert calls["picks"] == 0
    engine.run_until_idle()
    results = [h.result() for h in handles]
    for r, p, sp in zip(results, prompts, params, strict=True):
        alone = EngineCore(model, config)
        handle = alone.submit(p, sp)
        alone.run_until_idle()
        assert r.tokens == generate(model, p, sp).tokens
        assert r.logprobs == handle.result().logprobs
    assert results[1].logprobs
