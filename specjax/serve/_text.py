"""Text deltas of a streamed request, until specjax.text.TextDeltas lands (same interface).

The text of a request is what `generate` returns for its tokens: the decoded tokens (special
tokens skipped) cut at the first stop string. A streamed delta must never be taken back, so
`push` holds back the end of the text that could still change: a trailing replacement
character (a multi-byte character split across tokens) and a tail that could be the start of a
stop string (the stop, once complete, cuts the text before it).
"""

from __future__ import annotations

from collections.abc import Sequence

from specjax.speculate.stops import cut_text


class TextDeltas:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text already returned
        self.stopped = False  # a stop string has been seen: nothing more will be returned

    def _text(self) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = cut_text(text, self.stop)
        self.stopped = len(cut) < len(text)
        return cut

    def _held_back(self, text: str) -> int:
        """Characters at the end of text that may still change."""
        held = len(text) - len(text.rstrip("\ufffd"))
        for stop in self.stop:  # the longest tail that begins a stop string
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    held = max(held, n)
                    break
        return held

    def push(self, ids: Sequence[int]) -> str:
        """The new text that `ids`, appended to the tokens so far, make certain."""
        self.tokens += ids
        text = self._text()
        end = len(text) if self.stopped else len(text) - self._held_back(text)
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def finish(self) -> str:
        """The rest of the text, once the request has no more tokens."""
        text = self._text()
        delta = text[self.sent :]
        self.sent = len(text)
        return delta
