"""Batched sampling with per-row parameters and no host sync.

Order of operations per row (it defines the logprobs callers get, docs/service.md):
  raw logits -> penalties (repetition, frequency, presence) and min_tokens suppression
  -> divide by temperature (greedy counts as 1)         => "processed" logits, logprobs here
  -> top-k, top-p, min-p truncation -> sample (greedy rows: argmax of processed logits).

Randomness is counter-based: row noise is a hash of (request seed, output index, token id),
so a seeded request samples the same tokens whatever else is batched with it, and resumes
identically after preemption. Sampling is the exponential race: argmax(p / E), E ~ Exp(1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for one step, built on the host, tensors on the device."""

    # [rows] float; 0 = greedy. NOTE: 0 exactly: the model runner writes 0 for every row whose
    # params are `greedy` (a tiny temperature included), so the rule lives in SamplingParams.
    temperature: torch.Tensor
    seeds: torch.Tensor  # [rows, 2] int64: low and high 32 bits of each request's seed
    counters: torch.Tensor  # [rows] int64: index of the token being sampled
    top_k: torch.Tensor | None = None  # [rows] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None = None  # [rows] float
    min_p: torch.Tensor | None = None  # [rows] float
    penalties: torch.Tensor | None = None  # [rows, 3]: repetition, frequency, presence
    output_ids: torch.Tensor | None = None  # [rows, max_out] padded with vocab_size
    context_ids: torch.Tensor | None = None  # [rows, max_ctx] prompt+output, padded likewise
    suppress: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) to ban
    all_greedy: bool = False
    num_top_logprobs: int = 0  # max over rows; 0 = none
    logprobs: bool = False  # any row wants logprobs (processed)
    raw_logprobs: bool = False  # any row wants raw logprobs
    raw_rows: torch.Tensor | None = None  # [rows] bool: this row wants raw logprobs


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [rows] int64
    logprobs: torch.Tensor | None  # [rows] float32
    top_ids: torch.Tensor | None  # [rows, k] int64
    top_logprobs: torch.Tensor | None  # [rows, k] float32


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits  # [rows, vocab] float32
        logits = self._apply_penalties(logits, batch)
        if batch.suppress is not None:
            banned = torch.full((), float("-inf"), device=logits.device)
            logits = logits.index_put(batch.suppress, banned)
        temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
        logits = logits / temperature[:, None]  # processed logits

        logprobs = self._logprobs(raw, logits, batch)
        greedy = logits.argmax(dim=-1)
        if batch.all_greedy:
            token_ids = greedy
        else:
            probs = torch.softmax(self._truncate(logits, batch), dim=-1)
            noise = -torch.log(_uniform(batch.seeds, batch.counters, logits.shape[-1]))
            sampled = (probs / noise).argmax(dim=-1)
            token_ids = torch.where(batch.temperature > 0, sampled, greedy)

        if logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
        top_ids = top_lps = None
        if batch.num_top_logprobs:
            top_lps, top_ids = logprobs.topk(batch.num_top_logprobs, dim=-1)
        return SamplerOutput(token_ids, chosen, top_ids, top_lps)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.penalties is None:
            return logits
        assert batch.output_ids is not None and batch.context_ids is not None
        rows, vocab = logits.shape
        repetition, frequency, presence = batch.penalties.unbind(-1)
        # Counts over vocab + 1 columns: the last one soaks up padding.
        counts = torch.zeros(rows, vocab + 1, device=logits.device)
        counts.scatter_add_(
            1, batch.output_ids, torch.ones_like(batch.output_ids, dtype=counts.dtype)
        )
        counts = counts[:, :vocab]
        seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, batch.context_ids, True)
        seen = seen[:, :vocab]
        penalised = torch.where(
            logits > 0, logits / repetition[:, None], logits * repetition[:, None]
        )
        logits = torch.where(seen, penalised, logits)
        return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, processed: torch.Tensor, batch: SamplingBatch
    ) -> torch.Tensor | None:
        if not (batch.logprobs or batch.raw_logprobs):
            return None
        if not batch.raw_logprobs:
            return torch.log_softmax(processed, dim=-1)
        raw_lp = torch.log_softmax(raw, dim=-1)
        if not batch.logprobs:
            return raw_lp
        assert batch.raw_rows is not None
        return torch.where(batch.raw_rows[:, None], raw_lp, torch.log_softmax(processed, dim=-1))

    @staticmethod
    def _truncate(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        neg_inf = float("-inf")
        if batch.top_k is not None or batch.top_p is not None:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            if batch.top_k is not None:
                vocab = logits.shape[-1]
                k = torch.where(batch.top_k > 0, batch.top_k, vocab)
                ranks = torch.arange(vocab, device=logits.device)
                sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], neg_inf)
            if batch.top_p is not None:
                probs = torch.softmax(sorted_logits, dim=-1)
                # Drop a token when the tokens ranked above it already reach top_p.
                above = probs.cumsum(dim=-1) - probs
                sorted_logits = sorted_logits.masked_fill(above > batch.top_p[:, None], neg_inf)
            logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
        if batch.min_p is not None:
            probs = torch.softmax(logits, dim=-1)
            floor = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < floor, neg_inf)
        return logits


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 without int64 overflow: split c into 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _uniform(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) noise [rows, vocab], a pure function of (seed, counter, token id)."""
    row = _fmix32(seeds[:, 1] ^ _fmix32(seeds[:, 0] ^ _fmix32(counters & _MASK32)))
    # Token ids times an odd constant (a bijection mod 2**32) spread over all 32 bits; one
    # finaliser round over [rows, vocab], the one tensor that is large.
    cols = _mul32(torch.arange(vocab, device=seeds.device), 0x9E3779B9)
    bits = _fmix32(row[:, None] ^ cols[None, :])
    return ((bits >> 8).float() + 0.5) / float(1 << 24)
