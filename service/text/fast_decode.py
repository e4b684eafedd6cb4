"""Incremental detokenization from per-id tables, for the decoders that allow it exactly.

`tokenizers.decode` turns ids into token strings, drops the unknown ones (and the special ones
when skipping them), and runs the decoder over the list. For two decoders the result is a pure
function of a per-id value that can be tabled once when the tokenizer loads:

- `ByteLevel` (GPT-2, Llama 3, Qwen2/2.5/3): every token string stands for a fixed byte string
  (each character of the byte alphabet for its byte; a token with any other character, such as
  an added token holding a space or "é", for its own UTF-8 bytes), and the text is the
  concatenation decoded as UTF-8 with each maximal invalid subsequence replaced by U+FFFD (Rust's
  `from_utf8_lossy`, which Python's `errors="replace"` matches). An incremental UTF-8 decoder
  releases exactly the complete characters, and its output is always a prefix of the full decode.
- the Llama 2 / Mistral sequence `Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0)`: a
  token `<0xHH>` is one byte; a run of them becomes its UTF-8 text if the whole run is valid and
  one U+FFFD per byte otherwise; other tokens become their string with "▁" as " "; then the
  first character of the whole text is dropped if it is a space. Since a later byte of the same
  run can turn the whole run into U+FFFDs, a run is held back until a token that is not a byte
  ends it (or until the completion ends).

Any other decoder, or a table that disagrees with `decode([id])` for any id, gets no table: the
caller falls back to `tokenizers`' own `DecodeStream`.
"""

from __future__ import annotations

import codecs
import copy
import json
import logging
import re
from collections.abc import Callable
from typing import Any

log = logging.getLogger("service.fast_decode")  # its name before it moved into service/text/

METASPACE_DECODERS = [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0},
]
# What `u8::from_str_radix(s, 16)` accepts for the two characters of "<0xHH>".
_HEX_BYTE = re.compile(r"\+?[0-9A-Fa-f]+")
NOT_LATIN1 = "\u0100"


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's `bytes_to_unicode`): character -> the byte it stands
    for. Printable bytes stand for themselves; the others are shifted to U+0100 upwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return alphabet


class ByteLevelStream:
    """One completion's incremental decode under a byte-level table."""

    __slots__ = ("_pending", "_raw", "_size", "_text", "_utf8")

    def __init__(self, table: ByteLevelTable) -> None:
        self._raw, self._text, self._size = table.raw, table.text, len(table.raw)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = False  # the UTF-8 decoder holds the start of a character

    def step(self, token_id: int) -> str:
        if not 0 <= token_id < self._size:
            return ""  # `decode` drops ids it does not know
        if not self._pending:
            text = self._text[token_id]
            if text is not None:
                return text  # complete characters alone: nothing to join with
        text = self._utf8.decode(self._raw[token_id])
        self._pending = bool(self._utf8.getstate()[0])
        return text

    def flush(self) -> str:
        """What the UTF-8 decoder still holds (an incomplete character: U+FFFD, as `decode`
        gives it at the end)."""
        text = self._utf8.decode(b"", final=True)
        self._pending = False
        return text


class ByteLevelTable:
    """Each id's bytes (b"" for ids `decode` drops), and its text where those bytes are
    complete UTF-8 on their own (the common case, decoded without the incremental decoder)."""

    def __init__(self, raw: list[bytes]) -> None:
        self.raw = raw
        self.alone = [b.decode("utf-8", errors="replace") for b in raw]  # decode([id])
        # NOTE: a token that holds a real U+FFFD takes the incremental decoder's path too.
        self.text: list[str | None] = [t if "\ufffd" not in t else None for t in self.alone]

    def stream(self) -> ByteLevelStream:
        return ByteLevelStream(self)

    def without(self, ids: set[int]) -> ByteLevelTable:
        """This table with `ids` dropped (special tokens, when skipping them)."""
        table = copy.copy(self)
        table.raw, table.alone, table.text = list(self.raw), list(self.alone), list(self.text)
        for i in ids:
            table.raw[i], table.alone[i], table.text[i] = b"", "", ""
        return table


class MetaspaceStream:
    """One completion's incremental decode under a Llama 2 style byte-fallback table."""

    __slots__ = ("_byte", "_run", "_size", "_started", "_text")

    def __init__(self, table: MetaspaceTable) -> None:
        self._text, self._byte, self._size = table.text, table.byte, len(table.text)
        self._run = bytearray()  # the byte tokens since the last other token
        self._started = False  # some text came out (the leading space is stripped once)

    def step(self, token_id: int) -> str:
        if not 0 <= token_id < self._size:
            return ""
        byte = self._byte[token_id]
        if byte is not None:
            self._run.append(byte)
            return ""
        # NOTE: dropped ids (unknown, skipped special) map to None and must not end a byte
        # run: `decode` removes them before the decoder sees the list.
        text = self._text[token_id]
        if text is None:
            return ""
        if self._run:
            text = _run_text(self._run) + text
            self._run.clear()
        if not self._started and text:
            self._started = True
            text = text.removeprefix(" ")
        return text

    def flush(self) -> str:
        """The byte run still held (its text, or one U+FFFD per byte if it is not UTF-8)."""
        text = _run_text(self._run) if self._run else ""
        self._run.clear()
        if not self._started and text:
            self._started = True
            text = text.removeprefix(" ")
        return text


