"""Streaming text out of token ids: each token costs a decode of a few tokens, not the reply.

Why incremental: decoding the whole reply again at every token costs O(n) per token (O(n^2)
per reply), twice per token in plain mode. :class:`IncrementalDecoder` decodes only a small
window: the tokens since the last emitted character boundary, with a few tokens before them
as context (tokenizers such as SentencePiece drop or add a leading space depending on what
precedes a token, so a token alone can decode differently than in context). Text is held back
while it ends in U+FFFD: a multi-byte UTF-8 character split across tokens is only emitted
once its last byte has arrived.

:class:`StopStrings` finds stop strings ("\\nUser:" in plain completion) in streamed text and
holds back any tail that could be the start of one, so a stop string is never shown, not even
in part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDecoder", "StopStrings"]

_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Token ids in, new text out; ``text`` is everything emitted so far."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens before this index have been emitted as text
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Feed one token; returns the text it completes ("" while a character is partial)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        now = self._decode(self._ids[self._prefix :])
        if now.endswith(_REPLACEMENT) or len(now) <= len(before) or not now.startswith(before):
            # An incomplete character (or nothing visible yet): wait for more tokens. A window
            # that no longer starts with its context cannot be cut safely either.
            return ""
        new = now[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += new
        return new

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character shows as U+FFFD)."""
        before = self._decode(self._ids[self._prefix : self._read])
        now = self._decode(self._ids[self._prefix :])
        new = now[len(before) :] if now.startswith(before) else ""
        self._prefix = self._read = len(self._ids)
        self.text += new
        return new


class StopStrings:
    """Streamed text in, text safe to show out, until a stop string appears."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """``(text to show, stopped)``; after a stop, everything is swallowed."""
        if self.stopped:
            return "", True
        pending = self._held + text
        cuts = [pending.find(s) for s in self._stops if s in pending]
        if cuts:
            self.stopped = True
            self._held = ""
            return pending[: min(cuts)], True
        keep = self._partial_tail(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        """Held-back text at the end of a reply that no stop string completed."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_tail(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
