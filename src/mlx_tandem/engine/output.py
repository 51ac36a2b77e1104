"""Per-request output: streaming detokenisation, stop strings, the one finish rule, logprobs.

`TextStream` turns one row's accepted tokens into text deltas that are safe
to emit: never a broken UTF-8 sequence (held back while the detokenizer's text
ends in U+FFFD) and never a prefix of a stop string that may still complete
(held back until it cannot). A stop string cuts the text at its first
occurrence. Every engine (plain, batched, speculative) feeds tokens through
this one object, so they all stop at exactly the same place.

`RowOutput` is the one finish rule, used by the plain path and the rows engine
alike: a stop id ends the row and is not emitted, a stop string cuts the text,
the max_tokens-th token ends it with "length".

Oracle: tests/test_output.py (text equals tokenizer.decode; stop cuts equal
str.find on the full text; held-back text is released on finish; the finish
rule's three endings).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper


class TextStream:
    def __init__(self, tokenizer: TokenizerWrapper, stop: tuple[str, ...] = ()) -> None:
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stop = stop
        self.longest_stop = max((len(s) for s in stop), default=0)
        self.emitted = 0  # characters of detokenizer text already handed out
        self.scanned = 0  # stop strings cannot start before this character
        self.stopped = False
        self.text = ""  # final text once stopped/finished

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
                self.text = text[:cut]
                delta = text[self.emitted : cut]
                self.emitted = cut
                return delta
            self.scanned = max(0, len(text) - self.longest_stop + 1)
        end = len(text)
        if not final:
            end -= self._held_back(text)
        if end <= self.emitted:
            return ""
        delta = text[self.emitted : end]
        self.emitted = end
        if final:
            self.text = text
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
    ) -> None:
        self.text = TextStream(tokenizer, stop)
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

