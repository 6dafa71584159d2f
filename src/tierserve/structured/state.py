"""One request's grammar state: which tokens may come next, and the tokens it took so far."""

from __future__ import annotations

import llguidance as llg
import numpy as np


class GrammarState:
    """An llguidance matcher for one request. The engine fills the request's row of the step's
    bitmask (``fill``: bit t of word t // 32 set = token t allowed) before sampling, and the
    appender feeds it every token the request gets (``consume``). ``done``: the grammar is complete
    and took the end (EOS), or cannot continue: the request ends."""

    def __init__(self, matcher: llg.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.words = (vocab_size + 31) // 32  # the bitmask row's int32 words
        self.failed = False

    def fill(self, row: np.ndarray) -> None:
        """Writes the allowed-token bits into ``row`` (int32, C-contiguous). A step over the parser's
        bounds (``grammars.LIMITS``) fails the grammar: the row allows everything and the request ends
        after this token (``done``), logged by the appender."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self.matcher.is_error():
            row[:] = -1
            self.failed = True

    def consume(self, token: int) -> bool:
        """Advances over ``token``; False (and ``failed``) when the grammar forbids it."""
        ok = self.matcher.consume_token(token)
        self.failed |= not ok
        return ok

    def consume_all(self, tokens: list[int]) -> bool:
        return all(self.consume(t) for t in tokens)

    def rollback(self, tokens: int) -> None:
        """Undoes the last ``tokens`` consumed (a speculative verification's look ahead)."""
        if tokens:
            self.matcher.rollback(tokens)

    @property
    def done(self) -> bool:
        return self.failed or self.matcher.is_stopped() or self.matcher.is_error()
