"""OpenAI ``stop`` sequences over a stream of text deltas.

Text is held back while it could still be the start of a stop sequence, so a client never
sees part of one; once one appears, everything from it on is dropped.
"""

from __future__ import annotations


class StopScanner:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.text = ""  # everything released so far
        self.hit = False

    def feed(self, delta: str) -> str:
        """The part of ``delta`` (with what was held back) that is safe to show now."""
        if self.hit:
            return ""
        pending = self._pending + delta
        cuts = [pending.find(s) for s in self.stops if s in pending]
        if cuts:
            self.hit = True
            self._pending = ""
            return self._release(pending[: min(cuts)])
        keep = self._partial_suffix(pending)
        self._pending = pending[len(pending) - keep :] if keep else ""
        return self._release(pending[: len(pending) - keep])

    def flush(self) -> str:
        """What was held back, at the end of the reply."""
        rest, self._pending = ("" if self.hit else self._pending), ""
        return self._release(rest)

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop sequence."""
        for n in range(min(self._hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def _release(self, text: str) -> str:
        self.text += text
        return text
