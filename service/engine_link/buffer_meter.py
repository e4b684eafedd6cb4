"""BufferMeter: how much engine output one GenerateStream call holds that its client has not
taken yet, and what happens past its budget."""

from __future__ import annotations

from collections.abc import Callable

from engine.protocol.messages import RequestOutput

# Estimated Python sizes (CPython 3.11, 64-bit) of what a RequestOutput holds: the object and
# its lists, a token id and its logprob (or a prompt position's), and one (id, logprob) of
# top_logprobs.
OUTPUT_BYTES = 400
TOKEN_BYTES = 40
TOP_LOGPROB_BYTES = 70


def output_bytes(output: RequestOutput) -> int:
    """An estimate of the memory `output` holds; cheap (it runs once per output)."""
    tokens = len(output.new_token_ids)
    top = output.top_logprobs
    per_token = TOKEN_BYTES + (TOP_LOGPROB_BYTES * len(top[0][0]) if top else 0)
    size = OUTPUT_BYTES + tokens * per_token
    prompt = output.prompt_logprobs
    if prompt is not None and prompt.logprobs:  # a request's first output, once
        top = prompt.top_logprobs
        per_position = TOKEN_BYTES + (TOP_LOGPROB_BYTES * len(top[0][0]) if top else 0)
        size += len(prompt.logprobs) * per_position
    return size


class BufferMeter:
    """The sum of what a call's Inboxes hold. Each Inbox adds what it receives and takes back
    what its handler takes (or drops); `on_over` runs once, synchronously, when the sum first
    passes `budget` (the Inbox's put is on the router's path, so it must not block)."""

    __slots__ = ("budget", "held", "on_over", "over")

    def __init__(self, budget: int, on_over: Callable[[], None]) -> None:
        self.budget = budget
        self.held = 0
        self.on_over = on_over
        self.over = False

    def add(self, size: int) -> None:
        self.held += size
        if self.held > self.budget and not self.over:
            self.over = True
            self.on_over()

    def remove(self, size: int) -> None:
        self.held -= size
        assert self.held >= 0, self.held
