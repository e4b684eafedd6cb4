"""Builders for the proposer tests: requests with given tokens, and a token list that counts
the elements read from it (how the cost tests measure work without timing it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, SupportsIndex, overload

from engine.protocol.messages import SamplingParams
from engine.scheduling.request import Request


def make_request(
    tokens: list[int],
    prompt_len: int | None = None,
    *,
    name: str = "r",
    index: int = 0,
    adapter_key: int = 0,
) -> Request:
    """A request whose token_ids are `tokens`, the first `prompt_len` (default: all) its
    prompt."""
    return Request(
        request_id=name,
        index=index,
        prompt_len=len(tokens) if prompt_len is None else prompt_len,
        token_ids=list(tokens),
        params=SamplingParams(max_tokens=100),
        seed=0,
        max_tokens=100,
        arrival_seq=0,
        adapter_key=adapter_key,
    )


class CountingList(list[int]):
    """A list of token ids that counts how many elements are read from it: by index, by slice
    or by iteration."""

    reads = 0

    @overload
    def __getitem__(self, i: SupportsIndex) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: Any) -> Any:
        got = super().__getitem__(i)
        self.reads += len(got) if isinstance(i, slice) else 1
        return got

    def __iter__(self) -> Iterator[int]:
        for token in super().__iter__():
            self.reads += 1
            yield token
