"""The architecture matrix: for every family declared in models/families.py, a tiny
random-weight model built from mlx-lm's own classes either keeps the engine's promise
(batched == alone; greedy speculation with prompt lookup and with itself as draft model
== plain, hybrid recurrent families included) or is refused by name, as declared. No
family runs silently inexact."""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_tandem import SamplingParams
from mlx_tandem.drafters.draft_model import DraftModelSource
from mlx_tandem.drafters.prompt_lookup import PromptLookupSource
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import FixedDepth
from mlx_tandem.models import families
from mlx_tandem.models.families import FAMILIES, Family
from mlx_tandem.models.tiny import FAMILY_OVERRIDES

from conftest import run_with_gaps

NAMES = tuple(FAMILIES)
CFG = RuntimeConfig.resolve(environ={}, prefill_chunk=16)
DOCS = Path(__file__).parents[1] / "docs" / "ARCHITECTURE.md"


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Short and chunked (> 16 tokens) prompts with repeats (prompt lookup finds drafts);
    greedy rows and one seeded sampled row, different lengths so rows leave mid-flight."""
    rng = random.Random(0)
    prompts = []
    for n in (1, 7, 14, 30):
        base = [rng.randrange(3, 250) for _ in range(n)]
        prompts.append(base + base[:6] * 2)
    params = [SamplingParams(max_tokens=k) for k in (9, 12, 6)]
    params.append(SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=3))
    return prompts, params


@pytest.fixture(scope="module")
def family_model(tiny_model):
    def get(name: str):
        return tiny_model(name, **FAMILY_OVERRIDES.get(name, {}))

    return get


@pytest.fixture(scope="module")
def alone(family_model):
    """Each request of the workload run alone in the rows engine (no drafter), per family."""
    cache: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            out = []
            for p, sp in zip(*workload(), strict=True):
                engine = EngineCore(family_model(name), CFG)
                handle = engine.submit(p, sp)
                engine.run_until_idle()
                out.append(handle.result().tokens)
            cache[name] = out
        return cache[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_the_split_forward_is_mlx_lms_own(family_model, name):
    """forward_hidden + project_logits == mlx-lm's Model.__call__, bit for bit (head
    scaling, soft-capping and wrappers included)."""
    m = family_model(name)
    ids = mx.array([[5, 17, 99, 3, 250, 42, 42, 7]])
    hidden = m.graph.forward_hidden(ids, None)
    assert mx.array_equal(m.graph.project_logits(hidden, "all"), m.model(ids)).item()


@pytest.mark.parametrize("name", [n for n in NAMES if FAMILIES[n].batched is None])
def test_the_rows_engine_computes_the_models_logits(family_model, name):
    """The rows engine's arithmetic (invariant and block) is the model's, to rounding:
    nothing a family does in its layers (sinks, no-RoPE layers, multipliers) is lost."""
    from mlx_tandem.engine.runner import ModelRunner

    m = family_model(name)
    ids = [5, 17, 99, 3, 250, 42, 42, 7] * 3
    reference = m.model(mx.array([ids]))
    runner = ModelRunner(m)
    rows = runner.blank_rows(1)
    hidden = runner.forward(rows, mx.array([ids]), [len(ids)])
    assert mx.allclose(runner.logits(hidden, "all"), reference, atol=1e-4).item()
    rows = runner.blank_rows(1)
    last = runner.logits(runner.prefill(rows, ids, 16), "last")
    assert mx.allclose(last, reference[:, -1:], atol=1e-4).item()


@pytest.mark.parametrize("name", NAMES)
def test_batched_equals_alone_or_refused_by_name(family_model, alone, name):
    declared = FAMILIES[name]
    m = family_model(name)
    if declared.batched is not None:
        with pytest.raises(ValueError, match=f"does not support {name}: "):
            EngineCore(m, CFG)
        return
    expected = alone(name)
    assert len({t for tokens in expected for t in tokens}) > 4, "the tiny model is degenerate"
    prompts, params = workload()
    for max_rows, seed in ((16, 1), (2, 2)):
        engine = EngineCore(m, CFG.with_(max_rows=max_rows))
        got = [r.tokens for r in run_with_gaps(engine, prompts, params, seed)]
        assert got == expected, f"max_rows={max_rows}"


@pytest.mark.parametrize("drafter", ["ngram", "self"])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_speculation_equals_plain_or_refused_by_name(family_model, alone, name, drafter):
    declared = FAMILIES[name]
    m = family_model(name)
    if declared.batched is not None:  # neither a target nor a draft model
        with pytest.raises(ValueError, match=f"not supported for {name}: |not support {name}: "):
            EngineCore(m, CFG, drafter=PromptLookupSource() if drafter == "ngram" else
                       DraftModelSource(m))
        return
    source = PromptLookupSource() if drafter == "ngram" else DraftModelSource(m)
    if declared.speculation is not None:
        with pytest.raises(ValueError, match=f"speculative decoding is not supported for {name}: "):
            EngineCore(m, CFG, drafter=source)
        return
    prompts, params = workload()
    engine = EngineCore(m, CFG, drafter=source, depth=FixedDepth(3))
    results = run_with_gaps(engine, prompts, params, 4)
    for r, sp, want in zip(results, params, alone(name), strict=True):
        if sp.greedy:
            assert r.tokens == want
    drafted = engine.stats.drafted.get(engine.drafter.name, 0)
    assert drafted > 0
    if drafter == "self":  # the model drafting for itself is accepted in full (greedy rows)
        assert engine.stats.acceptance(engine.drafter.name) > 0.8


def test_the_declaration_is_checked():
    with pytest.raises(ValueError, match="no state kinds"):
        Family("x", ())
    with pytest.raises(ValueError, match="no attention state but claims the rows engine"):
        Family("x", (families.MAMBA,))
    Family("x", (families.FULL, families.MAMBA))  # hybrids speculate (kv/recurrent.py)
    families.check_engine({"model_type": "not_declared"}, speculative=True)  # structure decides
    families.check_engine({}, speculative=False)
    assert "not_declared" in families.recurrent_refusal({"model_type": "not_declared"})


def test_at_least_eighteen_families_and_their_refusals_name_them():
    assert len(FAMILIES) >= 18
    for name, f in FAMILIES.items():
        assert f.name == name
        for reason in (f.batched_refusal(), f.speculation_refusal()):
            assert reason is None or name in reason


def test_the_docs_table_is_the_declaration():
    assert families.markdown_table() in DOCS.read_text()


@pytest.mark.parametrize("name", [n for n in NAMES if FAMILIES[n].batched is None])
def test_the_rows_engine_runs_every_family_on_quantized_kv(family_model, name):
    """A quantized cache hands the model stand-ins and attends its stored codes: every
    family's attention passes them on untouched (else `attend` refuses by name), and the
    logits stay near the model's (8-bit codes' error only; attending the stand-ins' zeros
    would be ~100% off)."""
    from mlx_tandem.engine.runner import ModelRunner

    m = family_model(name)
    ids = [5, 17, 99, 3, 250, 42, 42, 7] * 3
    reference = m.model(mx.array([ids]))
    runner = ModelRunner(m, kv_codec="turbo-k8v8")
    rows = runner.blank_rows(1)
    last = runner.logits(runner.prefill(rows, ids[:-1], 16), "last")
    step = runner.logits(runner.forward(rows, mx.array([ids[-1:]]), [1]), "last")
    for got, want in ((last, reference[:, -2:-1]), (step, reference[:, -1:])):
        error = mx.linalg.norm(got - want) / mx.linalg.norm(want)
        assert error.item() < 0.1, f"logits {error.item():.0%} off the model's"
