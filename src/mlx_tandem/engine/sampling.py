"""Per-row sampling: the one declaration of the sampling fields, their validation, keyed sampling.

`SamplingParams` is declared once: each field's `Knob` (dataclass field metadata)
carries its help text, its CLI flag spelling (mlx_lm.generate's), its request field
names (OpenAI's / mlx_lm.server's), its range, and whether `tandem serve` takes it as a
server-wide default. The CLI flags (`cli/options.py`), the server's defaults and the
request schema (`server/schemas.py`) are derived from these knobs. Validation raises
`InvalidParameter` naming the field (the server reports it as OpenAI's `param`).
Values that cannot produce a distribution are refused, never clamped: a temperature in
(0, MIN_SCALE) (1/T overflows float32, every scaled logit becomes -inf) and a
repetition_penalty below MIN_SCALE (positive logits / penalty overflow).

One `RowSampler` per request. It turns a row's raw logits into
  * `logprobs`: log-softmax after the logits processors (penalties, bias) —
    what mlx-lm's `generate_step` yields and what logprobs report;
  * `sample_logits`: logprobs after the truncation filters (top-p — engine/top_p.py,
    mlx-lm's rule without sorting all of V — min-p, top-k, in mlx-lm's order) scaled by
    1/temperature — the target
    distribution p that both plain sampling and speculative verification use.
Randomness is keyed by (seed, absolute position, purpose), never a shared
stream, so a seeded row draws the same token alone or in any batch: a draw is the
inverse CDF of the row's distribution at one uniform taken from its key (`keyed_draws`).

Oracle: tests/test_sampling.py (greedy == mlx-lm argmax; keyed draws follow the
distribution (chi-square), are the same alone and batched, never a zero-weight token, and
equal a float64 inverse CDF at the key's uniform; every knob's bounds refused by
name), tests/test_speculative.py (seeded rows: the plain path == the rows engine).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, make_logits_processors

from mlx_tandem.engine.top_p import top_p_filter
from mlx_tandem.kv.attention import LOG2E, pow2

MAX_TOP_LOGPROBS = 20
_MASK64 = (1 << 64) - 1

PURPOSE_SAMPLE = 0
PURPOSE_DRAFT = 1
PURPOSE_ACCEPT = 2

MIN_SCALE = 1e-6  # smallest positive temperature / repetition_penalty (see the header)
MAX_STOP = 16
MAX_STOP_IDS = 64  # extra end-of-sequence ids one request may name
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1
MAX_DRAFT = 64
MAX_WINDOW = 1 << 20


class InvalidParameter(ValueError):
    """A sampling value outside its declared range; `field` names it (the server's `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Knob:
    """How one SamplingParams field is spelled and bounded everywhere it appears.

    kind: "int" | "float" | "bias" (token id -> bias) | "strings" | "ids" | "bool" | "grammar".
    flags: CLI spelling (mlx_lm.generate's); () = no flag. wire: request field names
    (the first one a request gives wins); () = not a request field. off: a flag or wire
    value meaning "disabled", stored as None. server: `tandem serve` has it as a default.
    """

    help: str
    kind: str = "float"
    flags: tuple[str, ...] = ()
    wire: tuple[str, ...] = ()
    lo: float | None = None
    hi: float | None = None
    min_positive: float | None = None  # a positive value must be at least this
    off: float | None = None
    server: bool = False


def _knob(default: Any = None, *, factory: Any = None, **kw: Any) -> Any:
    meta = {"knob": Knob(**kw)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


GRAMMAR_KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "lark")
MAX_GRAMMAR_CHARS = 1 << 20


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match (engine/constraint.py enforces it).
    kind: json_object | json_schema | regex | lark; source: the schema (JSON text), regex
    or Lark grammar ("" for json_object)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidParameter(
                "grammar", f"unknown grammar kind {self.kind!r}; one of {', '.join(GRAMMAR_KINDS)}"
            )
        if not isinstance(self.source, str) or len(self.source) > MAX_GRAMMAR_CHARS:
            raise InvalidParameter(
                "grammar", f"a grammar's source is a string of at most {MAX_GRAMMAR_CHARS} characters"
            )


@dataclass(frozen=True)
class SamplingParams:
    """Everything that decides one request's tokens. Validated on construction."""

    max_tokens: int = _knob(
        256, kind="int", flags=("--max-tokens", "-m"), wire=("max_tokens",), lo=1, server=True,
        help="maximum number of tokens to generate",
    )  # fmt: skip
    temperature: float = _knob(
        0.0, flags=("--temp",), wire=("temperature",), lo=0.0, hi=100.0,
        min_positive=MIN_SCALE, server=True, help="sampling temperature (0 = greedy)",
    )  # fmt: skip
    top_p: float = _knob(
        1.0, flags=("--top-p",), wire=("top_p",), lo=0.0, hi=1.0, server=True,
        help="nucleus sampling top-p (0 or 1 disables it)",
    )  # fmt: skip
    top_k: int = _knob(
        0, kind="int", flags=("--top-k",), wire=("top_k",), lo=0, server=True,
        help="top-k sampling (0 disables it)",
    )  # fmt: skip
    min_p: float = _knob(
        0.0, flags=("--min-p",), wire=("min_p",), lo=0.0, hi=1.0, server=True,
        help="min-p sampling (0 disables it)",
    )  # fmt: skip
    min_tokens_to_keep: int = _knob(
        1, kind="int", flags=("--min-tokens-to-keep",), lo=1, server=True,
        help="minimum tokens min-p keeps",
    )  # fmt: skip
    repetition_penalty: float | None = _knob(
        None, flags=("--repetition-penalty",), wire=("repetition_penalty",), lo=MIN_SCALE,
        hi=100.0, off=0.0, server=True,
        help="mlx-lm's multiplicative repetition penalty (0 or unset: off)",
    )  # fmt: skip
    repetition_context_size: int = _knob(
        20, kind="int", flags=("--repetition-context-size",), wire=("repetition_context_size",),
        lo=1, hi=MAX_WINDOW, server=True, help="tokens the repetition penalty looks back",
    )  # fmt: skip
    presence_penalty: float | None = _knob(
        None, flags=("--presence-penalty",), wire=("presence_penalty",), lo=-2.0, hi=2.0,
        off=0.0, server=True, help="additive presence penalty in [-2, 2] over the last "
        "presence_context_size tokens, the prompt's included, as mlx-lm counts (0: off)",
    )  # fmt: skip
    frequency_penalty: float | None = _knob(
        None, flags=("--frequency-penalty",), wire=("frequency_penalty",), lo=-2.0, hi=2.0,
        off=0.0, server=True, help="additive frequency penalty in [-2, 2] over the last "
        "frequency_context_size tokens, the prompt's included, as mlx-lm counts (0: off)",
    )  # fmt: skip
    presence_context_size: int = _knob(
        20, kind="int", wire=("presence_context_size",), lo=1, hi=MAX_WINDOW,
        help="tokens the presence penalty looks back (mlx-lm's window: prompt tokens count)",
    )  # fmt: skip
    frequency_context_size: int = _knob(
        20, kind="int", wire=("frequency_context_size",), lo=1, hi=MAX_WINDOW,
        help="tokens the frequency penalty looks back (mlx-lm's window: prompt tokens count)",
    )  # fmt: skip
    logit_bias: dict[int, float] = _knob(  # noqa: RUF009 (a field() with metadata)
        kind="bias", factory=dict, flags=("--logit-bias",), wire=("logit_bias",), lo=-100.0,
        hi=100.0, help="token id -> bias in [-100, 100] (JSON object, e.g. '{\"42\": -100}')",
    )  # fmt: skip
    seed: int | None = _knob(
        None, kind="int", flags=("--seed",), wire=("seed",), lo=MIN_SEED, hi=MAX_SEED,
        help="PRNG seed (choice i of a request uses seed + i)",
    )  # fmt: skip
    stop: tuple[str, ...] = _knob(
        (), kind="strings", flags=("--stop",), wire=("stop",), hi=MAX_STOP,
        help=f"stop string (repeatable; at most {MAX_STOP})",
    )  # fmt: skip
    stop_token_ids: tuple[int, ...] = _knob(
        (), kind="ids", wire=("stop_token_ids",), hi=MAX_STOP_IDS,
        help=f"extra end-of-sequence token ids (at most {MAX_STOP_IDS})",
    )  # fmt: skip
    logprobs: int = _knob(
        0, kind="int", flags=("--logprobs",), lo=0, hi=MAX_TOP_LOGPROBS,
        help="top-N logprobs per token (with --json)",
    )  # fmt: skip
    num_draft_tokens: int | None = _knob(
        None, kind="int", wire=("num_draft_tokens",), lo=0, hi=MAX_DRAFT,
        help="cap on drafted tokens per step; 0 = no speculation",
    )  # fmt: skip
    ignore_eos: bool = _knob(
        False, kind="bool", wire=("ignore_eos",), help="generate max_tokens even past EOS",
    )  # fmt: skip
    grammar: Grammar | None = _knob(  # noqa: RUF009 (a field() with metadata)
        None, kind="grammar", flags=("--json-schema",),
        help="constrain the output to a JSON schema (inline JSON or a file; 'object': any "
        "JSON object); runs on the rows engine",
    )  # fmt: skip

    def __post_init__(self) -> None:
        for name, (k, default) in knobs().items():
            value = getattr(self, name)
            if k.kind in ("strings", "ids") and isinstance(value, list):
                object.__setattr__(self, name, value := tuple(value))
            elif k.off is not None and value == k.off and not isinstance(value, bool):
                object.__setattr__(self, name, value := None)  # "0: off", as flags and fields
            check_value(name, k, value, optional=default is None)
        if self.grammar is not None and self.ignore_eos:  # a complete grammar allows EOS only
            raise InvalidParameter(
                "ignore_eos", "a grammar's reply ends where the grammar completes: ignore_eos "
                "cannot apply to it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in the request must exist in the model's vocabulary."""
        for name in ("logit_bias", "stop_token_ids"):
            bad = next((t for t in getattr(self, name) if t >= vocab_size), None)
            if bad is not None:
                raise InvalidParameter(
                    name, f"{name}: token id {bad} is outside the vocabulary (size {vocab_size})"
                )


_KNOBS: dict[str, tuple[Knob, Any]] = {}


def knobs() -> dict[str, tuple[Knob, Any]]:
    """Field name -> (its Knob, its default), in declaration order."""
    if not _KNOBS:
        for f in dataclasses.fields(SamplingParams):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            _KNOBS[f.name] = (f.metadata["knob"], default)
    return _KNOBS


def range_text(k: Knob) -> str:
    if k.lo is not None and k.hi is not None:
        return f"in [{_number(k.lo)}, {_number(k.hi)}]"
    return f">= {_number(k.lo)}" if k.lo is not None else f"<= {_number(k.hi)}"


def _number(x: float) -> str:
    """A bound as written: integers exactly (a seed's 2^64 - 1), other numbers short."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _in_range(k: Knob, x: float) -> bool:
    return (k.lo is None or x >= k.lo) and (k.hi is None or x <= k.hi)


def bias_from_json(bias: dict[Any, Any]) -> dict[int, float]:
    """A logit_bias object as JSON carries it (the CLI's flag, a request's field): keys are
    decimal token ids, each id once ("5" and "05" are one id), values numbers (a boolean
    is not one). InvalidParameter("logit_bias") otherwise."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not isinstance(key, str) or not key.isascii() or not key.isdigit():
            raise InvalidParameter("logit_bias", f"key {key!r} is not a token id")
        token = int(key)
        if token in out:
            raise InvalidParameter("logit_bias", f"token {token} is named twice")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidParameter(
                "logit_bias", f"the bias of token {token} must be a number, got {value!r}"
            )
        out[token] = float(value)
    return out


def check_value(name: str, k: Knob, value: Any, optional: bool = False) -> None:
    """Raise InvalidParameter(name) unless `value` is a valid value of the field."""

    def bad(why: str) -> InvalidParameter:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:60] + f"... ({len(shown)} characters)"
        return InvalidParameter(name, f"invalid {name}={shown}: {why}")

    if value is None and optional:
        return
    if k.kind == "int":
        if type(value) is not int or not _in_range(k, value):  # bool is not a number here
            raise bad(f"must be an integer {range_text(k)}")
    elif k.kind == "float":
        if not _finite(value) or not _in_range(k, value):
            raise bad(f"must be a finite number {range_text(k)}")
        if k.min_positive is not None and 0 < value < k.min_positive:
            least = "0 or at least" if k.lo == 0 else "at least"
            raise bad(
                f"must be {least} {k.min_positive:g}: a smaller value cannot produce a "
                "sampling distribution in float32"
            )
    elif k.kind == "bias":
        if not isinstance(value, dict):
            raise bad("must map token ids to biases")
        for token, bias in value.items():
            if type(token) is not int or token < 0:
                raise bad(f"key {token!r} is not a token id")
            if not _finite(bias) or not _in_range(k, bias):
                raise bad(f"the bias of token {token} must be a finite number {range_text(k)}")
    elif k.kind == "strings":
        if not isinstance(value, tuple) or any(not isinstance(s, str) or not s for s in value):
            raise bad("stop strings must be non-empty strings")
        if k.hi is not None and len(value) > k.hi:
            raise bad(f"at most {_number(k.hi)} stop strings, got {len(value)}")
    elif k.kind == "ids":
        if not isinstance(value, tuple) or any(type(t) is not int or t < 0 for t in value):
            raise bad("must be token ids >= 0")
        if k.hi is not None and len(value) > k.hi:
            raise bad(f"at most {_number(k.hi)} token ids, got {len(value)}")
    elif k.kind == "bool" and not isinstance(value, bool):
        raise bad("must be true or false")
    elif k.kind == "grammar" and not isinstance(value, Grammar):
        raise bad("must be a Grammar")


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1


def _mix64(x: int) -> int:
    """splitmix64 finaliser: spreads (seed, position, purpose) over the key space."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_key(seed: int, position: int, purpose: int = PURPOSE_SAMPLE) -> mx.array:
    """The PRNG key for one row's draw at an absolute position, for one purpose."""
    return mx.random.key(_mix64(_mix64(seed & _MASK64) ^ (position << 2 | purpose)))


def _mix64_np(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def position_keys(seeds: list[int], positions: np.ndarray, purpose: int) -> mx.array:
    """Keys (n, S, 2) for rows' draws at positions (n, S): `position_key` for many at once."""
    with np.errstate(over="ignore"):
        base = _mix64_np(np.array([s & _MASK64 for s in seeds], dtype=np.uint64))[:, None]
        mixed = _mix64_np(
            base ^ ((positions.astype(np.uint64) << np.uint64(2)) | np.uint64(purpose))
        )
    words = np.stack([mixed >> np.uint64(32), mixed & np.uint64(0xFFFFFFFF)], axis=-1)
    return mx.array(words.astype(np.uint32))


def key_uniforms(keys: mx.array) -> mx.array:
    """One uniform in (0, 1) per key (n, 2) -> (n,): the high word's top 23 bits, centred in
    their interval — exact in float32, never 0, at most 1 - 2^-24."""
    return ((keys[:, 0] >> 9).astype(mx.float32) + 0.5) * 2.0**-23


@mx.compile
def softmax_weights(logits: mx.array) -> mx.array:
    """exp(logits - the row's max) (n, V) in float32, exp as the rows softmax's `pow2`
    (MLX's CPU `exp` is scalar: ~11 ns an element); exactly 0 below 2^-126 of the row's top
    (a -inf logit, a filtered token)."""
    y = (logits.astype(mx.float32) - mx.max(logits, axis=-1, keepdims=True)) * LOG2E
    return mx.where(y < -126.0, 0.0, pow2(mx.maximum(y, -126.0)))


@mx.compile
def _inverse_cdf(u: mx.array, weights: mx.array) -> mx.array:
    # u <= 1 - 2^-24 makes u * total round below total: some running sum exceeds the target,
    # and the first that does ends a token of positive weight (the sums only grow)
    sums = mx.cumsum(weights, axis=-1)
    return (sums <= u[:, None] * sums[:, -1:]).sum(axis=-1).astype(mx.uint32)


def keyed_picks(keys: mx.array, weights: mx.array) -> mx.array:
    """One token per row drawn in proportion to its weights (n, V) >= 0, a row's uniform
    from its own key (n, 2) -> (n,) uint32: the first token whose running sum of weights
    exceeds uniform x the row's total (the inverse CDF). Each row's running sums are its
    own, so a row draws the same token alone or in any batch; a token's chance is its
    weight to within float32 rounding of the running sums (2^-24 of the total)."""
    return _inverse_cdf(key_uniforms(keys), weights)


def keyed_draws(keys: mx.array, logits: mx.array) -> mx.array:
    """One categorical draw per row from softmax(logits), keyed (n, 2) -> (n,) uint32: the
    one draw of plain sampling, verification and sampled drafting. Shifting a row's logits
    by a constant changes its draw only where rounding moves a running sum across the
    target. One uniform per row (no noise over the vocabulary: a keyed Gumbel draw took
    ~0.6 ms a row here)."""
    return keyed_picks(keys, softmax_weights(logits))


class RowSampler:
    """Owns one request's processors and sampling settings (arrays are (1, V))."""

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        params.check_vocab(vocab_size)
        self.params = params
        self.vocab_size = vocab_size
        self.seed = params.seed if params.seed is not None else fresh_seed()
        self.processors = make_logits_processors(
            logit_bias=params.logit_bias or None,
            repetition_penalty=params.repetition_penalty,
            repetition_context_size=params.repetition_context_size,
            presence_penalty=params.presence_penalty,
            presence_context_size=params.presence_context_size,
            frequency_penalty=params.frequency_penalty,
            frequency_context_size=params.frequency_context_size,
        )
        self.history_window = max(params.repetition_context_size, params.presence_context_size,
                                  params.frequency_context_size)

    @property
    def filter_key(self) -> tuple:
        """Rows with equal keys build their sampling distribution with the same ops."""
        p = self.params
        return (p.temperature, p.top_p, p.min_p, p.min_tokens_to_keep, p.top_k)

    @property
    def needs_history(self) -> bool:
        return bool(self.processors)

    def logprobs(self, logits: mx.array, history: mx.array | None) -> mx.array:
        """Processors on the token history (uint32 ids, oldest first), then log-softmax."""
        if self.processors and history is not None and history.size > 0:
            tokens = history[-self.history_window :]
            for processor in self.processors:
                logits = processor(tokens, logits)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def sample_logits(self, logprobs: mx.array) -> mx.array:
        """The distribution sampling draws from, as unnormalised logits (temperature > 0).
        `logprobs` may be any per-row shift of them whose top is at most 0: the filters and
        the draw are shift-invariant (the rows engine passes unprocessed rows' logits minus
        their max, sparing the log-softmax's pass of `exp` over the vocabulary)."""
        p = self.params
        if 0.0 < p.top_p < 1.0:
            logprobs = top_p_filter(logprobs, p.top_p)
        if p.min_p != 0.0:
            logprobs = apply_min_p(logprobs, p.min_p, p.min_tokens_to_keep)
        if 0 < p.top_k < self.vocab_size:
            logprobs = apply_top_k(logprobs, p.top_k)
        return logprobs * (1.0 / p.temperature)

    def sample(self, logprobs: mx.array, position: int) -> mx.array:
        """One token (shape (1,)) for the row at absolute `position` (Gumbel-max, keyed)."""
        if self.params.greedy:
            return mx.argmax(logprobs, axis=-1)
        logits = self.sample_logits(logprobs).reshape(1, -1)
        return keyed_draws(position_key(self.seed, position)[None], logits)
