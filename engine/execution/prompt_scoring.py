"""Prompt logprobs on the device: the scored rows of a step through the LM head, in slices.

A step's scored rows (engine/scheduling/prompt_scores.py says which) follow its sampled rows
in the gathered hidden states. Each row's logits are divided by its request's temperature (1
when greedy; the raw logits in logprob mode RAW: no penalties, no truncation) and log-softmaxed;
the result packs, per row, the logprob of the next prompt token and the k top ids and their
logprobs (ranked as the sampler ranks top logprobs) into one float64 tensor, so one copy
brings it to the host.

The LM head runs over at most SLICE_ELEMENTS logits at a time: a 2048-token chunk of a 152k
vocabulary would otherwise hold 1.2 GB of float32 logits at once. Every tensor-parallel rank
makes the same LM-head calls (`follow_scored_rows`): each one gathers the vocabulary across
ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.models.base import CausalLM
from engine.protocol.messages import LogprobMode
from engine.sampling.sampling_math import top_ids
from engine.scheduling.prompt_scores import ScoreSpan
from engine.scheduling.request import Request

SLICE_ELEMENTS = 1 << 25  # logits per LM-head call when scoring: 128 MiB of float32


@dataclass(frozen=True)
class ScoredRows:
    """What a step scores: one span per request, and each row's target and divisor (device)."""

    spans: list[tuple[Request, ScoreSpan]]
    targets: torch.Tensor  # [rows] int64: the prompt token each row scores
    divisors: torch.Tensor | None  # [rows] float32: the temperature, or 1; None: all 1
    num_top: int  # top logprobs per row: the most any of the requests asks for

    @property
    def num_rows(self) -> int:
        return self.targets.shape[0]

    @classmethod
    def build(cls, spans: list[tuple[Request, ScoreSpan]], device: torch.device) -> ScoredRows:
        targets: list[int] = []
        divisors: list[float] = []
        for req, span in spans:
            targets += req.token_ids[span.first : span.first + span.count]
            p = req.params
            raw = p.greedy or p.mode is LogprobMode.RAW
            divisors += [1.0 if raw else p.temperature] * span.count
        return cls(
            spans,
            torch.tensor(targets, dtype=torch.int64).to(device, non_blocking=True),
            (
                torch.tensor(divisors, dtype=torch.float32).to(device, non_blocking=True)
                if any(d != 1.0 for d in divisors)
                else None
            ),
            max(req.params.top_logprobs for req, _ in spans),
        )


def score_rows(model: CausalLM, hidden: torch.Tensor, rows: ScoredRows) -> torch.Tensor:
    """[rows, 1 + 2k] float64: per scored row (its hidden state in `hidden`), the target's
    logprob, then the k top ids, then their logprobs."""
    k, parts = rows.num_top, []
    for start, logits in _sliced_logits(model, hidden):
        end = start + logits.shape[0]
        if rows.divisors is not None:
            logits = logits / rows.divisors[start:end, None]
        logprobs = torch.log_softmax(logits, dim=-1)
        columns = [logprobs.gather(-1, rows.targets[start:end, None])]
        if k:
            ids = top_ids(logits, k)
            columns += [ids, logprobs.gather(-1, ids)]
        parts.append(torch.cat([c.to(torch.float64) for c in columns], dim=1))
    return torch.cat(parts)


def follow_scored_rows(model: CausalLM, hidden: torch.Tensor) -> None:
    """A worker rank's part of score_rows: the same LM-head calls, results unused."""
    for _ in _sliced_logits(model, hidden):
        pass


def _sliced_logits(model: CausalLM, hidden: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    step = max(1, SLICE_ELEMENTS // model.config.vocab_size)
    for start in range(0, hidden.shape[0], step):
        yield start, model.compute_logits(hidden[start : start + step])
