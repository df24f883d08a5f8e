"""Incremental detokenisation with stop strings.

Text is decoded over a short sliding window of token ids; a delta is released only
when the window no longer ends in U+FFFD, so a UTF-8 character split across byte-level
tokens is never emitted half-way. The last len(longest stop) - 1 characters are held
back until it is clear they do not begin a stop string, so streamed text always equals
the final text.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens to keep as left context: some tokenizers (SentencePiece) drop a leading
# space when decoding starts mid-sequence.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer  # anything with decode(ids, skip_special_tokens=...)
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all decoded output text
        self.emitted = 0  # characters of self.text already released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_tokens(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Feed new tokens; returns (text to release now, the stop string hit or None).
        After a stop string hit the text is final and ends just before it."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            searched_from = max(len(self.text) - self.hold, 0)
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            hit = self._find_stop(searched_from)
            if hit is not None:
                return self.finish(), hit
        return self._release(len(self.text) - self.hold), None

    def _find_stop(self, start: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def _release(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta

    def finish(self) -> str:
        """Release everything held back; call when the sequence ends."""
        return self._release(len(self.text))
