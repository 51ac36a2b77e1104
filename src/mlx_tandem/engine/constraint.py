"""Grammar-constrained rows: which tokens a row may emit next, through llguidance.

A request may carry a `Grammar` (a JSON schema, any JSON object, a regex or a Lark
grammar). `GrammarCompiler` (one per engine; it wraps the model's tokenizer for
llguidance once, on first use) validates it and gives the request a `RowGrammar`, the
row's parser state, before anything else changes; a bad grammar raises
`InvalidParameter("grammar", ...)` naming the problem.

Each step the engine asks every constrained row for
  * `forced(cap)`: the tokens the grammar forces next (a JSON key, a closing brace). Up
    to the depth the policy chose for the row, the engine proposes them as deterministic
    drafts in place of the drafter's where the drafter keeps no state of its own
    proposals (verified like any draft: lossless);
  * `cut(drafts, stochastic)`: how many proposals to keep. Deterministic drafts are cut
    before the first token the grammar refuses (the target could never emit it, so the
    outcome is unchanged); stochastic drafts keep that first refused token too, so the
    rejection rule still runs there (p = 0 rejects it) and draws the residual — cutting
    it would draw from p instead and bias the output;
  * `masks(drafts)`: the allowed tokens after the committed text and after each prefix
    of its drafts — (k+1) bitmasks, the masks plain constrained decoding would apply at
    those positions. The verifier sets every other logit to -inf before anything else
    (processors, log-softmax, filters), so the target's distribution is exactly the one
    plain constrained decoding samples from, and speculation stays lossless against it;
  * `advance(tokens)` after the verdict, with the tokens the row emitted.
When the grammar is complete it allows only end-of-sequence, which ends the row.

Oracle: tests/test_constraint.py (greedy constrained speculative == greedy constrained
plain, batched == alone, every output parses and validates; a verifier without the mask,
and a cut that drops the refused stochastic draft, fail the tests).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy as lnp
import mlx.core as mx
import numpy as np

from mlx_tandem.engine.sampling import Grammar, InvalidParameter

# How JSON is laid out: `{"a": 1, "b": [2, 3]}`, as chat models write it, never free
# whitespace (small models given free whitespace can loop on newlines forever). A fixed
# layout also forces more tokens (a required key with its quotes and colon).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Tool-call arguments: any one-space layout, since models write their calls compactly too.
TOOL_JSON_LAYOUT = {"whitespace_flexible": True, "whitespace_pattern": " ?"}


def json_schema_grammar(schema: dict[str, Any] | bool) -> Grammar:
    return Grammar("json_schema", json.dumps(schema))


def llguidance_source(grammar: Grammar) -> str:
    """The grammar in llguidance's form; InvalidParameter naming what is wrong with it."""
    schema = _schema(grammar.source) if grammar.kind == "json_schema" else {"type": "object"}
    try:
        if grammar.kind in ("json_object", "json_schema"):
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if grammar.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(grammar.source)
        return llguidance.LLMatcher.grammar_from_lark(grammar.source)
    except (ValueError, TypeError) as err:  # llguidance's own refusals
        raise InvalidParameter("grammar", f"invalid {grammar.kind}: {err}") from None


def _schema(source: str) -> dict[str, Any]:
    """A JSON schema as an object: `true` (any JSON) is the empty schema, `false` matches
    no reply at all."""
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as err:
        raise InvalidParameter("grammar", f"the schema is not JSON: {err}") from None
    if schema is True:
        return {}
    if schema is False:
        raise InvalidParameter("grammar", "the schema is false: no reply can match it")
    if not isinstance(schema, dict):
        raise InvalidParameter("grammar", "a JSON schema is an object or a boolean")
    return schema


class GrammarCompiler:
    """Compiles Grammars for one model's tokenizer (wrapped for llguidance on first use)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def tokenizer(self) -> Any:
        """llguidance's view of the tokenizer (~0.3 s for SmolLM2, ~3 s for Gemma 3's 262k
        tokens), built on first use; `warm()` builds it in the background instead."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self.eos_ids or None
                )
            return self._tokenizer

    def warm(self) -> None:
        """Build the tokenizer on a daemon thread (no MLX there), so that a server's first
        constrained request does not wait for it on the event loop."""
        threading.Thread(target=self.tokenizer, name="grammar-tokenizer", daemon=True).start()

    def compile(self, grammar: Grammar) -> RowGrammar:
        """A fresh parser state for one row; InvalidParameter naming what is wrong."""
        source = llguidance_source(grammar)
        tokenizer = self.tokenizer()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, tokenizer)
        if failed:
            raise InvalidParameter("grammar", f"invalid {grammar.kind}: {messages[0]}")
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0)
        if matcher.is_error():
            raise InvalidParameter(
                "grammar", f"invalid {grammar.kind}: {matcher.get_error()}"
            )
        return RowGrammar(matcher, self.vocab_size)


class RowGrammar:
    """One row's parser state: the committed tokens' prefix of the grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def forced(self, cap: int) -> list[int]:
        """Up to `cap` tokens the grammar forces next (its fast-forward tokens)."""
        return list(self.matcher.compute_ff_tokens()[:cap]) if cap > 0 else []

    def cut(self, drafts: list[int], stochastic: bool) -> int:
        """How many of `drafts` to verify (see the module header)."""
        valid = self.matcher.validate_tokens(drafts) if drafts else 0
        return min(len(drafts), valid + 1) if stochastic else valid

    def masks(self, drafts: list[int]) -> np.ndarray:
        """(len(drafts)+1, words) int32 bitmasks: allowed tokens after each draft prefix.
        A prefix past a refused draft allows everything (its slot is never used)."""
        out = lnp.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        # consume only what the grammar accepts: a refused token leaves llguidance's matcher
        # in an error state for good, which no rollback undoes
        valid = self.matcher.validate_tokens(drafts) if drafts else 0
        for j in range(valid + 1):
            lnp.fill_next_token_bitmask(self.matcher, out, j)
            if j < valid:
                assert self.matcher.consume_token(drafts[j])
        if valid:
            self.matcher.rollback(valid)
        return out

    def advance(self, tokens: list[int]) -> str | None:
        """The row emitted `tokens`, each allowed by the mask it was drawn under. Returns
        the parser's error if it refuses one anyway (a library fault: the row ends with it)."""
        if self.matcher.consume_tokens(tokens):
            return None
        return self.matcher.get_error().split("\n")[0] or "the parser refused a token"

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())


def grammar_masks(
    grammars: list[RowGrammar | None], drafts: list[list[int]], width: int, vocab: int
) -> mx.array | None:
    """(B, width, V) bool: which tokens each row may emit at each verify slot; None when no
    row is constrained. Unconstrained rows (and slots past a row's drafts) allow everything."""
    if all(g is None for g in grammars):
        return None
    words = (vocab + 31) // 32
    bits = np.full((len(grammars), width, words), -1, dtype=np.int32)
    for i, (g, d) in enumerate(zip(grammars, drafts, strict=True)):
        if g is not None:
            rows = g.masks(d)
            bits[i, : rows.shape[0]] = rows
    packed = mx.array(bits.view(np.uint32))  # 32x less to move than a bool per token
    unpacked = (packed[..., None] >> mx.arange(32, dtype=mx.uint32)) & 1  # bit k: token 32w+k
    return unpacked.reshape(*bits.shape[:2], words * 32)[..., :vocab].astype(mx.bool_)
