"""Prompt lookup first, the assistant elsewhere: which rows draft from which source, and lossless.

A tiny llama target with an assistant trained for a few seconds (test_assistant's
`train_tiny`); prompts drawn from ten words recur, so both sources draft in one run.
"""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from test_assistant import engine_run, prompts_of, train_tiny

from mlx_tandem import SamplingParams
from mlx_tandem.drafters.assistant import AssistantSource
from mlx_tandem.drafters.factory import build_drafter
from mlx_tandem.drafters.lookup_first import LookupFirstSource
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import AdaptiveDepth, FixedDepth
from mlx_tandem.engine.draft_source import Drafts
from mlx_tandem.lab.distill import DistillOptions, new_assistant
from mlx_tandem.models.assistant_folder import load_assistant
from mlx_tandem.models.loader import load_folder
from mlx_tandem.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookup_first")
    target = load_folder(make_tiny_model("llama", root / "target"), "target")
    train_tiny(target, root / "assistant")
    return target, root / "assistant"


class Recorded:
    """The composite's choices per step: rows given lookup's tokens, rows given the inner's."""

    def __init__(self, source: LookupFirstSource) -> None:
        self.lookup_rows = self.inner_rows = 0
        draft = source.draft

        def counted(requests, depths, target):
            found = source.lookup.propose(requests, depths)
            self.lookup_rows += sum(bool(f) for f in found)
            self.inner_rows += sum(k > 0 and not f for f, k in zip(found, depths, strict=True))
            return draft(requests, depths, target)

        source.draft = counted


def composite(target, folder, mode="greedy"):
    return LookupFirstSource(AssistantSource(load_assistant(folder), target, mode))


class FakeInner:
    """A stateless drafter proposing 7, 7, ... with a made-up q; records the depths asked."""

    name, samples, stateless = "fake", True, True

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def draft(self, requests, depths, target):
        self.asked.append(list(depths))
        return Drafts([[7] * k for k in depths],
                      [mx.full((k, 9), 1 / 9) if k else None for k in depths])


def test_a_recurring_suffix_drafts_from_lookup_and_others_from_the_inner():
    inner = FakeInner()
    source = LookupFirstSource(inner)
    rows = [
        SimpleNamespace(prompt=[1, 2, 3, 4, 1, 2], tokens=[]),  # "1 2" recurs: lookup says 3 4 1
        SimpleNamespace(prompt=[1, 2, 3], tokens=[4, 5, 3]),  # only "3" recurs: too short
        SimpleNamespace(prompt=[5, 6], tokens=[]),  # nothing recurs
    ]
    drafts = source.draft(rows, [3, 2, 0], target=None)
    assert inner.asked == [[0, 2, 0]]  # the inner drafts only for the rows lookup left
    assert drafts.tokens == [[3, 4, 1], [7, 7], []]
    assert drafts.q[0] is None  # lookup's proposals are deterministic
    assert drafts.q[1] is not None and drafts.q[1].shape == (2, 9)


@pytest.mark.parametrize("k,max_rows", [(3, 16), (3, 1), (6, 16)])
def test_greedy_speculation_equals_plain(pair, k, max_rows):
    target, folder = pair
    prompts = prompts_of(target, 12, seed=20 + k)
    params = [SamplingParams(max_tokens=10 + i % 7) for i in range(len(prompts))]
    plain, _ = engine_run(target, prompts, params, None, None)
    source = composite(target, folder)
    seen = Recorded(source)
    got, engine = engine_run(target, prompts, params, source, FixedDepth(k), max_rows)
    assert got == plain
    assert seen.lookup_rows > 0 and seen.inner_rows > 0  # both sources drafted
    assert 0.2 < engine.stats.acceptance("assistant+ngram") < 1.0  # a real accept/reject mix


class OneHotQ(LookupFirstSource):
    """Negative control: deterministic drafts (lookup's, the greedy assistant's) handed to
    the rejection rule as one-hot q (exact in distribution, not the keyed sample's tokens)."""

    def __init__(self, inner, vocab: int) -> None:
        super().__init__(inner)
        self.vocab = vocab

    def draft(self, requests, depths, target):
        out = super().draft(requests, depths, target)
        q = [mx.eye(self.vocab)[mx.array(t)] if t and q is None else q
             for t, q in zip(out.tokens, out.q, strict=True)]
        return Drafts(out.tokens, q)


@pytest.mark.parametrize("adaptive", [False, True])
def test_seeded_sampling_equals_plain_sampling(pair, adaptive):
    """Greedy inner drafts and lookup's are deterministic: each slot is verified by the
    position's own keyed sample, so a seeded row is plain sampling's, at a fixed depth and
    under adaptive depth. Prompts end in a pair they began with: lookup drafts the first
    step (at a fixed depth; adaptive depth may start plain)."""
    target, folder = pair
    prompts = [p + p[:2] for p in prompts_of(target, 6, seed=26)]
    params = [SamplingParams(max_tokens=14, temperature=0.7, seed=90 + i)
              for i in range(len(prompts))]
    plain, _ = engine_run(target, prompts, params, None, None)
    seen = Recorded(source := composite(target, folder))
    got, engine = engine_run(target, prompts, params, source,
                             AdaptiveDepth(4) if adaptive else FixedDepth(3))
    assert engine.stats.drafted["assistant+ngram"] > 0
    if not adaptive:
        assert seen.lookup_rows > 0 and seen.inner_rows > 0
        control = OneHotQ(AssistantSource(load_assistant(folder), target),
                          target.graph.vocab_size)
        assert engine_run(target, prompts, params, control, FixedDepth(3))[0] != plain
    assert got == plain


