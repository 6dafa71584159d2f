"""Incremental detokenization with stop strings, for one request."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class TextStream:
    """Turns generated token ids into text, finds stop strings, and holds back text that could
    still become a stop string so a streaming client never sees part of one.

    ``push`` returns the text that is now safe to emit; ``stopped`` tells whether a stop string was
    found (the text then ends right before it); ``flush`` releases the held-back rest at the end:
    without a stop string the whole text then equals ``tokenizer.decode(ids)``, bytes of a character
    the generation stopped inside included (as U+FFFD, as ``transformers`` and vLLM give them).
    Stop strings are looked for only from the ``min_tokens``-th token on (vLLM's ``min_tokens``).
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool, min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._stop = stop
        self._min_tokens = min_tokens
        self._longest_stop = max((len(s) for s in stop), default=0)
        self.text = ""
        self._emitted = 0
        self._primed = 0
        self.stopped = False

    def prime(self, ids: list[int]) -> None:
        """Continues the text another engine generated from ``ids`` (a migrated request): it counts
        as emitted, except a tail that could still start a stop string, which that engine held back
        as this one would have; stop strings are then found across the seam."""
        for token_id in ids:
            self._ids.append(token_id)
            self.text += self._decoder.step(self._tokenizer, token_id) or ""
        self._primed = len(ids)
        self._emitted = len(self.text) - self._held_back()

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        piece = self._decoder.step(self._tokenizer, token_id) or ""
        if not piece or self.stopped:
            return ""
        search_from = max(0, len(self.text) - self._longest_stop + 1)
        self.text += piece
        if len(self._ids) - self._primed >= self._min_tokens:
            self._cut_at_stop(search_from)
        end = len(self.text) if self.stopped else len(self.text) - self._held_back()
        return self._emit(end)

    def flush(self) -> str:
        if not self.stopped:  # the decoder still holds the bytes of an unfinished character
            full = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special)
            if full.startswith(self.text):
                self.text = full
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        out = self.text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return out

    def _cut_at_stop(self, search_from: int) -> None:
        hits = [i for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for n in range(min(self._longest_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
