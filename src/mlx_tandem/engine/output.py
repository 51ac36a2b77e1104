"""Per-request output state: streaming detokenisation, stop strings, finish reasons.

`TextStream` turns one row's accepted tokens into text deltas that are safe
to emit: never a broken UTF-8 sequence (held back while the detokenizer's text
ends in U+FFFD) and never a prefix of a stop string that may still complete
(held back until it cannot). A stop string cuts the text at its first
occurrence. Every engine (plain, batched, speculative) feeds tokens through
this one object, so they all stop at exactly the same place.

Oracle: tests/test_output.py (text equals tokenizer.decode; stop cuts equal
str.find on the full text; held-back text is released on finish).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
