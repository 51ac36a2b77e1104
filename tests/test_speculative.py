"""Speculative decoding: greedy output token-identical to plain decoding; sampled output
follows the target distribution (chi-square); seeded rows identical alone and batched."""

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_tandem import SamplingParams
from mlx_tandem.drafters.draft_model import DraftModelSource
from mlx_tandem.drafters.prompt_lookup import PromptLookupSource, lookup
from mlx_tandem.engine import verify as verify_module
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import AdaptiveDepth, FixedDepth
from mlx_tandem.engine.output import RowOutput
from mlx_tandem.engine.request import Request
from mlx_tandem.engine.sampling import RowSampler
from mlx_tandem.models.loader import load_folder
from mlx_tandem.models.tiny import make_tiny_model

from conftest import run_with_gaps

CFG = RuntimeConfig.resolve(environ={}, prefill_chunk=16)


def prompts_and_params(n, seed=0, sampled=True):
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        base = [rng.randrange(3, 250) for _ in range(rng.choice([1, 4, 12, 40]))]
        prompts.append(base + base[:6] * 2)  # repeats give prompt lookup something to find
        if sampled and i % 3 == 1:
            params.append(SamplingParams(max_tokens=rng.randrange(4, 14), temperature=1.0,
                                         top_p=0.9, seed=i))
        else:
            params.append(SamplingParams(max_tokens=rng.randrange(4, 14)))
    return prompts, params


def run(model, prompts, params, drafter=None, depth=None, gaps=True, config=CFG):
    engine = EngineCore(model, config, drafter=drafter, depth=depth)
    return run_with_gaps(engine, prompts, params, len(prompts), gaps), engine


def perturbed(folder, scale=0.05):
    m = load_folder(folder, "perturbed")
    noisy = [(k, v + scale * mx.random.normal(v.shape, key=mx.random.key(i)))
             for i, (k, v) in enumerate(tree_flatten(m.model.parameters()))]
    m.model.update(tree_unflatten(noisy))
    return m


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("target") / "m")
    return folder, load_folder(folder, "target")


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    folder, model = target
    other = load_folder(make_tiny_model("llama", tmp_path_factory.mktemp("d") / "m", seed=7), "other")
    recurrent = load_folder(make_tiny_model("lfm2", tmp_path_factory.mktemp("r") / "m"), "lfm2")
    return {
        "self": lambda: DraftModelSource(model),
        "perturbed": lambda: DraftModelSource(perturbed(folder)),
        "random": lambda: DraftModelSource(other),
        "ngram": PromptLookupSource,
        "recurrent": lambda: DraftModelSource(recurrent),
    }


@pytest.fixture(scope="module")
def plain(target):
    prompts, params = prompts_and_params(16)
    results, _ = run(target[1], prompts, params)
    return prompts, params, [r.tokens for r in results]


@pytest.mark.parametrize("name", ["self", "perturbed", "random", "ngram", "recurrent"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_speculation_equals_plain(target, drafters, plain, name, k):
    prompts, params, expected = plain
    for max_rows in (1, 16) if k == 3 else (16,):
        config = RuntimeConfig.resolve(environ={}, prefill_chunk=16, max_rows=max_rows)
        results, engine = run(target[1], prompts, params, drafters[name](), FixedDepth(k),
                              config=config)
        for r, sp, want in zip(results, params, expected, strict=True):
            if sp.greedy:
                assert r.tokens == want
        if name == "self":  # the target drafting for itself is accepted (greedy rows) in full
            assert engine.stats.acceptance(engine.drafter.name) > 0.8


@pytest.mark.parametrize("name", ["perturbed", "ngram"])
def test_seeded_sampled_rows_identical_alone_and_batched(target, drafters, name):
    prompts, params = prompts_and_params(8, seed=3)
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=30, seed=40 + i)
              for i in range(len(prompts))]
    batched, _ = run(target[1], prompts, params, drafters[name](), FixedDepth(3))
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        alone, _ = run(target[1], [p], [sp], drafters[name](), FixedDepth(3))
        assert alone[0].tokens == batched[i].tokens


def test_seeded_rows_with_a_sampling_drafter_are_identical_alone_and_batched_adaptive(
    target, drafters
):
    """Stochastic drafts keep the rejection rule, so their depth must come from the row's own
    history: with adaptive depth a seeded row's tokens are the same alone and batched."""
    prompts, _ = prompts_and_params(6, seed=8)
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=30, seed=90 + i)
              for i in range(len(prompts))]
    batched, engine = run(target[1], prompts, params, drafters["perturbed"](), AdaptiveDepth(4))
    assert engine.stats.drafted[engine.drafter.name] > 0
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        alone, _ = run(target[1], [p], [sp], drafters["perturbed"](), AdaptiveDepth(4))
        assert alone[0].tokens == batched[i].tokens, i


