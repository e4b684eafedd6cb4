"""StopStringMatcher: find stop strings in streamed text, across chunk boundaries."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    text: str  # the text before the stop string (and the stop string, when it is included)
    stop: str  # the stop string that matched


class StopStringMatcher:
    """Feeds on detokenized text; releases only text that cannot be the start of a stop string.

    Text ending in a proper prefix of some stop string is held back until the next piece shows
    whether the stop string follows; `flush` releases it when the completion ends otherwise.
    When several stop strings match, the one that starts first wins (then the longest).
    """

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = sorted({s for s in stops if s}, key=len, reverse=True)
        self._include = include_stop_str_in_output
        self._held = ""

    def __bool__(self) -> bool:
        return bool(self._stops)

    def feed(self, text: str) -> str | StopMatch:
        """The text safe to send now, or the match that ends the completion."""
        if not self._stops:
            return text
        buffer = self._held + text
        match = self._earliest_match(buffer)
        if match is not None:
            start, stop = match
            self._held = ""
            return StopMatch(buffer[: start + len(stop)] if self._include else buffer[:start], stop)
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:  # longest first, so ties at one start keep the longest
            start = buffer.find(stop)
            if start >= 0 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
