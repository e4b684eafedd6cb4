"""Logprobs in OpenAI's two shapes, from sluice.v1's ids and floats.

Completions (the legacy shape lm-eval reads): parallel lists `tokens`, `token_logprobs`,
`top_logprobs` (one {token: logprob} dict per position, the position's own token included, as
vLLM does, so that a position is greedy when its logprob is the dict's largest) and
`text_offset` (each token's first character in the choice's text). With `echo`, the prompt's
tokens come first; the first has no context, so its logprob and dict are null.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.

A token's text is its piece of the incremental detokenization (with the request's
skip_special_tokens), so that the pieces concatenate to the choice's text and text_offset lines
up; a piece is empty while a multi-byte character is incomplete (or for a skipped special
token). An alternative token's text is its own decode, special tokens included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sluice.v1 import generation_pb2 as pb

from service.text.tokenizer import Detokenizer, Tokenizer


class TokenTexts:
    """The pieces of one sequence of tokens, in order."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._stream: Detokenizer = tokenizer.detokenizer(skip_special_tokens)

    def pieces(self, token_ids: Sequence[int]) -> list[str]:
        return [self._stream.step(token_id) for token_id in token_ids]

    def name(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


class CompletionLogprobs:
    """One choice's legacy logprobs, built as its tokens arrive."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._texts = TokenTexts(tokenizer, skip_special_tokens)
        self._offset = 0
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add_prompt(self, prompt_ids: list[int], scores: pb.PromptLogprobs) -> None:
        """The prompt's tokens with their scores (from Started, which scores from position 1)."""
        start = len(prompt_ids) - len(scores.logprobs)
        tops: list[pb.TopLogprobs | None] = [*scores.top_logprobs] or [None] * len(scores.logprobs)
        self._add(prompt_ids[:start], [None] * start, [None] * start)
        self._add(prompt_ids[start:], list(scores.logprobs), tops)

    def add_tokens(self, chunk: pb.TokenChunk) -> None:
        tops: list[pb.TopLogprobs | None] = [*chunk.top_logprobs] or [None] * len(chunk.token_ids)
        self._add(list(chunk.token_ids), list(chunk.logprobs), tops)

    def _add(
        self,
        ids: list[int],
        logprobs: Sequence[float | None],
        tops: Sequence[pb.TopLogprobs | None],
    ) -> None:
        for piece, logprob, top in zip(self._texts.pieces(ids), logprobs, tops, strict=True):
            self.tokens.append(piece)
            self.token_logprobs.append(logprob)
            self.text_offset.append(self._offset)
            self._offset += len(piece)
            if logprob is None:
                self.top_logprobs.append(None)
                continue
            alternatives = {} if top is None else self._named(top)
            alternatives[piece] = logprob  # the position's own token, as vLLM includes it
            self.top_logprobs.append(alternatives)

    def _named(self, top: pb.TopLogprobs) -> dict[str, float]:
        return {self._texts.name(i): lp for i, lp in zip(top.token_ids, top.logprobs, strict=True)}

    def take(self) -> dict[str, Any]:
        """What was added since the last take, as the legacy object (a stream sends each
        chunk's own)."""
        taken = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return taken


class ChatLogprobs:
    """One chat choice's logprobs: the `content` list, built as its tokens arrive."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._texts = TokenTexts(tokenizer, skip_special_tokens)
        self.content: list[dict[str, Any]] = []

    def add_tokens(self, chunk: pb.TokenChunk) -> None:
        tops: list[pb.TopLogprobs | None] = [*chunk.top_logprobs] or [None] * len(chunk.token_ids)
        pieces = self._texts.pieces(list(chunk.token_ids))
        for piece, logprob, top in zip(pieces, chunk.logprobs, tops, strict=True):
            alternatives = []
            if top is not None:
                for token_id, lp in zip(top.token_ids, top.logprobs, strict=True):
                    name = self._texts.name(token_id)
                    alternatives.append({"token": name, "logprob": lp, "bytes": _bytes(name)})
            self.content.append(
                {
                    "token": piece,
                    "logprob": logprob,
                    "bytes": _bytes(piece),
                    "top_logprobs": alternatives,
                }
            )

    def take(self) -> dict[str, Any]:
        taken, self.content = {"content": self.content}, []
        return taken


def _bytes(text: str) -> list[int]:
    return list(text.encode())
