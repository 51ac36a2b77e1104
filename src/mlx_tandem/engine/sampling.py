"""Per-row sampling: validated parameters, logits processing and keyed sampling.

One `RowSampler` per request. It turns a row's raw logits into
  * `logprobs`: log-softmax after the logits processors (penalties, bias) —
    what mlx-lm's `generate_step` yields and what logprobs report;
  * `sample_logits`: logprobs after the truncation filters (top-p, min-p,
    top-k, in mlx-lm's order) scaled by 1/temperature — the target
    distribution p that both plain sampling and speculative verification use.
Randomness is keyed by (seed, absolute position, purpose), never a shared
stream, so a seeded row draws the same token alone or in any batch.

Oracle: tests/test_sampling.py (greedy == mlx-lm argmax; processors equal
mlx-lm's; keyed Gumbel-max equals mx.random.categorical with the same key).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

MAX_TOP_LOGPROBS = 20
_MASK64 = (1 << 64) - 1

PURPOSE_SAMPLE = 0
PURPOSE_DRAFT = 1
PURPOSE_ACCEPT = 2


@dataclass(frozen=True)
class SamplingParams:
    """Everything that decides one request's tokens. Validated on construction."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    penalty_context_size: int = 20
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0
    num_draft_tokens: int | None = None  # cap on drafted tokens per step (0: no speculation)
    ignore_eos: bool = False  # generate max_tokens even past EOS (benchmarks)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"invalid {name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not _finite(self.top_p) or not 0.0 <= self.top_p <= 1.0:
            raise bad("top_p", "must be in [0, 1] (0 or 1 disables it)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 disables it)")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty is not None and (
            not _finite(self.repetition_penalty) or self.repetition_penalty <= 0
        ):
            raise bad("repetition_penalty", "must be a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and (not _finite(value) or abs(value) > 2.0):
                raise bad(name, "must be in [-2, 2]")
        for name in ("repetition_context_size", "penalty_context_size", "min_tokens_to_keep"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise bad(name, "must be an integer >= 1")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0 or not _finite(bias):
                raise ValueError(
                    f"invalid logit_bias entry {token!r}: {bias!r}: need token id >= 0, finite bias"
                )
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be token ids >= 0")
        if self.num_draft_tokens is not None and (
            not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 0
        ):
            raise bad("num_draft_tokens", "must be an integer >= 0")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise bad("logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in the request must exist in the model's vocabulary."""
        for token in (*self.logit_bias, *self.stop_token_ids):
            if token >= vocab_size:
                raise ValueError(f"token id {token} is outside the vocabulary (size {vocab_size})")


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
            presence_context_size=params.penalty_context_size,
            frequency_penalty=params.frequency_penalty,
            frequency_context_size=params.penalty_context_size,
        )
        self.history_window = max(params.repetition_context_size, params.penalty_context_size)

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
        """The distribution sampling draws from, as unnormalised logits (temperature > 0)."""
        p = self.params
        if 0.0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p != 0.0:
            logprobs = apply_min_p(logprobs, p.min_p, p.min_tokens_to_keep)
        if 0 < p.top_k < self.vocab_size:
            logprobs = apply_top_k(logprobs, p.top_k)
        return logprobs * (1.0 / p.temperature)

    def sample(self, logprobs: mx.array, position: int) -> mx.array:
        """One token (shape (1,)) for the row at absolute `position` (Gumbel-max, keyed)."""
        if self.params.greedy:
            return mx.argmax(logprobs, axis=-1)
        logits = self.sample_logits(logprobs)
        key = position_key(self.seed, position)
        return mx.random.categorical(logits, key=key)
