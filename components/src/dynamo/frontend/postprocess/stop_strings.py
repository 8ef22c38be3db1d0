"""Stop strings applied to streamed text, without leaking any part of a stop string.

Text arrives in deltas whose boundaries can fall inside a stop string ("Hel" + "lo"
with stop "Hello"). The matcher therefore holds back the longest tail of the text seen
so far that could still grow into a stop string, releases it as soon as it cannot, and
cuts the output right before the match that completes first (vLLM's rule: the result is
the same whether text arrives one token at a time or several at once; ties go to the
earlier stop in the request's list).

With `include_stop_str_in_output` (vLLM's extension) the stop string is part of the text:
nothing is held back (a partial stop is text either way) and the output ends right after
the match.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Streaming stop-string filter for one response.

    `feed(delta)` returns `(text_to_emit, matched_stop)`; once a stop matched, the
    response is over and later input is ignored. `flush()` returns the held-back tail
    when the stream ends without a match.
    """

    __slots__ = ("_include", "_max_tail", "_stops", "_tail", "matched")

    def __init__(self, stops: Sequence[str], include_in_output: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_in_output
        self._max_tail = max((len(s) for s in self._stops), default=1) - 1
        # The last characters seen that could begin a stop: held back from the output
        # (default), or already emitted and kept only to find a stop that spans deltas
        # (`include_in_output`).
        self._tail = ""
        self.matched: str | None = None

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed(self, delta: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", self.matched
        if not self._stops:
            return delta, None
        seen = len(self._tail) if self._include else 0  # characters already emitted
        text = self._tail + delta
        start, stop = self._first_completed(text)
        if stop is not None:
            self._tail = ""
            self.matched = stop
            return text[seen : start + len(stop) if self._include else start], stop
        keep = self._partial_suffix_len(text)
        self._tail = text[len(text) - keep :] if keep else ""
        return (delta, None) if self._include else (text[: len(text) - keep], None)

    def flush(self) -> str:
        tail, self._tail = self._tail, ""
        return "" if self.matched is not None or self._include else tail

    def _first_completed(self, text: str) -> tuple[int, str | None]:
        """(start, stop) of the match that ends first in `text` (stop None: no match).
        `text` is the tail (no complete stop, by construction) plus the new delta, so any
        match ends in the delta; searching it whole is cheap as the tail is short."""
        best_end, best_start, best_stop = len(text) + 1, -1, None
        for stop in self._stops:
            index = text.find(stop)
            if index != -1 and index + len(stop) < best_end:
                best_end, best_start, best_stop = index + len(stop), index, stop
        return best_start, best_stop

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop."""
        for length in range(min(self._max_tail, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