def test_a_draft_model_prefills_long_prompts_a_chunk_per_unit(target, drafters):
    """Long prompts joining mid-flight: the draft model's own prefill runs a chunk at a time
    inside the engine's prefill units (never the whole prompt at the join), with the chunk
    boundaries a whole-prompt prefill has — greedy == plain, seeded rows alone == batched,
    and the draft rows equal a whole-prompt prefill's bit for bit."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (70, 5, 150, 40, 99)]
    params = [SamplingParams(max_tokens=10) if i % 2 else
              SamplingParams(max_tokens=10, temperature=0.8, top_k=30, seed=i)
              for i in range(len(prompts))]  # fmt: skip
    folder, model = target
    plain, _ = run(model, prompts, params)

    def budgeted() -> tuple[DraftModelSource, list[int]]:
        source, sizes = DraftModelSource(perturbed(folder), chunk=16), []
        prefill = source.runner.prefill

        def recorded(rows, ids, chunk):
            sizes.append(len(ids))
            return prefill(rows, ids, chunk)

        source.runner.prefill = recorded
        return source, sizes

    source, sizes = budgeted()
    got, engine = run(model, prompts, params, source, FixedDepth(3))
    assert max(sizes) <= 16 and len(sizes) > 10, sizes
    for g, p, sp in zip(got, plain, params, strict=True):
        if sp.greedy:
            assert g.tokens == p.tokens
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        alone, _ = run(model, [p], [sp], budgeted()[0], FixedDepth(3))
        assert alone[0].tokens == got[i].tokens, i
    whole = DraftModelSource(perturbed(folder), chunk=16)
    for p in prompts[:3]:  # the spread prefill's row == one whole-prompt prefill's
        request = engine.new_request(p, SamplingParams(max_tokens=1))
        source.prefill(request, len(p))
        source.prefill(request, len(p))
        row, done = request.draft_joining
        if len(p) - 1 > done:
            source.runner.prefill(row, p[done:-1], 16)
        ref = whole.runner.blank_rows(1)
        whole.runner.prefill(ref, p[:-1], 16)
        for a, b in zip(row.arrays(), ref.arrays(), strict=True):
            assert mx.array_equal(a, b).item()


def test_seeded_sampling_with_deterministic_drafts_equals_plain_sampling(target, drafters):
    """Prompt lookup drafts are verified by each position's own keyed sample, so a seeded
    row's tokens are plain sampling's at every depth, fixed or adaptive, alone or batched.
    The plain single-prompt path draws the same way (`keyed_draws`), so on these prompts it
    gives the same tokens too — not on every prompt: its arithmetic differs from the rows
    engine's by rounding, and a draw at a boundary can go the other way (ARCHITECTURE)."""
    from mlx_tandem import generate

    prompts, _ = prompts_and_params(8, seed=5)
    params = [SamplingParams(max_tokens=14, temperature=0.9, top_p=0.95, seed=70 + i)
              for i in range(len(prompts))]
    reference, _ = run(target[1], prompts, params)
    alone = [generate(target[1], p, sp).tokens for p, sp in zip(prompts, params, strict=True)]
    assert alone == [r.tokens for r in reference]
    drafted = 0
    for depth in (FixedDepth(1), FixedDepth(3), FixedDepth(8), AdaptiveDepth(4)):
        got, engine = run(target[1], prompts, params, drafters["ngram"](), depth)
        assert [r.tokens for r in got] == [r.tokens for r in reference], depth.name
        drafted += engine.stats.drafted.get("ngram", 0)
    assert drafted > 0


def test_stop_strings_and_eos_inside_a_block_cut_like_plain(target, drafters, plain):
    model = target[1]
    prompts, _, expected = plain
    stop_ids = (expected[0][3],)
    stop_text = model.tokenizer.decode(expected[1][2:4])
    params = [SamplingParams(max_tokens=14, stop_token_ids=stop_ids, stop=(stop_text,))
              for _ in prompts]
    reference, _ = run(model, prompts, params)
    for name in ("self", "ngram"):
        got, _ = run(model, prompts, params, drafters[name](), FixedDepth(6))
        for r, ref in zip(got, reference, strict=True):
            assert (r.tokens, r.text, r.finish_reason) == (ref.tokens, ref.text, ref.finish_reason)
            assert not set(stop_ids) & set(r.tokens)
            # usage's accepted_prediction_tokens: only the drafts the output took
            assert r.stats.accepted <= r.stats.produced and r.stats.accepted <= r.stats.drafted


