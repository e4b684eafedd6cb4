"""Turns a scheduled batch into one packed forward pass and samples the next tokens.

Every request in the batch feeds `query_len` tokens starting at its `num_computed_tokens`;
those that reach the end of their tokens get their last position's logits sampled. Only
those rows go through the LM head. One device-to-host copy per step brings back the
sampled ids (and logprobs when any row asked for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.torch_ref import AttentionMetadata, prepare
from engine.models.llama import LlamaForCausalLM
from engine.page_pool import PagePool
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput, SamplingBatch
from engine.scheduler import ScheduledBatch


@dataclass
class Sampled:
    """The tokens sampled this step, one per sampling request, on the host."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: PagePool,
        device: torch.device,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.vocab_size = model.config.vocab_size
        self.kv_caches = pool.layer_caches()
        self.sampler = Sampler()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> Sampled:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []
        context_lens: list[int] = []
        page_size = self.pool.page_size
        for req, num_tokens in zip(batch.requests, batch.query_lens, strict=True):
            start, end = req.num_computed_tokens, req.num_computed_tokens + num_tokens
            input_ids += req.token_ids[start:end]
            positions += range(start, end)
            slots += (
                req.pages[p // page_size] * page_size + p % page_size for p in range(start, end)
            )
            context_lens.append(end)
            if end == req.num_tokens:
                # Siblings (n > 1) sample their first tokens from the leader's last prompt row.
                for seq in [req, *req.pending_forks]:
                    sample_rows.append(len(input_ids) - 1)
                    sampling.append(seq)

        max_pages = max(len(r.pages) for r in batch.requests)
        tables = [r.pages + [0] * (max_pages - len(r.pages)) for r in batch.requests]
        meta = AttentionMetadata(
            query_lens=list(batch.query_lens),
            context_lens=context_lens,
            slot_mapping=self._tensor(slots),
            block_tables=self._tensor(tables),
        )
        prepare(meta, page_size, self.device)
        hidden = self.model(self._tensor(input_ids), self._tensor(positions), meta, self.kv_caches)
        if not sampling:
            return Sampled([], [], None, None, None)
        logits = self.model.compute_logits(hidden[self._tensor(sample_rows)])
        out = self.sampler(logits, self._sampling_batch(sampling))
        return self._to_host(sampling, out)

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _to_host(self, sampling: list[Request], out: SamplerOutput) -> Sampled:
        # NOTE: the step's only device-to-host copies happen here, after all work is queued.
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        return Sampled(sampling, token_ids, logprobs, top_ids, top_lps)

    def _sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        params = [r.params for r in reqs]
        dev = self.device

        def floats(values: list[float] | list[list[float]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=dev)

        sampled = [p for p in params if not p.greedy]
        batch = SamplingBatch(
            temperature=floats([p.temperature for p in params]),
            seeds=self._tensor([[r.seed & 0xFFFFFFFF, (r.seed >> 32) & 0xFFFFFFFF] for r in reqs]),
            counters=self._tensor([r.num_output_tokens for r in reqs]),
            all_greedy=not sampled,
            num_top_logprobs=max(p.top_logprobs for p in params),
            logprobs=any(p.logprobs and not p.raw_logprobs for p in params),
            raw_logprobs=any(p.logprobs and p.raw_logprobs for p in params),
        )
        if any(p.top_logprobs for p in params):
            batch.logprobs = batch.logprobs or any(not p.raw_logprobs for p in params)
            batch.raw_logprobs = batch.raw_logprobs or any(p.raw_logprobs for p in params)
        if batch.logprobs and batch.raw_logprobs:
            batch.raw_rows = torch.tensor([p.raw_logprobs for p in params], device=dev)
        if any(p.top_k > 0 for p in sampled):
            batch.top_k = self._tensor([p.top_k for p in params])
        if any(p.top_p < 1.0 for p in sampled):
            batch.top_p = floats([p.top_p for p in params])
        if any(p.min_p > 0.0 for p in sampled):
            batch.min_p = floats([p.min_p for p in params])
        if any(
            p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params
        ):
            batch.penalties = floats(
                [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params]
            )
            batch.output_ids = self._padded([r.output_token_ids for r in reqs])
            batch.context_ids = self._padded([r.token_ids for r in reqs])
        banned = [
            (row, token)
            for row, r in enumerate(reqs)
            if r.num_output_tokens < r.params.min_tokens
            for token in self._stop_ids(r)
        ]
        if banned:
            rows, tokens = zip(*banned, strict=True)
            batch.suppress = (self._tensor(list(rows)), self._tensor(list(tokens)))
        return batch

    def _stop_ids(self, req: Request) -> tuple[int, ...]:
        eos = () if req.params.ignore_eos else self.eos_token_ids
        return eos + req.params.stop_token_ids

    def _padded(self, rows: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(r) for r in rows))
        return self._tensor([r + [self.vocab_size] * (width - len(r)) for r in rows])