def test_seeded_rows_identical_alone_and_batched_in_sampled_mode(pair):
    """Stochastic drafts' tokens depend on who drafted (the rejection rule's draws); the
    source follows the row's own tokens, so a seeded row is the same alone and batched."""
    target, folder = pair
    # each prompt ends in a pair it began with, so lookup drafts the first step (sampled
    # text from this target recurs too rarely for lookup to draft later ones)
    prompts = [p + p[:2] for p in prompts_of(target, 5, seed=27)]
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=30, seed=60 + i)
              for i in range(len(prompts))]

    def source():
        return composite(target, folder, "sample")

    seen = Recorded(batched_source := source())
    batched, _ = engine_run(target, prompts, params, batched_source, FixedDepth(3))
    assert seen.lookup_rows >= len(prompts) and seen.inner_rows > 0
    alone = [engine_run(target, [p], [sp], source(), FixedDepth(3))[0][0]
             for p, sp in zip(prompts, params, strict=True)]
    assert alone == batched


def first_two_tokens(target, source, prompt, n):
    config = RuntimeConfig.resolve(environ={}, prefill_chunk=16, max_rows=500, max_queue=n)
    engine = EngineCore(target, config, drafter=source, depth=FixedDepth(2))
    handles = [engine.submit(prompt, SamplingParams(temperature=1.0, max_tokens=2, seed=s))
               for s in range(n)]
    engine.run_until_idle()
    return [h.result().tokens[:2] for h in handles], engine


def chi_square_p(target, prompt, pairs, V):
    from scipy.stats import chi2

    counts = np.zeros((V, V))
    for a, b in pairs:
        counts[a, b] += 1

    def p(prefix):
        return np.array(mx.softmax(target.model(mx.array([prompt + prefix]))[0, -1]))

    expected = np.array([[p([])[a] * p([a])[b] for b in range(V)] for a in range(V)]) * len(pairs)
    big = expected.reshape(-1) >= 5
    o, e = counts.reshape(-1)[big], expected.reshape(-1)[big]
    return chi2.sf(((o - e) ** 2 / e).sum(), big.sum() - 1)


class InnerQForLookup(LookupFirstSource):
    """Negative control: lookup's tokens verified as if the inner had drawn them from its q."""

    def draft(self, requests, depths, target):
        found = self.lookup.propose(requests, depths)
        inner = self.inner.draft(requests, depths, target)
        return Drafts([f or d for f, d in zip(found, inner.tokens, strict=True)], inner.q)


def test_sampled_mode_keeps_the_target_distribution(tmp_path):
    """Chi-square over the first two tokens of 3,000 seeded rows whose prompt ends in a
    recurring pair, so lookup drafts the first step and the sampled assistant the second.
    Handing lookup's rows the assistant's q instead of none skews it (the control)."""
    V = 5
    target = load_folder(make_tiny_model("llama", tmp_path / "v", vocab_size=V, seed=3), "v5")
    net = new_assistant(target, DistillOptions(layers=1, width=32, intermediate=64),
                        list(range(V)))
    prompt = [1, 3, 2, 4, 1, 3]  # "1 3" recurs: lookup proposes 2, 4
    pairs, engine = first_two_tokens(
        target, LookupFirstSource(AssistantSource(net, target, "sample")), prompt, 3000)
    assert engine.stats.accepted["assistant+ngram"] > 0
    assert chi_square_p(target, prompt, pairs, V) > 1e-3
    wrong, _ = first_two_tokens(
        target, InnerQForLookup(AssistantSource(net, target, "sample")), prompt, 3000)
    assert chi_square_p(target, prompt, wrong, V) < 1e-3


def test_the_factory_builds_it_and_refuses_what_cannot_combine(pair):
    target, folder = pair
    config = RuntimeConfig.resolve(environ={})
    source = build_drafter(f"{folder}+ngram", target, config)
    assert isinstance(source, LookupFirstSource) and source.name == "assistant+ngram"
    assert isinstance(source.inner, AssistantSource) and not source.samples
    assert build_drafter(f"{folder}:sample+ngram", target, config).samples
    for bad in ("+ngram", "ngram+ngram"):
        with pytest.raises(ValueError, match="name a model drafter before"):
            build_drafter(bad, target, config)
    with pytest.raises(ValueError, match="keeps state of its own proposals"):
        build_drafter("target+ngram", target, config)  # the target drafting for itself