def test_adaptive_depth_is_lossless(target, drafters, plain):
    prompts, params, expected = plain
    results, engine = run(target[1], prompts, params, drafters["perturbed"](), AdaptiveDepth(6))
    for r, sp, want in zip(results, params, expected, strict=True):
        if sp.greedy:
            assert r.tokens == want
    assert engine.stats.drafted[engine.drafter.name] > 0


def test_zero_draft_tokens_per_request_turns_speculation_off(target, drafters):
    prompts, _ = prompts_and_params(3, seed=4, sampled=False)
    params = [SamplingParams(max_tokens=10, num_draft_tokens=0),
              SamplingParams(max_tokens=10, num_draft_tokens=0, temperature=1.0, seed=5,
                             ignore_eos=True),
              SamplingParams(max_tokens=10, num_draft_tokens=0)]
    results, engine = run(target[1], prompts, params, drafters["self"](), FixedDepth(4))
    assert engine.stats.drafted.get(engine.drafter.name, 0) == 0
    assert all(r.stats.drafted == 0 and len(r.tokens) == 10 for r in results)
    plain, _ = run(target[1], prompts, params)
    assert [r.tokens for r in results] == [r.tokens for r in plain]


def test_recurrent_target_and_vocab_mismatch_are_refused(tiny_model, target):
    from mlx_tandem.drafters.draft_model import check_compatible

    with pytest.raises(ValueError, match="recurrent"):  # no checkpoints without the rows copy
        EngineCore(tiny_model("lfm2"), CFG.with_(batch_invariant=False),
                   drafter=PromptLookupSource())
    small = tiny_model("llama", vocab_size=100)
    with pytest.raises(ValueError, match="vocabulary"):
        check_compatible(target[1], small)


def test_lookup_finds_the_latest_longest_match():
    t = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert lookup(t, 3, 1, 3) == [7, 8, 5]  # suffix [2, 3] last seen before 7
    assert lookup(np.array([4, 5, 6]), 2, 1, 3) == []
    assert lookup(np.array([1, 2, 1]), 4, 1, 2) == [2, 1]
    assert lookup(t, 0) == []


