"""Grammar-constrained rows (engine/constraint.py): lossless against constrained plain decoding.

Tiny random-weight llama, byte-level tokenizer. Greedy constrained output is the same with
every drafter, at every depth, alone and batched with rows joining mid-flight, and every
finished output validates (jsonschema); seeded sampling with deterministic drafts equals
constrained plain sampling. Negative controls: without the masks the outputs break the
schema; the chi-square test of the target's constrained distribution rejects a cut that
drops the first refused stochastic draft. Bad grammars are refused by name, queue untouched.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import random

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from test_speculative import PROMPT, V, _chi2_pvalue, perturbed

from mlx_tandem import SamplingParams
from mlx_tandem.drafters.draft_model import DraftModelSource
from mlx_tandem.drafters.prompt_lookup import PromptLookupSource
from mlx_tandem.engine import constraint as constraint_module
from mlx_tandem.engine import core as core_module
from mlx_tandem.engine import verify as verify_module
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.constraint import RowGrammar, grammar_masks, json_schema_grammar
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import FixedDepth
from mlx_tandem.engine.output import RowOutput
from mlx_tandem.engine.request import Request
from mlx_tandem.engine.sampling import Grammar, InvalidParameter, RowSampler
from mlx_tandem.lab.schemas import random_schemas
from mlx_tandem.models.loader import load_folder
from mlx_tandem.models.tiny import make_tiny_model

from conftest import run_with_gaps

CFG = RuntimeConfig.resolve(environ={}, prefill_chunk=16)
SCHEMAS = random_schemas(6, seed=1, floats=False)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("target") / "m")
    return folder, load_folder(folder, "target")


def requests(model, n: int, seed: int = 0, sampled: bool = False):
    """n prompts; every other row constrained (a schema, a regex), the rest free."""
    rng = random.Random(seed)
    prompts, params, schemas = [], [], []
    for i in range(n):
        base = [rng.randrange(3, 250) for _ in range(rng.choice([2, 9, 30]))]
        prompts.append(base + base[:5] * 2)
        schema = [PERSON, *SCHEMAS][i % (len(SCHEMAS) + 1)]
        grammar = None
        if i % 2 == 0:
            grammar = json_schema_grammar(schema)
        elif i % 4 == 1:
            grammar = Grammar("regex", r"(ab|cd){2,5}[xyz]!")
        extra = {"temperature": 1.0, "seed": i} if sampled and i % 3 == 0 else {}
        params.append(SamplingParams(max_tokens=400, grammar=grammar, **extra))
        schemas.append(schema if i % 2 == 0 else None)
    return prompts, params, schemas


def run(model, prompts, params, drafter=None, k=3, gaps=True):
    engine = EngineCore(model, CFG, drafter=drafter, depth=FixedDepth(k))
    return run_with_gaps(engine, prompts, params, 7, gaps)


def check_outputs(results, params, schemas) -> None:
    for r, p, schema in zip(results, params, schemas, strict=True):
        if p.grammar is None or (not p.greedy and r.finish_reason == "length"):
            continue  # a sampled random-weight row may still be inside a string at max_tokens
        assert r.finish_reason == "stop", (r.finish_reason, r.text)
        if schema is not None:
            jsonschema.validate(json.loads(r.text), schema)
        else:
            assert r.text.endswith("!") and r.text[-2] in "xyz", r.text


@pytest.fixture(scope="module")
def plain(target):
    """Each request alone with num_draft_tokens 0: constrained plain decoding, no proposals
    at all (not even the grammar's forced tokens)."""
    prompts, params, schemas = requests(target[1], 8)
    alone = [run(target[1], [p], [dataclasses.replace(sp, num_draft_tokens=0)], gaps=False)[0]
             for p, sp in zip(prompts, params, strict=True)]  # fmt: skip
    return prompts, params, schemas, alone


def test_constrained_greedy_outputs_validate_and_batched_equals_alone(target, plain):
    prompts, params, schemas, alone = plain
    check_outputs(alone, params, schemas)
    batched = run(target[1], prompts, params)
    assert [r.tokens for r in batched] == [r.tokens for r in alone]


def test_grammar_forced_tokens_are_proposed_and_accepted(target, plain):
    """Within the policy's depth the engine proposes the tokens the grammar forces (JSON
    keys, punctuation) in place of prompt lookup's; the output is unchanged and most of
    them are accepted. A draft model's proposals are never replaced (its rows hold them)."""
    prompts, params, _, alone = plain
    engine = EngineCore(target[1], CFG, drafter=PromptLookupSource(), depth=FixedDepth(4))
    got = run_with_gaps(engine, prompts, params, 3)
    assert [r.tokens for r in got] == [r.tokens for r in alone]
    assert engine.stats.drafted["grammar"] > 50
    assert engine.stats.acceptance("grammar") > 0.8
    model = target[1]
    drafted = EngineCore(model, CFG, drafter=DraftModelSource(model), depth=FixedDepth(4))
    run_with_gaps(drafted, prompts[:4], params[:4], 3)
    assert "grammar" not in drafted.stats.drafted


@pytest.mark.parametrize(("name", "k"), [("ngram", 4), ("self", 2), ("self", 6), ("perturbed", 3)])
def test_constrained_greedy_speculation_equals_constrained_plain(target, plain, name, k):
    folder, model = target
    prompts, params, schemas, alone = plain
    drafter = {
        "ngram": PromptLookupSource,
        "self": lambda: DraftModelSource(model),
        "perturbed": lambda: DraftModelSource(perturbed(folder)),
    }[name]()
    got = run(model, prompts, params, drafter, k)
    assert [r.tokens for r in got] == [r.tokens for r in alone]
    check_outputs(got, params, schemas)


def test_self_drafts_are_cut_where_the_grammar_refuses_them(target):
    """The self-draft proposes the unconstrained continuation; the grammar refuses most of
    it, so fewer tokens are verified than drafted, and the output is still exact."""
    model = target[1]
    prompts, params, schemas = requests(model, 4)
    drafter = DraftModelSource(model)
    engine = EngineCore(model, CFG, drafter=drafter, depth=FixedDepth(4))
    proposed = []
    original = drafter.draft

    def spy(*args):
        drafts = original(*args)
        proposed.append(sum(len(d) for d in drafts.tokens))
        return drafts

    drafter.draft = spy
    results = run_with_gaps(engine, prompts, params, 0, False)
    assert engine.stats.drafted[drafter.name] < 0.9 * sum(proposed)
    check_outputs(results, params, schemas)


def test_without_the_masks_outputs_break_the_schema(target, plain, monkeypatch):
    """Negative control: the same run with the verifier's masks removed is not constrained."""
    prompts, params, schemas, _ = plain
    monkeypatch.setattr(core_module, "grammar_masks", lambda *a: None)
    monkeypatch.setattr(constraint_module.RowGrammar, "advance", lambda self, tokens: None)
    got = run(target[1], prompts[:4], params[:4])
    with pytest.raises((AssertionError, json.JSONDecodeError, jsonschema.ValidationError)):
        check_outputs(got, params[:4], schemas[:4])


def test_a_parser_fault_ends_only_its_own_row(target, plain, monkeypatch):
    prompts, params, _, alone = plain
    monkeypatch.setattr(constraint_module.RowGrammar, "advance", lambda self, tokens: "boom")
    got = run(target[1], prompts[:4], params[:4])
    for r, p, ref in zip(got, params[:4], alone[:4], strict=True):
        if p.grammar is None:
            assert r.tokens == ref.tokens
        else:
            assert (r.finish_reason, r.error) == ("error", "grammar: boom")
            assert r.tokens and r.tokens == ref.tokens[: len(r.tokens)]  # ended after one step


def test_seeded_sampling_with_deterministic_drafts_equals_constrained_plain_sampling(target):
    model = target[1]
    prompts, params, schemas = requests(model, 9, seed=2, sampled=True)
    ref = run(model, prompts, params, gaps=False)
    check_outputs(ref, params, schemas)
    got = run(model, prompts, params, PromptLookupSource(), 4)
    assert [r.tokens for r in got] == [r.tokens for r in ref]


def test_seeded_rows_with_stochastic_drafts_are_identical_alone_and_batched(target):
    folder, model = target
    prompts, params, schemas = requests(model, 6, seed=3, sampled=True)
    draft = perturbed(folder)
    batched = run(model, prompts, params, DraftModelSource(draft), 3)
    check_outputs(batched, params, schemas)
    for p, sp, r in zip(prompts, params, batched, strict=True):
        if sp.temperature > 0:
            alone = run(model, [p], [sp], DraftModelSource(draft), 3, gaps=False)[0]
            assert alone.tokens == r.tokens


@pytest.mark.parametrize(
    ("grammar", "words"),
    [
        (Grammar("json_schema", "{not json"), "not JSON"),
        (Grammar("json_schema", "[1, 2]"), "object or a boolean"),
        (Grammar("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}})), "nope"),
        (Grammar("regex", "(ab"), "regex"),
        (Grammar("lark", "start: nothing_defined"), "nothing_defined"),
    ],
)
def test_bad_grammars_are_refused_by_name_before_anything_changes(target, grammar, words):
    engine = EngineCore(target[1], CFG)
    with pytest.raises(InvalidParameter, match=words) as err:
        engine.submit([1, 2, 3], SamplingParams(grammar=grammar))
    assert err.value.field == "grammar"
    assert not engine.busy()
    with pytest.raises(InvalidParameter, match="unknown grammar kind"):
        Grammar("yaml", "a: b")


# --- the target's constrained distribution, exactly (chi-square) -----------------------------

ALLOWED = (0, 2, 3)  # a grammar over the 5-token vocabulary that refuses 1 and 4


class AllowedSetMatcher:
    """llguidance's matcher surface for the language ALLOWED*, on a 5-token vocabulary."""

    def __init__(self) -> None:
        self.count = 0

    def validate_tokens(self, tokens):
        return next((i for i, t in enumerate(tokens) if t not in ALLOWED), len(tokens))

    def consume_token(self, t):
        self.count += t in ALLOWED
        return t in ALLOWED

    def consume_tokens(self, ts):
        return all(self.consume_token(t) for t in ts)

    def rollback(self, n):
        self.count -= n

    def is_stopped(self):
        return False

    def unsafe_compute_mask_ptr(self, ptr, nbytes):
        words = np.ctypeslib.as_array((ctypes.c_int32 * (nbytes // 4)).from_address(ptr))
        words[:] = 0
        words[0] = sum(1 << a for a in ALLOWED)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("v5") / "m", vocab_size=V, seed=3)
    return load_folder(folder, "v5")


def _constrained_joint(model, q_fixed, n, rng):
    """n seeded rows, three tokens each, drafts ~ q_fixed, through cut + masks + verify."""
    cache = {}

    def logits(prefix):
        key = tuple(prefix)
        if key not in cache:
            cache[key] = np.array(model.model(mx.array([PROMPT + list(prefix)]))[0, -1])
        return cache[key]

    rows = []
    for i in range(n):
        p = SamplingParams(temperature=1.0, seed=i)
        r = Request(list(PROMPT), p, RowSampler(p, V), RowOutput(model.tokenizer, (), set(), 3))
        r.grammar = RowGrammar(AllowedSetMatcher(), V)
        rows.append(r)
    while live := [r for r in rows if len(r.tokens) < 3]:
        drafts, qs = [], []
        for r in live:
            d = [int(rng.choice(V, p=q_fixed)) for _ in range(min(2, 2 - len(r.tokens)))]
            keep = r.grammar.cut(d, stochastic=True)
            drafts.append(d[:keep])
            qs.append(mx.array(np.stack([q_fixed] * keep)) if keep else None)
        slot = np.stack([np.stack([logits(r.tokens + d[:j]) for j in range(3)])
                         for r, d in zip(live, drafts, strict=True)])  # fmt: skip
        allowed = grammar_masks([r.grammar for r in live], drafts, 3, V)
        verdicts = verify_module.verify(live, mx.array(slot), drafts, qs, allowed)
        for r, v in zip(live, verdicts, strict=True):
            r.grammar.advance(v.tokens)
            r.tokens += v.tokens[: 3 - len(r.tokens)]
    counts = np.zeros((V, V, V))
    for r in rows:
        counts[tuple(r.tokens)] += 1
    return counts


def _constrained_expected(model):
    mask = np.full(V, -np.inf)
    mask[list(ALLOWED)] = 0.0

    def p(prefix):
        lg = np.array(model.model(mx.array([PROMPT + list(prefix)]))[0, -1]) + mask
        e = np.exp(lg - lg.max())
        return e / e.sum()

    probs = np.zeros((V, V, V))
    for a in range(V):
        for b in range(V):
            probs[a, b] = p([])[a] * p([a])[b] * p([a, b])
    return probs


def test_constrained_stochastic_speculation_matches_the_constrained_target(tiny_vocab, monkeypatch):
    q_fixed = np.array([0.2, 0.3, 0.1, 0.1, 0.3])  # 60% of the drafts are refused tokens
    expected = _constrained_expected(tiny_vocab)
    counts = _constrained_joint(tiny_vocab, q_fixed, 6000, np.random.default_rng(0))
    assert counts[:, [1, 4]].sum() == counts[:, :, [1, 4]].sum() == counts[[1, 4]].sum() == 0
    assert _chi2_pvalue(counts, expected) > 1e-3
    # negative control: cutting the first refused stochastic draft too draws from p, not
    # from the residual, and biases the output
    monkeypatch.setattr(
        constraint_module.RowGrammar, "cut", lambda self, d, stochastic: self.matcher.validate_tokens(d)
    )
    wrong = _constrained_joint(tiny_vocab, q_fixed, 6000, np.random.default_rng(0))
    assert _chi2_pvalue(wrong, expected) < 1e-6
