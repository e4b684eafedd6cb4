"""PatternGrammar: a JSON schema's string `pattern` (and length bounds) as a GBNF expression.

xgrammar 0.2.8 gets both wrong inside a JSON string: its regex-in-a-string matcher accepts
"abcd" for `^[a-z]{2,3}(-[a-z]{5,8})?$`, and its minLength/maxLength rule lets raw control
characters (U+0000-U+001F) into the string, which is then not JSON. So Sluice writes these
expressions itself, over the string's *encoded* text: every character the pattern allows is
written as JSON writes it (raw where JSON allows it raw; `\\"`, `\\\\`, `\\n`, `\\u001f` ... for
the rest), so whatever the expression derives is a valid JSON string body whose decoded value
the pattern matches.

The dialect is ECMA-262's, the one JSON Schema names, read through Python's `re` parser:
literals, `.`, classes (`[a-z]`, `[^...]`, `\\d \\w \\s` and their negations, ASCII as in
ECMA-262), groups, `|`, and the quantifiers `* + ? {m} {m,} {m,n}` (lazy ones too: the language
is the same). A pattern is searched, as JSON Schema says: `^` and `$` (accepted only at the
ends) anchor it, and without them any text may come before or after (xgrammar alone matched the
whole string, so `^(https|file)://` allowed only "https://" and "file://"). `.` matches any
character but the line terminators \\n, \\r, U+2028, U+2029.
Refused (PatternError): backreferences, lookaround, word boundaries, inline flags, possessive
or atomic groups, and a class that matches no character.
"""

from __future__ import annotations

import functools
import itertools
import re
import warnings
from re import _constants as c  # type: ignore[attr-defined]
from re import _parser as sre  # type: ignore[attr-defined]
from typing import Any

MAX_CODE_POINT = 0x10FFFF
MAX_GROUP_DEPTH = 32
_ESCAPE = re.compile(r"\\.", re.DOTALL)
_CLASS = re.compile(r"\[\^?\]?[^\]]*\]")
_SURROGATES = (0xD800, 0xDFFF)
_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
# \S excludes what either dialect calls a space (ECMA-262's list and Python's \x1c-\x1f, \x85).
_ANY_SPACE = _SPACE + [(0x1C, 0x1F), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680)]
_ANY_SPACE += [(0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F)]
_ANY_SPACE += [(0x3000, 0x3000), (0xFEFF, 0xFEFF)]
_LINE_TERMINATORS = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]
_JSON_SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n"}
_JSON_SHORT_ESCAPES |= {0x0D: "\\r", 0x09: "\\t"}

Ranges = list[tuple[int, int]]
_ANY_TEXT = (object(), None)  # where an unanchored pattern lets any text come


def group_depth(pattern: str) -> int:
    """How deep the pattern's groups nest (escapes and character classes skipped)."""
    outside = _CLASS.sub("", _ESCAPE.sub("", pattern))
    steps = [1 if char == "(" else -1 for char in outside if char in "()"]
    return max(itertools.accumulate(steps, initial=0))


class PatternError(ValueError):
    """The pattern uses something this dialect does not have: the message says what."""


