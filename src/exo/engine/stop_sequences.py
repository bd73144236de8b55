"""Streaming stop-sequence matching over decoded text deltas."""

from dataclasses import dataclass


@dataclass
class StopMatcher:
    """Feed text deltas; get back the text safe to emit and whether a stop hit.

    Text that could be the start of a stop sequence is held back until it is
    known not to be one, so a stop string is never partly sent to a client.
    Once one hits, `matched` says which (the earliest in the text).
    """

    stops: tuple[str, ...]
    matched: str | None = None
    _pending: str = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        text = self._pending + delta
        if not self.stops:
            return text, False
        hits = [(i, stop) for stop in self.stops if stop and (i := text.find(stop)) >= 0]
        if hits:
            first, self.matched = min(hits, key=lambda hit: hit[0])
            self._pending = ""
            return text[:first], True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text
