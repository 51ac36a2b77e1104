"""The assistant drafter in the rows engine: lossless, batch-invariant, and wired to the target.

Tiny targets (llama: full attention; gemma3_text: sliding + full layers) get an
assistant trained for a few seconds by the lab, so drafts are mostly accepted
and exactness is tested on real accept/reject mixes, not on all-rejected drafts.
"""

import random

import mlx.core as mx
import numpy as np
import pytest
from test_row_groups import run_cohort

from mlx_tandem import SamplingParams
from mlx_tandem.drafters import assistant as assistant_source
from mlx_tandem.drafters.assistant import AssistantSource
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import AdaptiveDepth, FixedDepth
from mlx_tandem.lab.distill import DistillOptions, distill
from mlx_tandem.lab.train import Batch, Teacher, TrainConfig, target_features, unroll
from mlx_tandem.models import assistant as assistant_model
from mlx_tandem.models.assistant_folder import load_assistant
from mlx_tandem.models.loader import load_folder
from mlx_tandem.models.tiny import make_tiny_model

from conftest import run_with_gaps

WORDS = ["cat", "dog", "sun", "red", "blue", "tree", "go", "stop", "one", "two"]


def word_prompts(n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 24))) for _ in range(n)]


def train_tiny(target, folder, steps=70, layers=2):
    opts = DistillOptions(
        layers=layers, width=64, intermediate=128, vocab=128, max_tokens=40, data_minutes=3,
        train=TrainConfig(minutes=10, max_steps=steps, batch_tokens=512, eval_every_s=1e9,
                          lr=3e-3, warmup=10),
    )
    summary = distill(target, folder, opts, prompts=word_prompts(80, 0), say=lambda s: None)
    return summary


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target = load_folder(make_tiny_model(request.param, root / "target"), "target")
    summary = train_tiny(target, root / "assistant")
    return target, root / "assistant", summary


def engine_run(target, prompts, params, source, depth, max_rows=16, gaps=True):
    config = RuntimeConfig.resolve(environ={}, prefill_chunk=16, max_rows=max_rows)
    engine = EngineCore(target, config, drafter=source, depth=depth)
    results = run_with_gaps(engine, prompts, params, len(prompts), gaps)
    return [r.tokens for r in results], engine


def prompts_of(target, n, seed):
    return [target.encode(p) for p in word_prompts(n, seed)]


def test_training_beats_the_untrained_start(pair):
    _, _, summary = pair
    assert summary["start_step"] == 0
    assert summary["held_out_alpha"][0] > summary["start_alpha"][0] + 0.3


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculation_equals_plain(pair, k):
    target, folder, _ = pair
    prompts = prompts_of(target, 12, seed=k)
    params = [SamplingParams(max_tokens=10 + i % 7) for i in range(len(prompts))]
    plain, _ = engine_run(target, prompts, params, None, None)
    for max_rows in (1, 16) if k == 3 else (16,):
        source = AssistantSource(load_assistant(folder), target)
        got, engine = engine_run(target, prompts, params, source, FixedDepth(k), max_rows)
        assert got == plain
        assert engine.stats.position_acceptance("assistant")[0] > 0.3  # a real accept/reject mix


def test_one_token_prompts_draft_once_the_target_has_fed_them(pair):
    """A cohort of one-token prompts holds no K/V at its first decode step (each prompt is
    its row's pending token): the drafter proposes nothing there instead of failing the step,
    alone and together, and then drafts as usual."""
    target, folder, _ = pair
    prompts = [p[:1] for p in prompts_of(target, 2, seed=9)]
    params = [SamplingParams(max_tokens=12)] * 2
    for max_rows in (1, 2):
        plain, _ = engine_run(target, prompts, params, None, None, max_rows, gaps=False)
        source = AssistantSource(load_assistant(folder), target)
        got, engine = engine_run(target, prompts, params, source, FixedDepth(3), max_rows,
                                 gaps=False)  # fmt: skip
        assert got == plain and engine.stats.drafted["assistant"] > 0


def test_drafting_over_target_rows_kept_in_groups(pair):
    """A long prompt joining short rows puts the target's rows in groups (kv/row_groups.py),
    whose K/V live in the groups: the assistant reads them all and every row's tokens equal
    the row alone, greedy and seeded (the drafter once refused grouped rows as holding no
    K/V, failing the step)."""
    target, folder, _ = pair
    alone, _ = run_cohort(target, together=False, tokens=40)
    source = AssistantSource(load_assistant(folder), target)
    together, groups = run_cohort(target, together=True, drafter=source, tokens=40)
    assert groups >= 2
    assert together == alone


def lab_reference(target, folder, context, drafts):
    """Per draft step, the distribution the lab's training computation (plain target forward,
    fused attention, its own masks and positions) gives `context` fed `drafts` as inputs."""
    net = load_assistant(folder)
    donors = assistant_model.bind_target(net, target.model)
    ids = context + drafts[:-1] + [0]
    batch = Batch(mx.array([ids], dtype=mx.int32), mx.array([[True] * len(ids)]))
    feats = target_features(target, Teacher.of(target, net.draft_vocab), donors, batch)
    logps, _ = unroll(net, target, donors, batch, feats, len(drafts))
    t = len(context) - 2
    out = np.zeros((len(drafts), target.graph.vocab_size), np.float32)
    out[:, np.array(net.draft_vocab)] = np.exp(np.array(mx.stack([lq[0, t] for lq in logps])))
    return out


