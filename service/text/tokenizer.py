"""Tokenizer: encode prompts and detokenize completions incrementally, in the service process."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

import tokenizers
from tokenizers.decoders import DecodeStream

from service.text.fast_decode import DecodeTable, load_tables

# Encoding this many characters or more goes to a worker thread; shorter ones cost less than
# the thread hop. `encode` holds the GIL even in a thread, `encode_batch` releases it.
OFF_LOOP_ENCODE_CHARS = 2048
# The most a normalizer shrinks text, in UTF-8 bytes: NFKC maps a 4-byte mathematical letter
# (U+1D400) to a 1-byte ASCII one; lowercasing and the other Unicode forms shrink less.
NORMALIZER_SHRINK = 4


class Tokenizer:
    """The served model's `tokenizer.json`."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        self.path = Path(checkpoint_dir) / "tokenizer.json"
        self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        # The longest token string in UTF-8 bytes bounds how much input one token consumes: a
        # byte-level BPE token's characters stand for one byte each and encode to >= 1 byte; a
        # metaspace "▁" is 3 bytes for a space, a byte-fallback "<0x41>" 6 for one byte.
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.max_token_bytes = max((len(s.encode()) for s in vocab), default=1)
        # Per-id decode tables for incremental detokenization, by skip_special_tokens; None
        # where the decoder is not one fast_decode reproduces exactly (checked id by id here).
        self._decode_tables: dict[bool, DecodeTable | None] = load_tables(self._tok, vocab)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def max_text_bytes(self, max_tokens: int) -> int:
        """A text longer than this many UTF-8 bytes encodes to more than `max_tokens` tokens:
        callers refuse it without encoding it.

        Assumes every token consumes at most `max_token_bytes` of normalized text and a
        normalizer shrinks text by at most NORMALIZER_SHRINK. What breaks that (a normalizer that
        deletes text, added tokens that swallow the whitespace around them, an unknown-token
        that stands for a whole word) can only refuse a freak text that would have fit; it never
        admits one that does not.
        """
        shrink = 1 if self._tok.normalizer is None else NORMALIZER_SHRINK
        return max_tokens * self.max_token_bytes * shrink

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; long texts are encoded off the event loop."""
        if len(text) < OFF_LOOP_ENCODE_CHARS:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        encodings = await asyncio.to_thread(
            self._tok.encode_batch, [text], add_special_tokens=add_special_tokens
        )
        return list(encodings[0].ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer:
        table = self._decode_tables[skip_special_tokens]
        return WindowStream(self, skip_special_tokens) if table is None else table.stream()


class Detokenizer(Protocol):
    """Incremental, UTF-8 safe detokenization of one completion.

    `step` returns the text a token completes ("" while a multi-byte character is still
    incomplete); `flush` returns what is still held back when the completion ends, so that the
    concatenation of every returned piece equals `decode(all ids)`.

    Byte-level and Llama 2 style byte-fallback tokenizers step through per-id tables
    (service/text/fast_decode.py, well under a microsecond per token); any other decoder goes
    through `tokenizers`' DecodeStream (WindowStream), which re-decodes a window of ids per
    token.
    """

    def step(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class WindowStream:
    """`tokenizers`' DecodeStream: decodes a window of the last ids again for every token and
    returns the new text once it does not end in U+FFFD (1-2 µs per token on the dev VM). Its
    tail comes from a full decode of the completion."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted = 0  # characters returned so far

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._stream.step(self._tokenizer._tok, token_id) or ""
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        full = self._tokenizer.decode(self._ids, self._skip_special_tokens)
        # NOTE: DecodeStream's pieces are a prefix of the full decode for byte-level and
        # metaspace tokenizers while the bytes are valid UTF-8; the full decode is the
        # reference for what is left.
        tail = full[self._emitted :]
        self._emitted = len(full)
        return tail
