"""Hybrid and recurrent targets speculate exactly (kv/recurrent.py): a verify block runs each
recurrent layer one token at a time and every row resumes from the checkpoint after its own
last accepted token, so greedy speculation == plain decoding and seeded sampled rows are the
same alone and batched; without the per-token restore it is not."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_tandem import SamplingParams
from mlx_tandem.cli.main import main
from mlx_tandem.drafters.draft_model import DraftModelSource
from mlx_tandem.drafters.prompt_lookup import PromptLookupSource
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import FixedDepth
from mlx_tandem.kv import state_rows
from mlx_tandem.models.loader import LoadedModel, load_folder
from mlx_tandem.models.tiny import FAMILY_OVERRIDES, make_tiny_model

from conftest import run_with_gaps

HYBRID = ("qwen3_5", "qwen3_next", "lfm2", "nemotron_h", "falcon_h1")
CFG = RuntimeConfig.resolve(environ={}, prefill_chunk=16)


def workload(seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Eight greedy rows: short and chunked prompts with repeats, different lengths."""
    rng = random.Random(seed)
    prompts, params = [], []
    for n in (1, 3, 5, 7, 9, 12, 14, 24):
        base = [rng.randrange(3, 250) for _ in range(n)]
        prompts.append(base + base[:5] * 2)
        params.append(SamplingParams(max_tokens=rng.randrange(5, 11)))
    return prompts, params


def run(model: LoadedModel, prompts, params, drafter=None, depth: int = 3, rows: int = 16,
        seed: int = 1):  # fmt: skip
    engine = EngineCore(model, CFG.with_(max_rows=rows), drafter=drafter,
                        depth=FixedDepth(depth) if drafter else None)  # fmt: skip
    return [r.tokens for r in run_with_gaps(engine, prompts, params, seed)], engine


def perturbed(model: LoadedModel, scale: float = 0.3) -> LoadedModel:
    """The same model with noisy weights: a recurrent draft model that is often rejected."""
    m = load_folder(model.path, "perturbed")
    noisy = [(k, v + scale * v.std() * mx.random.normal(v.shape, key=mx.random.key(i)))
             for i, (k, v) in enumerate(tree_flatten(m.model.parameters()))]  # fmt: skip
    m.model.update(tree_unflatten(noisy))
    return m


@pytest.fixture(scope="module")
def hybrid(tiny_model):
    """Per family: the model, a perturbed copy, and plain decoding of the workload."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            m = tiny_model(name, **FAMILY_OVERRIDES.get(name, {}))
            prompts, params = workload()
            plain, _ = run(m, prompts, params)
            assert len({t for row in plain for t in row}) > 6, "the tiny model is degenerate"
            cache[name] = (m, perturbed(m), plain)
        return cache[name]

    return get


def drafter(kind: str, model: LoadedModel, other: LoadedModel):
    if kind == "ngram":
        return PromptLookupSource()
    return DraftModelSource(model if kind == "self" else other)


@pytest.mark.parametrize("kind", ["ngram", "self", "perturbed"])
@pytest.mark.parametrize("name", HYBRID)
def test_greedy_speculation_equals_plain(hybrid, name, kind):
    """B = 1..8 rows at a time, every depth 1..6, rows joining and leaving mid-flight."""
    m, other, plain = hybrid(name)
    prompts, params = workload()
    drafted = accepted = 0
    for rows, depth in ((1, 1), (2, 3), (3, 5), (5, 2), (6, 4), (8, 6)):
        got, engine = run(m, prompts, params, drafter(kind, m, other), depth, rows, seed=rows)
        assert got == plain, f"{name} {kind}: B={rows} depth={depth}"
        drafted += engine.stats.drafted.get(engine.drafter.name, 0)
        accepted += engine.stats.accepted.get(engine.drafter.name, 0)
    assert drafted > 0
    if kind == "self":  # the model drafting for itself is accepted in full
        assert accepted == drafted
    if kind == "perturbed":  # partial acceptance: rows rewind to inner checkpoints
        assert 0 < accepted < drafted


@pytest.mark.parametrize("kind", ["ngram", "perturbed"])
@pytest.mark.parametrize("name", HYBRID)
def test_seeded_sampled_rows_alone_equal_batched(hybrid, name, kind):
    m, other, _ = hybrid(name)
    prompts, _ = workload(seed=5)
    prompts = prompts[1::2]
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_k=40, seed=60 + i)
              for i in range(len(prompts))]  # fmt: skip
    batched, _ = run(m, prompts, params, drafter(kind, m, other), 4)
    if kind == "ngram":  # deterministic drafts: token-identical to sampling without drafts
        assert batched == run(m, prompts, params)[0]
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        alone, _ = run(m, [p], [sp], drafter(kind, m, other), 4)
        assert alone[0] == batched[i], f"{name} {kind} row {i}"


@pytest.mark.parametrize("name", HYBRID)
def test_without_the_per_token_restore_speculation_is_not_exact(hybrid, name, monkeypatch):
    """Negative control: rows that keep the state after the whole verify block diverge."""
    m, other, plain = hybrid(name)
    prompts, params = workload()
    monkeypatch.setattr(state_rows, "rewind", lambda cache, drop: None)
    got, _ = run(m, prompts, params, drafter("perturbed", m, other), 4)
    assert got != plain


def test_the_recurrent_refusal_remains_for_layers_without_checkpoints(hybrid):
    """Without the rows engine's model copy (no batch invariance) nothing keeps checkpoints."""
    m, _, _ = hybrid("lfm2")
    with pytest.raises(ValueError, match="cannot rewind rejected drafts"):
        EngineCore(m, CFG.with_(batch_invariant=False), drafter=PromptLookupSource())


def test_tandem_generate_with_ngram_on_a_saved_qwen3_5_folder(tmp_path, capsys):
    """A qwen3_5 folder written by mlx-lm's own save: `tandem generate --draft-model ngram`
    prints the rows engine's plain tokens."""
    from mlx_lm.utils import load as mlx_lm_load
    from mlx_lm.utils import save as mlx_lm_save

    src = make_tiny_model("qwen3_5", tmp_path / "src")
    model, tokenizer, config = mlx_lm_load(str(src), return_config=True)
    mlx_lm_save(tmp_path / "saved", src, model, tokenizer, config)
    prompt = "abcabcabcabcabcabc"
    argv = ["generate", "--model", str(tmp_path / "saved"), "--prompt", prompt,
            "--ignore-chat-template", "--max-tokens", "12", "--json"]  # fmt: skip

    def tokens(*extra: str) -> dict:
        assert main([*argv, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    plain = tokens("--engine", "rows")
    spec = tokens("--draft-model", "ngram", "--num-draft-tokens", "4")
    assert spec["tokens"] == plain["tokens"] and len(plain["tokens"]) == 12
    assert spec["text"] == plain["text"]


@pytest.mark.parametrize("name", ["lfm2", "falcon_h1"])
def test_ragged_prefill_without_batch_invariance_still_runs(hybrid, name):
    """Prompts prefilled together trim their padding from attention ends only: the recurrent
    layers (masked) are never asked to rewind, wrapped or not."""
    m, _, _ = hybrid(name)
    prompts, _ = workload()
    params = [SamplingParams(max_tokens=5, ignore_eos=True) for _ in range(4)]
    engine = EngineCore(m, CFG.with_(batch_invariant=False))
    results = run_with_gaps(engine, prompts[:4], params, 3)
    assert [len(r.tokens) for r in results] == [5] * 4