def _lookup_by_windows(tokens, k, n_min, n_max):
    """The definition, spelled out: every window of n earlier tokens compared with the suffix."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: size - 1], n)
        hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
        if hits.size:
            return tokens[int(hits[-1]) + n : int(hits[-1]) + n + k].tolist()
    return []


def test_lookup_equals_the_window_by_window_search():
    rng = np.random.default_rng(0)
    found = 0
    for trial in range(3000):
        tokens = rng.integers(0, 2 + trial % 7, rng.integers(2, 40))
        n_min = int(rng.integers(1, 4))
        n_max = int(rng.integers(n_min, 5))
        want = _lookup_by_windows(tokens, 4, n_min, n_max)
        assert lookup(tokens, 4, n_min, n_max) == want, (tokens.tolist(), n_min, n_max)
        found += bool(want)
    assert 1000 < found < 2900  # both kinds of rows were tried


# --- the output distribution -------------------------------------------------------------
V, N, PROMPT = 5, 8000, [1, 3, 2]


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _joint_test(model, params, q_table, draws, rng):
    """Sample N three-token continuations through `verify` with drafts from q; return counts."""
    logits_of = {}

    def logits(prefix):
        key = tuple(prefix)
        if key not in logits_of:
            logits_of[key] = np.array(model.model(mx.array([PROMPT + list(prefix)]))[0, -1])
        return logits_of[key]

    requests = []
    for i in range(N):
        seeded = SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=i)
        r = Request(list(PROMPT), seeded, RowSampler(seeded, V), RowOutput(model.tokenizer, (), set(), 3))
        requests.append(r)
    while True:
        live = [r for r in requests if len(r.tokens) < 3]
        if not live:
            break
        drafts, qs, slot_logits = [], [], []
        for r in live:
            k = min(2, 2 - len(r.tokens))
            ctx, d, q_rows = list(r.tokens), [], []
            for _ in range(k):
                q = q_table(ctx + d)
                d.append(int(rng.choice(V, p=q)))
                q_rows.append(q)
            drafts.append(d)
            qs.append(mx.array(np.stack(q_rows)) if d else None)
            slot_logits.append(np.stack([logits(ctx + d[:j]) for j in range(3)]))
        verdicts = verify_module.verify(live, mx.array(np.stack(slot_logits)), drafts, qs)
        for r, v in zip(live, verdicts, strict=True):
            r.tokens += v.tokens[: 3 - len(r.tokens)]
    counts = np.zeros((V, V, V))
    for r in requests:
        counts[tuple(r.tokens)] += 1
    return counts


def _expected(model, params):
    sampler = RowSampler(params, V)

    def p(prefix):
        lg = model.model(mx.array([PROMPT + list(prefix)]))[:, -1]
        lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        return np.array(mx.softmax(sampler.sample_logits(lp), axis=-1)[0])

    probs = np.zeros((V, V, V))
    for a in range(V):
        pa = p([])[a]
        for b in range(V):
            pb = p([a])[b]
            probs[a, b] = pa * pb * p([a, b])
    return probs


def _chi2_pvalue(counts, probs):
    from scipy.stats import chi2

    exp = probs.reshape(-1) * counts.sum()
    obs = counts.reshape(-1)
    big = exp >= 5  # pool sparse cells
    o = np.append(obs[big], obs[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    if e[-1] == 0:
        o, e = o[:-1], e[:-1]
    stat = ((o - e) ** 2 / e).sum()
    return chi2.sf(stat, len(e) - 1)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("v5") / "m", vocab_size=V, seed=3)
    return load_folder(folder, "v5")


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_speculation_matches_the_target_distribution(tiny_vocab, top_p, monkeypatch):
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=3)
    expected = _expected(tiny_vocab, params)
    q_fixed = np.array([0.4, 0.1, 0.2, 0.2, 0.1])  # a draft that disagrees with the target
    counts = _joint_test(tiny_vocab, params, lambda ctx: q_fixed, None, np.random.default_rng(0))
    assert _chi2_pvalue(counts, expected) > 1e-3
    # the same test catches a wrong rule: accepting with probability p(d), ignoring q
    monkeypatch.setattr(verify_module, "accept_draft", lambda u, p_d, q_d: u <= p_d)
    wrong = _joint_test(tiny_vocab, params, lambda ctx: q_fixed, None, np.random.default_rng(0))
    assert _chi2_pvalue(wrong, expected) < 1e-6


def test_deterministic_drafts_take_exactly_the_plain_keyed_sample(tiny_vocab):
    """Per slot, a one-hot draft is accepted iff the position's own keyed sample (the token a
    step without drafts draws there) equals it, and that sample is what is emitted: 400
    seeded rows, drafts with p(d) from ~0.1 to ~0.6."""
    logits = mx.repeat(mx.array([[[2.0, 1.5, 1.0, 0.2, -1.0], [0.1, 0.3, 0.2, 1.9, 0.0]]]), 400, 0)

    def rows(generated):
        out = []
        for s in range(400):
            p = SamplingParams(temperature=1.0, seed=s, max_tokens=4)
            r = Request(list(PROMPT), p, RowSampler(p, V), RowOutput(tiny_vocab.tokenizer, (), set(), 4))
            r.tokens = list(generated)  # the position keys the draw
            out.append(r)
        return out

    drafts = [[s % 3] for s in range(400)]  # d in {0, 1, 2}
    verdicts = verify_module.verify(rows([]), logits, drafts, [None] * 400)
    none = [[]] * 400
    first = verify_module.verify(rows([]), logits[:, :1], none, [None] * 400)
    second = verify_module.verify(rows([0]), logits[:, 1:], none, [None] * 400)
    accepted = 0
    for d, v, a, b in zip(drafts, verdicts, first, second, strict=True):
        if a.tokens[0] == d[0]:
            accepted += 1
            assert (v.accepted, v.tokens) == (1, [d[0], b.tokens[0]])
        else:
            assert (v.accepted, v.tokens) == (0, a.tokens)
    assert 50 < accepted < 350


def test_greedy_picks_are_the_logprobs_argmax_even_when_rounding_ties_them(tiny_vocab, monkeypatch):
    """Greedy rows without processors skip the log-softmax and take the raw argmax, except
    where a rival logit is within TIE_MARGIN: there `x - lse` can round two logits to one
    logprob, and the logprobs' argmax (plain decoding's pick, the first of the tied) wins.
    Slot 0: logits 1.0 at 0 and the next float above it at 5 tie after the subtraction;
    slot 1: a clear top logit at 7. Without the margin the raw pick (5) is taken instead."""
    V = 50_000
    x = np.zeros((1, 2, V), np.float32)
    x[0, 0, 0], x[0, 0, 5] = 1.0, np.nextafter(np.float32(1.0), np.float32(2.0))
    x[0, 1, 7] = 3.0
    logits = mx.array(x)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert mx.argmax(lp, axis=-1).tolist() == [[0, 7]] and mx.argmax(logits, -1).tolist() == [[5, 7]]
    params = SamplingParams(max_tokens=4)
    request = Request(list(PROMPT), params, RowSampler(params, V),
                      RowOutput(tiny_vocab.tokenizer, (), set(), 4))
    (verdict,) = verify_module.verify([request], logits, [[0]], [None])
    assert (verdict.accepted, verdict.tokens) == (1, [0, 7])
    monkeypatch.setattr(verify_module, "TIE_MARGIN", 0.0)
    (raw,) = verify_module.verify([request], logits, [[0]], [None])
    assert raw.tokens == [5]
