"""Stop strings applied to streamed text, without leaking any part of a stop string.

Text arrives in deltas whose boundaries can fall inside a stop string ("Hel" + "lo"
with stop "Hello"). The matcher therefore holds back the longest tail of the text seen
so far that could still grow into a stop string, releases it as soon as it cannot, and
cuts the output right before the earliest match.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Streaming stop-string filter for one response.

    `feed(delta)` returns `(text_to_emit, matched_stop)`; once a stop matched, the
    response is over and later input is ignored. `flush()` returns the held-back tail
    when the stream ends without a match.
    """

    __slots__ = ("_held", "_max_hold", "_stops", "matched")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.matched: str | None = None

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed(self, delta: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", self.matched
        if not self._stops:
            return delta, None
        text = self._held + delta
        cut, stop = self._earliest_match(text)
        if stop is not None:
            self._held = ""
            self.matched = stop
            return text[:cut], stop
        hold = self._partial_suffix_len(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _earliest_match(self, text: str) -> tuple[int, str | None]:
        # `text` is the held tail (no complete stop, by construction) plus the new delta,
        # so any match ends in the delta; searching it whole is cheap as the tail is short.
        best, best_stop = len(text) + 1, None
        for stop in self._stops:
            index = text.find(stop)
            if index != -1 and index < best:
                best, best_stop = index, stop
        return best, best_stop

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop."""
        for length in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