class MetaspaceTable:
    """Each id's byte for `<0xHH>`, else its text with "▁" as " " (None for the ids `decode`
    drops)."""

    def __init__(self, text: list[str | None], byte: list[int | None]) -> None:
        self.text, self.byte = text, byte
        self.alone = [  # decode([id]): a lone byte run, and the leading space stripped
            (_run_text(bytes([b])) if b is not None else t or "").removeprefix(" ")
            for t, b in zip(text, byte, strict=True)
        ]

    def stream(self) -> MetaspaceStream:
        return MetaspaceStream(self)

    def without(self, ids: set[int]) -> MetaspaceTable:
        """This table with `ids` dropped (special tokens, when skipping them)."""
        table = copy.copy(self)
        table.text, table.byte, table.alone = list(self.text), list(self.byte), list(self.alone)
        for i in ids:
            table.text[i], table.byte[i], table.alone[i] = None, None, ""
        return table


DecodeTable = ByteLevelTable | MetaspaceTable


def load_tables(tok: Any, vocab: dict[str, int]) -> dict[bool, DecodeTable | None]:
    """The tables of `tok` (a `tokenizers.Tokenizer` whose `get_vocab(with_added_tokens=True)`
    is `vocab`) for skip_special_tokens False and True, each None where this module cannot
    reproduce `tok.decode` exactly.

    Every id's table entry is checked against `tok.decode([id])` (about 0.3 s for a 150k
    vocabulary on the 2-core development VM, a third of it in `decode_batch`)."""
    decoder = json.loads(tok.decoder.__getstate__()) if tok.decoder is not None else {}
    build: Callable[[list[str | None]], DecodeTable]
    if decoder.get("type") == "ByteLevel":
        build = _byte_level_table
    elif decoder.get("type") == "Sequence" and decoder.get("decoders") == METASPACE_DECODERS:
        build = _metaspace_table
    else:
        return {False: None, True: None}
    added = tok.get_added_tokens_decoder()
    tokens = _token_strings(tok, vocab, added)
    full = build(tokens)
    if not _matches_decode(tok, full, range(len(tokens)), skip_special_tokens=False):
        return {False: None, True: None}
    # Skipping special tokens only drops them (by their string, before the decoder runs), so
    # the other ids need no second check.
    special = _special_ids(tokens, added)
    skipping = full.without(special)
    if not _matches_decode(tok, skipping, sorted(special), skip_special_tokens=True):
        return {False: full, True: None}
    return {False: full, True: skipping}


def _token_strings(tok: Any, vocab: dict[str, int], added: dict[int, Any]) -> list[str | None]:
    """Each id's string as `decode` sees it (None for an id it does not know)."""
    tokens: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, token_id in vocab.items():
        tokens[token_id] = token
    # An added token's string wins over the model's at the same id, and a normalized added
    # token is decoded in its normalized form: only `id_to_token` tells either apart.
    shared_ids = len(vocab) - sum(t is not None for t in tokens)
    if shared_ids or tok.normalizer is not None:
        for token_id in added:
            tokens[token_id] = tok.id_to_token(token_id)
    return tokens


def _byte_level_table(tokens: list[str | None]) -> ByteLevelTable:
    # Alphabet characters become their bytes' latin-1 characters; any other character becomes
    # one latin-1 cannot encode, which sends the token to its own UTF-8 bytes, as tokenizers'
    # ByteLevel decoder does with a token that is not all alphabet.
    as_latin1: dict[int, int | str] = {ord(c): b for c, b in byte_level_alphabet().items()}
    as_latin1.update({c: NOT_LATIN1 for c in range(256) if c not in as_latin1})
    raw = []
    for token in tokens:
        if token is None:
            raw.append(b"")
            continue
        try:
            raw.append(token.translate(as_latin1).encode("latin-1"))
        except UnicodeEncodeError:
            raw.append(token.encode())
    return ByteLevelTable(raw)


def _metaspace_table(tokens: list[str | None]) -> MetaspaceTable:
    text: list[str | None] = []
    byte: list[int | None] = []
    for token in tokens:
        value = None if token is None else _fallback_byte(token)
        byte.append(value)
        text.append(None if token is None or value is not None else token.replace("▁", " "))
    return MetaspaceTable(text, byte)


def _fallback_byte(token: str) -> int | None:
    """The byte a token stands for under ByteFallback (its exact rule), or None."""
    if token.startswith("<0x") and token.endswith(">") and len(token.encode()) == 6:
        digits = token[3:5]
        if _HEX_BYTE.fullmatch(digits):
            return int(digits, 16)
    return None


def _run_text(run: bytes | bytearray) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)  # ByteFallback: one per byte when the run is not valid


def _special_ids(tokens: list[str | None], added: dict[int, Any]) -> set[int]:
    """Ids `decode(skip_special_tokens=True)` drops: those whose string is a special token's."""
    special = {t.content for t in added.values() if t.special}
    return {i for i, token in enumerate(tokens) if token in special}


def _matches_decode(
    tok: Any, table: DecodeTable, ids: range | list[int], skip_special_tokens: bool
) -> bool:
    decoded = tok.decode_batch([[i] for i in ids], skip_special_tokens=skip_special_tokens)
    expected = table.alone if ids == range(len(table.alone)) else [table.alone[i] for i in ids]
    if decoded == expected:
        return True
    token_id, text = next((i, d) for i, d, e in zip(ids, decoded, expected, strict=True) if d != e)
    log.debug("no decode table: id %d decodes to %r, the table says otherwise", token_id, text)
    return False