def engine_drafts_after_some_steps(target, folder):
    """(context, drafts, q) per running row after a few sampled speculative steps."""
    prompts = prompts_of(target, 5, seed=11)
    config = RuntimeConfig.resolve(environ={}, prefill_chunk=16, max_rows=8)
    engine = EngineCore(target, config, AssistantSource(load_assistant(folder), target, "sample"),
                        FixedDepth(3))
    for i, p in enumerate(prompts):
        engine.submit(p, SamplingParams(max_tokens=40 + i, temperature=1.0, seed=i,
                                        ignore_eos=True))
    for _ in range(6):  # rows join, accept some drafts and reject others
        engine.step()
    rows = engine.running
    drafts = engine.drafter.draft(rows, [4] * len(rows), engine.rows)
    return [(r.prompt + r.tokens, d, np.array(q))
            for r, d, q in zip(rows, drafts.tokens, drafts.q, strict=True)]


def test_engine_drafts_equal_the_lab_computation(pair, monkeypatch):
    """Donor layers, per-row masks and ends, the query position and the seed hidden handed
    over by the verify forward: the engine drafts from exactly the distribution the lab
    trains. Reading another target layer's K/V (a wrong donor) breaks the equality."""
    target, folder, _ = pair
    cases = engine_drafts_after_some_steps(target, folder)
    assert len(cases) >= 3
    for context, drafts, q in cases:
        assert np.abs(q - lab_reference(target, folder, context, drafts)).max() < 5e-4

    bind = assistant_model.bind_target

    def wrong_layer(assistant, model):  # layer 0, read as that layer is (its own window)
        window = assistant_model.target_layer_windows(model)[0]
        return [assistant_model.DonorLayer(0, d.rope, d.scale, window)
                for d in bind(assistant, model)]

    monkeypatch.setattr(assistant_source, "bind_target", wrong_layer)
    wrong = engine_drafts_after_some_steps(target, folder)
    assert any(
        np.abs(q - lab_reference(target, folder, c, d)).max() > 2e-3 for c, d, q in wrong
    )


def test_unbound_head_rows_are_refused(pair):
    _, folder, _ = pair
    net = load_assistant(folder)
    with pytest.raises(ValueError, match="not bound"):
        net.head_logits(mx.zeros((1, 1, 64)), mx.zeros((1, 1, 64)))


def test_seeded_rows_identical_alone_and_batched_in_sampled_mode(pair):
    target, folder, _ = pair
    prompts = prompts_of(target, 6, seed=5)
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=30, seed=40 + i)
              for i in range(len(prompts))]
    batched, engine = engine_run(
        target, prompts, params, AssistantSource(load_assistant(folder), target, "sample"),
        AdaptiveDepth(4))
    assert engine.stats.drafted["assistant"] > 0
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        alone, _ = engine_run(target, [p], [sp],
                              AssistantSource(load_assistant(folder), target, "sample"),
                              AdaptiveDepth(4))
        assert alone[0] == batched[i], i


def test_seeded_sampling_with_greedy_drafts_equals_plain_sampling(pair):
    target, folder, _ = pair
    prompts = prompts_of(target, 6, seed=6)
    params = [SamplingParams(max_tokens=14, temperature=0.7, seed=70 + i)
              for i in range(len(prompts))]
    plain, _ = engine_run(target, prompts, params, None, None)
    got, _ = engine_run(target, prompts, params,
                        AssistantSource(load_assistant(folder), target), AdaptiveDepth(4))
    assert got == plain


def test_a_wider_target_is_refused(pair, tmp_path):
    _, folder, _ = pair
    other = load_folder(make_tiny_model("llama", tmp_path / "w", hidden_size=96,
                                        intermediate_size=128), "wide")
    with pytest.raises(ValueError, match="cannot draft"):
        AssistantSource(load_assistant(folder), other)


def test_sampled_drafts_keep_the_target_distribution(tmp_path):
    """Chi-square over the first two tokens of 3,000 seeded rows drafted by an (untrained)
    assistant in sampled mode: the rejection rule with the assistant's q is exact."""
    from scipy.stats import chi2

    V = 5
    target = load_folder(make_tiny_model("llama", tmp_path / "v", vocab_size=V, seed=3), "v5")
    from mlx_tandem.lab.distill import new_assistant

    net = new_assistant(target, DistillOptions(layers=1, width=32, intermediate=64), list(range(V)))
    prompt = [1, 3, 2]
    params = SamplingParams(temperature=1.0, max_tokens=2)
    N = 3000
    source = AssistantSource(net, target, "sample")
    config = RuntimeConfig.resolve(environ={}, prefill_chunk=16, max_rows=500, max_queue=N)
    engine = EngineCore(target, config, drafter=source, depth=FixedDepth(2))
    handles = [engine.submit(prompt, SamplingParams(temperature=1.0, max_tokens=2, seed=s))
               for s in range(N)]
    engine.run_until_idle()
    counts = np.zeros((V, V))
    for h in handles:
        a, b = h.result().tokens[:2]
        counts[a, b] += 1
    assert engine.stats.accepted["assistant"] > 0

    def p(prefix):
        lg = target.model(mx.array([prompt + prefix]))[0, -1]
        return np.array(mx.softmax(lg / params.temperature))

    expected = np.array([[p([])[a] * p([a])[b] for b in range(V)] for a in range(V)]) * N
    big = expected.reshape(-1) >= 5
    o, e = counts.reshape(-1)[big], expected.reshape(-1)[big]
    stat = ((o - e) ** 2 / e).sum()
    assert chi2.sf(stat, big.sum() - 1) > 1e-3
