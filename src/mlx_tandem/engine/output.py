"""Per-request output: streaming detokenisation, stop strings, the one finish rule, logprobs.

`TextStream` turns one row's accepted tokens into text deltas that are safe
to emit: never a broken UTF-8 sequence (held back while the detokenizer's text
ends in U+FFFD) and never a prefix of a stop string that may still complete
(held back until it cannot). A stop string cuts the text at its first
occurrence. Every engine (plain, batched, speculative) feeds tokens through
this one object, so they all stop at exactly the same place. The text is the
continuation of the prompt: the detokenizer first reads the prompt's last
tokens (`context`), so a first token's leading space stays (mlx-lm's streaming
detokenizers drop it when their text is still empty: "is" + "Paris").

`TokenBytes` gives each token's own bytes (a byte-level or byte-fallback piece
may hold part of a UTF-8 character), for logprobs' `bytes`; `TextOffsets` where
each token starts in the text.

`RowOutput` is the one finish rule, used by the plain path and the rows engine
alike: a stop id ends the row and is not emitted, a stop string cuts the text,
the max_tokens-th token ends it with "length".

Oracle: tests/test_output.py (text equals tokenizer.decode; a continuation's
text equals decode(prompt + output) minus decode(prompt); stop cuts equal
str.find on the full text; held-back text is released on finish; the finish
rule's three endings; token bytes join to the text's bytes).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
    _byte_decoder,  # the table BPEStreamingDetokenizer decodes with (mlx-lm pinned)
)

CONTEXT_TOKENS = 4  # prompt tokens the detokenizer reads before a row's output


class TextStream:
    def __init__(
        self, tokenizer: TokenizerWrapper, stop: tuple[str, ...] = (), context: Sequence[int] = ()
    ) -> None:
        """`context`: the tokens just before the output (the prompt's last ones), read first
        and never emitted: the output's text is their continuation."""
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        for token in context[-CONTEXT_TOKENS:]:
            self.detokenizer.add_token(token)
        if context:
            self.detokenizer.finalize()  # a held trailing space belongs to the prompt
        self.base = len(self.detokenizer.text)  # characters of context
        self.stop = stop
        self.longest_stop = max((len(s) for s in stop), default=0)
        self.emitted = self.base  # characters of detokenizer text already handed out
        self.scanned = self.base  # stop strings cannot start before this character
        self.stopped = False

    def add(self, token: int) -> str:
        """Feed one token; return the text that may be emitted now. Sets `stopped`."""
        assert not self.stopped, "token fed after a stop string ended the row"
        self.detokenizer.add_token(token)
        return self._release(self.detokenizer.text, final=False)

    def finish(self) -> str:
        """Flush what was held back (end of row); return the remaining text."""
        if self.stopped:
            return ""
        self.detokenizer.finalize()
        return self._release(self.detokenizer.text, final=True)

    def _release(self, text: str, final: bool) -> str:
        if self.stop:
            cut = min(
                (i for i in (text.find(s, self.scanned) for s in self.stop) if i >= 0),
                default=-1,
            )
            if cut >= 0:
                self.stopped = True
                delta = text[self.emitted : cut]
                self.emitted = cut
                return delta
            self.scanned = max(self.base, len(text) - self.longest_stop + 1)
        end = len(text)
        if not final:
            end -= self._held_back(text)
        if end <= self.emitted:
            return ""
        delta = text[self.emitted : end]
        self.emitted = end
        return delta

    def _held_back(self, text: str) -> int:
        """Characters at the end that must wait: a possible stop prefix, or broken UTF-8."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        if text.endswith("\ufffd"):
            hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
        return hold


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def top_logprobs(logprobs: mx.array, token: int, n: int) -> TokenLogprob:
    """The chosen token's logprob and the n most likely tokens, from processed logprobs (1, V)."""
    row = logprobs.reshape(-1)
    info = TokenLogprob(token=token, logprob=row[token].item())
    if n > 0:
        top = mx.argpartition(-row, kth=n - 1)[:n]
        values = row[top]
        order = mx.argsort(-values)
        info.top = list(zip(top[order].tolist(), values[order].tolist(), strict=True))
    return info


class RowOutput:
    """One row's finish rule: feed tokens in order; each returns the text it releases."""

    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        stop: tuple[str, ...],
        stop_ids: set[int],
        max_tokens: int,
        context: Sequence[int] = (),
    ) -> None:
        """`context`: the prompt (its last tokens are read first: see TextStream)."""
        self.text = TextStream(tokenizer, stop, context)
        self.stop_ids = stop_ids
        self.max_tokens = max_tokens
        self.count = 0  # tokens emitted
        self.finish_reason: str | None = None  # "stop" | "length" once the row has ended

    def add(self, token: int) -> tuple[str, bool]:
        """(text released, whether `token` is part of the output); sets finish_reason."""
        assert self.finish_reason is None, "token fed after the row finished"
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return self.text.finish(), False
        self.count += 1
        delta = self.text.add(token)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif self.count == self.max_tokens:
            self.finish_reason = "length"
            delta += self.text.finish()
        return delta, True


class TokenBytes:
    """Each token's own bytes: what it adds to the text, which for a byte-level (BPE) or
    byte-fallback (SentencePiece) piece may be part of a UTF-8 character. Read from the
    tokenizer's streaming detokenizer's piece table; other tokenizers decode the token
    alone. Cached per token."""

    def __init__(self, tokenizer: TokenizerWrapper) -> None:
        self.tokenizer = tokenizer
        detokenizer = tokenizer.detokenizer
        known = isinstance(detokenizer, (BPEStreamingDetokenizer, SPMStreamingDetokenizer))
        self.pieces: list | None = detokenizer.tokenmap if known else None
        self.byte_level = isinstance(detokenizer, BPEStreamingDetokenizer)
        self.cache: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        out = self.cache.get(token)
        if out is None:
            out = self.cache[token] = self._bytes(token)
        return out

    def _bytes(self, token: int) -> bytes:
        if self.pieces is None or token >= len(self.pieces):
            return self.tokenizer.decode([token]).encode("utf-8")
        piece = self.pieces[token]
        if self.byte_level:  # GPT-2's printable stand-ins for bytes (the BPE detokenizer's
            table = _byte_decoder()  # own table); other characters as they are
            return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in piece)
        return piece.replace("\u2581".encode(), b" ")  # SentencePiece: bytes, U+2581 a space


class TextOffsets:
    """Character offsets of a row's tokens in its text, fed in order (a streamed row chunk
    by chunk): a token starts after the characters that the bytes before it complete (a
    character split across tokens belongs to the token that completes it)."""

    def __init__(self, token_bytes: TokenBytes, start: int = 0) -> None:
        self.token_bytes, self.chars = token_bytes, start
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def of(self, tokens: Sequence[int]) -> list[int]:
        out = []
        for token in tokens:
            out.append(self.chars)
            self.chars += len(self.decoder.decode(self.token_bytes(token)))
        return out
