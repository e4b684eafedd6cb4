"""A request's state inside the engine: tokens, pages, progress, parameters, versions."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.protocol.messages import FinishReason, SamplingParams
from engine.scheduling.prompt_scores import PromptScores

if TYPE_CHECKING:
    from engine.structured.request_grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FORK_PENDING = "fork_pending"  # a sibling of n > 1 waiting for its leader's prompt KV
    AWAITING_GRAMMAR = "awaiting_grammar"  # its structured-output grammar is being compiled
    FINISHED = "finished"


# NOTE: slots: the hot path (scheduling, inputs, postprocessing) reads a Request's attributes
# for every row of every step, and a slot is read without a dict lookup. (Without slots, CPython
# 3.11 shares one keys table among instance dicts only up to 30 keys: a 30th field made every
# read about twice as dear and the host's decode step 20% slower, bench.decode --host-only.)
@dataclass(eq=False, slots=True)
class Request:
    """One sequence being generated (one index of a request with n samples).

    `token_ids` is prompt + output, as far as it is on the host; `num_pending` more tokens
    follow it that launched steps are still sampling (the overlapped loop: engine/core/
    step_loop.py), so the sequence is `num_tokens` long. The KV of the first
    `num_computed_tokens` is in `pages`. A step feeds the tokens from `num_computed_tokens`
    through the model (a pending one is read on the device); when that reaches the end, the
    last position's logits sample the next token.
    """

    request_id: str
    index: int
    prompt_len: int
    token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: the caller's seed (+ index), or drawn by the engine
    max_tokens: int  # resolved: capped by what is left of the context
    arrival_seq: int  # FCFS tie-breaker within a priority; kept across preemption
    priority: int = 0
    deadline: float | None = None  # absolute time.time()
    adapter_key: int = 0  # its resident LoRA adapter's key (engine/lora/registry.py); 0: none
    adapter_version: int = 0  # that adapter's policy version, its tokens' (0: the served one)
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    pages: list[int] = field(default_factory=list)
    slot: int | None = None  # its row in the scheduler's BlockTable while it holds pages
    # KV groups 1.. (engine/kv_cache/kv_groups.py; group 0's are `pages`): one list each, as
    # long as `pages`; a page a sliding group gave back reads the pool's scratch page.
    group_pages: list[list[int]] = field(default_factory=list)
    reclaimed: list[int] = field(default_factory=list)  # per group: leading pages given back
    page_hashes: list[int] = field(default_factory=list)  # prefix-cache chain hashes of pages
    num_computed_tokens: int = 0
    num_pending: int = 0  # tokens sampled by launched steps, not yet in token_ids
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    publish_pages: bool = True  # False once its KV mixes weight versions (CONTINUE update)
    pending_forks: list[Request] = field(default_factory=list)  # siblings to start from my prompt
    prompt_scores: PromptScores | None = None  # prompt logprobs still to be reported (leader)
    grammar: RequestGrammar | None = None  # its structured-output matcher, once compiled
    # Speculative decoding (engine/speculative/): the tokens proposed to follow token_ids that
    # the next step verifies (never in token_ids: only accepted tokens are appended), and the
    # counts proposed and accepted over the request's life.
    draft: list[int] = field(default_factory=list)
    spec_proposed: int = 0
    spec_accepted: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    @property
    def num_tokens(self) -> int:
        """The sequence's length, its pending tokens included."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Output tokens on the host (the pending ones are not)."""
        return len(self.token_ids) - self.prompt_len

    def input_id(self, position: int) -> int:
        """The id of token `position` as a step's input: 0 for a pending token (the device
        writes its sampled id over it)."""
        return self.token_ids[position] if position < len(self.token_ids) else 0

    def input_ids(self, start: int, count: int) -> list[int]:
        """The ids of tokens `start` to `start + count` as a step's input: a pending token
        reads 0 there (the device writes its sampled id over it)."""
        ids = self.token_ids[start : start + count]
        return ids if len(ids) == count else ids + [0] * (count - len(ids))

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Waiting order: higher priority first, then arrival."""
        return (-self.priority, self.arrival_seq)


def new_sequences(
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    max_tokens: int,
    seeds: list[int],
    arrivals: Iterator[int],
    priority: int = 0,
    deadline: float | None = None,
) -> list[Request]:
    """The sequences of one request, one per seed (n = len(seeds)): the leader first, its
    siblings FORK_PENDING in its `pending_forks` (they start from its prompt's KV). The
    leader alone scores the prompt when prompt logprobs are asked for."""
    seqs = [
        Request(
            request_id=request_id,
            index=index,
            prompt_len=len(prompt),
            token_ids=list(prompt),
            params=params,
            seed=seed % 2**64,
            max_tokens=max_tokens,
            arrival_seq=next(arrivals),
            priority=priority,
            deadline=deadline,
        )
        for index, seed in enumerate(seeds)
    ]
    for sibling in seqs[1:]:
        sibling.status = RequestStatus.FORK_PENDING
    seqs[0].pending_forks = seqs[1:]
    if params.prompt_logprobs:
        start = params.prompt_logprobs_start
        scores = PromptScores(start, len(prompt), params.top_logprobs, params.routed_experts)
        seqs[0].prompt_scores = scores
    return seqs