class PatternGrammar:
    """Writes the patterns and length bounds of one schema as GBNF expressions. A character
    set's alternatives are written once, as a rule of their own (`rules`), however many times
    the patterns use it, so the grammar grows with the patterns' length, not 50 times it."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}  # rule name -> its body
        self._names: dict[str, str] = {}  # body -> rule name

    def pattern(self, pattern: str) -> str:
        """An expression deriving exactly the JSON string bodies (quotes excluded) whose
        decoded text `pattern` matches (searched, as JSON Schema says)."""
        if group_depth(pattern) > MAX_GROUP_DEPTH:  # both re's parser and this writer recurse
            raise PatternError(f"nests groups more than {MAX_GROUP_DEPTH} deep")
        try:
            with warnings.catch_warnings():  # "possible set difference": ECMA-262 has none
                warnings.simplefilter("ignore", FutureWarning)
                parsed = sre.parse(pattern)
        except re.error as exc:
            raise PatternError(f"is not a valid regular expression: {exc}") from None
        if parsed.state.grouprefpos:
            raise PatternError("backreferences are not supported")
        if parsed.state.flags & ~re.UNICODE:
            raise PatternError("inline flags such as (?i) are not supported")
        return self._sequence(_anchor(list(parsed), start=True, end=True))

    def length(self, min_length: int, max_length: int | None) -> str:
        """An expression deriving the JSON string bodies of `min_length` to `max_length`
        characters (None: no upper bound), a character counted once however it is escaped."""
        upper = "" if max_length is None else str(max_length)
        return f"{self._charset(_ALL)}{{{min_length},{upper}}}"

    def _sequence(self, items: list[Any]) -> str:
        parts: list[str] = []
        run: list[str] = []  # printable ASCII literals, written as one string literal
        for op, av in items:
            if op is c.LITERAL and 0x20 <= av < 0x7F and av not in (0x22, 0x5C):
                run.append(chr(av))
                continue
            if run:
                parts.append('"' + "".join(run) + '"')
                run = []
            parts.append(self._item(op, av))
        if run:
            parts.append('"' + "".join(run) + '"')
        return " ".join(parts) if parts else '""'

    def _item(self, op: Any, av: Any) -> str:
        if op is _ANY_TEXT[0]:
            return self._charset(_ALL) + "{0,}"
        if op is c.LITERAL:
            return self._charset(((av, av),))
        if op is c.NOT_LITERAL:
            return self._charset(tuple(_complement([(av, av)])))
        if op is c.ANY:
            return self._charset(_DOT)
        if op is c.IN:
            return self._charset(tuple(_class(av)))
        if op is c.BRANCH:
            return _alternatives([self._sequence(list(b)) for b in av[1]])
        if op is c.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            if add_flags or del_flags:
                raise PatternError("inline flags such as (?i) are not supported")
            return "(" + self._sequence(list(sub)) + ")"
        if op in (c.MAX_REPEAT, c.MIN_REPEAT):
            low, high, sub = av
            bound = "" if high == c.MAXREPEAT else str(high)
            return "(" + self._sequence(list(sub)) + f"){{{low},{bound}}}"
        if op is c.AT:
            raise PatternError("^, $ and \\b are supported only at the pattern's ends (^ and $)")
        if op in (c.ASSERT, c.ASSERT_NOT):
            raise PatternError("lookahead and lookbehind are not supported")
        if op is c.GROUPREF or op is c.GROUPREF_EXISTS:
            raise PatternError("backreferences are not supported")
        raise PatternError(f"{str(op).lower()} is not supported")

    def _charset(self, ranges: tuple[tuple[int, int], ...]) -> str:
        body = _charset(ranges)
        if len(body) <= 24:
            return body
        if body not in self._names:
            name = self._names[body] = f"sluice_set_{len(self._names)}"
            self.rules[name] = body
        return self._names[body]


def _anchor(items: list[Any], start: bool, end: bool) -> list[Any]:
    """`items` matched as JSON Schema searches: a ^ at its start is dropped, and without one any
    text may come first (likewise $ and the end), looking into the alternatives and groups at
    its edges (Python's parser factors `^a$|^b$` into `^(?:a$|b$)`)."""
    items = list(items)
    if len(items) == 1 and items[0][0] in (c.BRANCH, c.SUBPATTERN):
        return [_anchor_edge(items[0], start, end)]
    head: list[Any] = []
    tail: list[Any] = []
    if start:
        if items and items[0] == (c.AT, c.AT_BEGINNING):
            items = items[1:]
        elif items and items[0][0] in (c.BRANCH, c.SUBPATTERN):
            items[0] = _anchor_edge(items[0], True, False)
        else:
            head = [_ANY_TEXT]
    if end:
        if items and items[-1] == (c.AT, c.AT_END):
            items = items[:-1]
        elif items and items[-1][0] in (c.BRANCH, c.SUBPATTERN):
            items[-1] = _anchor_edge(items[-1], False, True)
        else:
            tail = [_ANY_TEXT]
    return head + items + tail


def _anchor_edge(item: tuple[Any, Any], start: bool, end: bool) -> tuple[Any, Any]:
    op, av = item
    if op is c.BRANCH:
        return op, (av[0], [_anchor(list(b), start, end) for b in av[1]])
    return op, (*av[:3], _anchor(list(av[3]), start, end))


def _alternatives(options: list[str]) -> str:
    return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"


def _class(items: list[Any]) -> Ranges:
    ranges: Ranges = []
    negate = False
    for op, av in items:
        if op is c.NEGATE:
            negate = True
        elif op is c.LITERAL:
            ranges.append((av, av))
        elif op is c.RANGE:
            ranges.append(av)
        elif op is c.CATEGORY:
            ranges += _category(av)
        else:
            raise PatternError(f"{str(op).lower()} in a class is not supported")
    return _complement(ranges) if negate else _merge(ranges)


def _category(category: Any) -> Ranges:
    table = {
        c.CATEGORY_DIGIT: _DIGIT,
        c.CATEGORY_NOT_DIGIT: _complement(_DIGIT),
        c.CATEGORY_WORD: _WORD,
        c.CATEGORY_NOT_WORD: _complement(_WORD),
        c.CATEGORY_SPACE: _SPACE,
        c.CATEGORY_NOT_SPACE: _complement(_ANY_SPACE),
    }
    if category not in table:
        raise PatternError(f"{str(category).lower()} is not supported")
    return table[category]


def _merge(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out


def _complement(ranges: Ranges) -> Ranges:
    """Every code point but `ranges` and the surrogates (not characters of a JSON text)."""
    out: Ranges = []
    start = 0
    for low, high in _merge(ranges + [_SURROGATES]):
        if low > start:
            out.append((start, low - 1))
        start = max(start, high + 1)
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return out


@functools.lru_cache(maxsize=256)
def _charset(ranges: tuple[tuple[int, int], ...]) -> str:
    """The JSON encodings of a set of characters: raw where JSON allows it, escaped else."""
    plain = _subtract(list(ranges), [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])
    options = ["[" + "".join(_class_range(r) for r in plain) + "]"] if plain else []
    for low, high in ranges:
        for code in range(low, min(high, 0x5C) + 1):
            if code < 0x20 or code in (0x22, 0x5C):
                escape = _JSON_SHORT_ESCAPES.get(code, f"\\u{code:04x}")
                options.append('"' + escape.replace("\\", "\\\\").replace('"', '\\"') + '"')
    if not options:
        raise PatternError("a character class matches no character")
    return _alternatives(options)


def _subtract(ranges: Ranges, removed: Ranges) -> Ranges:
    out: Ranges = []
    for low, high in ranges:
        pieces = [(low, high)]
        for r_low, r_high in removed:
            pieces = [
                part
                for p_low, p_high in pieces
                for part in ((p_low, min(p_high, r_low - 1)), (max(p_low, r_high + 1), p_high))
                if part[0] <= part[1]
            ]
        out += pieces
    return out


def _class_range(bounds: tuple[int, int]) -> str:
    low, high = bounds
    return _class_char(low) if low == high else f"{_class_char(low)}-{_class_char(high)}"


def _class_char(code: int) -> str:
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


_ALL = tuple(_complement([]))
_DOT = tuple(_complement(_LINE_TERMINATORS))
