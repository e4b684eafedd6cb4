"""StopStringMatcher: find stop strings in streamed text, across chunk boundaries."""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    text: str  # the text before the stop string (and the stop string, when it is included)
    stop: str  # the stop string that matched


class StopAutomaton:
    """An Aho-Corasick automaton over a set of stop strings, read one character at a time.

    A state stands for a prefix of some stop string (state 0: the empty one). From the state of
    a text T, `step(state, c)` gives the state of the longest suffix of T + c that is a prefix
    of a stop string, in amortized O(1): the cost of matching does not grow with the number or
    the length of the stop strings, only with the text read. Building it costs about 4 ms for
    32 stop strings of 256 characters; it is never changed after, so matchers share it.
    """

    def __init__(self, stops: set[str]) -> None:
        self.next: list[dict[str, int]] = [{}]  # state -> {character: child state}
        self.depth = [0]  # state -> length of the prefix it stands for
        own: list[str | None] = [None]  # state -> the stop string it completes, if any
        for stop in stops:
            state = 0
            for char in stop:
                child = self.next[state].get(char)
                if child is None:
                    child = self.next[state][char] = len(self.next)
                    self.next.append({})
                    self.depth.append(self.depth[state] + 1)
                    own.append(None)
                state = child
            own[state] = stop
        # fallback[s]: the state of the longest proper suffix of s's prefix that is a prefix
        # too; ends[s]: every stop string that ends where s does, longest first.
        self.fallback = [0] * len(self.next)
        self.ends: list[tuple[str, ...]] = [()] * len(self.next)
        # Breadth first, shorter prefixes before longer; the root's children fall back to it.
        order = list(self.next[0].values())
        for state in order:
            for char, child in self.next[state].items():
                fallback = self.fallback[state]
                while fallback and char not in self.next[fallback]:
                    fallback = self.fallback[fallback]
                self.fallback[child] = self.next[fallback].get(char, 0)
                order.append(child)
        for state in order:  # a state's fallback is shallower: its ends are already known
            mine = own[state]
            inherited = self.ends[self.fallback[state]]
            self.ends[state] = (mine, *inherited) if mine is not None else inherited

    def step(self, state: int, char: str) -> int:
        while state and char not in self.next[state]:
            state = self.fallback[state]
        return self.next[state].get(char, 0)


class StopStringMatcher:
    """Feeds on detokenized text; releases only text that cannot be the start of a stop string.

    Text ending in a proper prefix of some stop string is held back until the next piece shows
    whether the stop string follows; `flush` releases it when the completion ends otherwise.
    When several stop strings match, the one that starts first wins (then the longest).
    The cost of `feed` is proportional to the piece fed, whatever the stop strings.
    """

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        unique = frozenset(s for s in stops if s)
        self._automaton = _automaton(unique) if unique else None
        self._include = include_stop_str_in_output
        self._state = 0
        self._held = ""  # the text of self._state, not yet released

    def __bool__(self) -> bool:
        return self._automaton is not None

    def feed(self, text: str) -> str | StopMatch:
        """The text safe to send now, or the match that ends the completion."""
        automaton = self._automaton
        if automaton is None:
            return text
        buffer = self._held + text
        best: tuple[int, str] | None = None  # (start in buffer, stop string)
        state = self._state
        for end, char in enumerate(text, start=len(self._held) + 1):
            state = automaton.step(state, char)
            for stop in automaton.ends[state]:
                start = end - len(stop)
                # Earliest start wins; at one start, the longest (it ends later: seen later).
                if (
                    best is None
                    or start < best[0]
                    or (start == best[0] and len(stop) > len(best[1]))
                ):
                    best = (start, stop)
        if best is not None:
            start, stop = best
            self._state, self._held = 0, ""
            return StopMatch(buffer[: start + len(stop)] if self._include else buffer[:start], stop)
        # NOTE: every stop string ending in this piece starts inside `buffer`: the held text is
        # the longest suffix of everything before that could start one.
        keep = automaton.depth[state]
        self._state, self._held = state, buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        held, self._held, self._state = self._held, "", 0
        return held


# The n samples of a request share their stop strings, and so do most requests of a workload.
@functools.lru_cache(maxsize=16)
def _automaton(stops: frozenset[str]) -> StopAutomaton:
    return StopAutomaton(set(stops))
