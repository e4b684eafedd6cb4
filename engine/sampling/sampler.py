"""Batched sampling with per-row parameters and no host sync: the torch reference.

Order of operations per row (it defines the logprobs callers get, docs/service.md):
  raw logits -> the sampling surface (allowed ids, bad ids and words, logit bias:
  engine/sampling/surface.py) -> penalties (repetition, frequency, presence) and min_tokens
  suppression
  -> divide by temperature (greedy counts as 1)         => "processed" logits, logprobs here
  -> top-k, top-p, min-p truncation -> sample (greedy rows: argmax of processed logits).
Logprob modes: RAW (the raw logits' log-softmax), PROCESSED (the default, above) and SAMPLED:
the processed logits renormalised over the kept tokens, the distribution the token was drawn
from (a greedy row's is the point mass on its argmax: logprob 0). The kept tokens themselves
(the sampling support) come back on request: [argmax] for a greedy row, nothing for a row that
truncates nothing (every token), else every kept id, most likely first.

Randomness is counter-based: row noise is a hash of (request seed, output index, token id),
so a seeded request samples the same tokens whatever else is batched with it, and resumes
identically after preemption. Sampling is the exponential race: argmax(w / E) over the kept
tokens, w = exp(logit - max), E ~ Exp(1).

Every decision (the kept set, the race, top logprob ids) is computed with the reproducible
arithmetic of engine/sampling/sampling_math.py, so the fused kernels
(engine/sampling/fused_sampler.py) pick exactly these tokens. On the CPU the exp weights and the
race run as two C passes (engine/sampling/cpu_race.py) that compute the same bits. The logits may come in the
model's dtype; everything is float32 from the first operation on. Ties: top-k keeps every token tied
with the k-th (as Hugging Face's warper does); top-p keeps or drops a group of tied tokens
together; the race and greedy take the lowest token id among equal scores; top logprobs list
equal logits by token id.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.sampling import cpu_race
from engine.sampling.sampling_math import (
    MASS_SCALE,
    exp_weights,
    exponential_noise,
    order_keys,
    top_ids,
    uniform,
)
from engine.sampling.surface import TokenBitmask, apply_surface

__all__ = ["NO_TOKEN", "Sampler", "SamplerOutput", "SamplingBatch", "uniform"]

# The id a row gets when no token is possible: every processed logit is -inf (its allowed ids,
# bans, logit bias, min_tokens and grammar left nothing). Never a token id; the host ends such a
# row's request with ERROR (engine/core/postprocess.py).
NO_TOKEN = -2

FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "repetition", "frequency", "presence")
INT_COLUMNS = ("seed_low", "seed_high", "counter", "top_k", "output_start")


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for one step, built on the host, tensors on the device.

    `floats` [rows, 6] float32: temperature (0 exactly = greedy: the model runner writes 0 for
    every row whose params are `greedy`), top_p, min_p, repetition, frequency and presence
    penalties. `ints` [rows, 5] int64: the seed's low and high 32 bits, the output index of the
    token being sampled (the noise counter), top_k (0 = off), and the column of `context_ids`
    where the row's output starts. The flags say which options any row uses.
    """

    floats: torch.Tensor
    ints: torch.Tensor
    context_ids: torch.Tensor | None = None  # [rows, width] prompt+output, padded with vocab
    suppress_ids: torch.Tensor | None = None  # [rows, width] ids to ban, padded with vocab
    all_greedy: bool = False
    use_top_k: bool = False
    use_top_p: bool = False
    use_min_p: bool = False
    use_penalties: bool = False  # then context_ids is set
    num_top_logprobs: int = 0  # max over rows; 0 = none
    logprobs: bool = False  # any row wants logprobs (processed)
    raw_logprobs: bool = False  # any row wants raw logprobs
    raw_rows: torch.Tensor | None = None  # [rows] bool, when both kinds are asked for
    sampled_logprobs: bool = False  # any row wants SAMPLED logprobs
    sampled_rows: torch.Tensor | None = None  # [rows] bool, when it is not the only kind
    support_width: int = 0  # sampling support ids returned per row; 0 = none asked for
    # The sampling surface (engine/sampling/surface.py), set only when some row has one:
    allowed_ids: torch.Tensor | None = None  # [rows, width] the only ids, padded with vocab
    allowed_rows: torch.Tensor | None = None  # [rows] bool: the rows allowed_ids restricts
    bias_ids: torch.Tensor | None = None  # [rows, width] ids, padded with vocab
    bias_values: torch.Tensor | None = None  # [rows, width] float32 added there (-inf: banned)
    grammar: TokenBitmask | None = None  # structured-output rows' allowed tokens

    @property
    def has_surface(self) -> bool:
        return any(x is not None for x in (self.allowed_ids, self.bias_ids, self.grammar))

    def surface(
        self,
    ) -> tuple[
        torch.Tensor | None,
        torch.Tensor | None,
        torch.Tensor | None,
        torch.Tensor | None,
        TokenBitmask | None,
    ]:
        """apply_surface's arguments after the logits."""
        return self.allowed_ids, self.allowed_rows, self.bias_ids, self.bias_values, self.grammar

    def column(self, name: str) -> torch.Tensor:
        if name in FLOAT_COLUMNS:
            return self.floats[:, FLOAT_COLUMNS.index(name)]
        return self.ints[:, INT_COLUMNS.index(name)]


@dataclass
class SamplerOutput:
    """What a step sampled, in one tensor so that one copy brings it to the host.

    Without logprobs or support `values` is [rows] int64 token ids. Else it is [rows, 2 + 2k
    (+ 1 + w)] float64 (exact for token ids and float32 logprobs): the token id, its logprob,
    the k top token ids, their logprobs (then the support's size, -1 for every token, and its
    first w ids, padded with -1). A row with no possible token has the id NO_TOKEN (its other
    columns mean nothing).
    """

    values: torch.Tensor
    num_top_logprobs: int = 0
    support_width: int = 0

    def unpack(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(token ids, logprobs, top ids, top logprobs) as tensors: for tests and tools."""
        if self.values.dim() == 1:
            return self.values, None, None, None
        k = self.num_top_logprobs
        v = self.values
        top = (v[:, 2 : 2 + k].long(), v[:, 2 + k : 2 + 2 * k].float()) if k else (None, None)
        return v[:, 0].long(), v[:, 1].float(), *top


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        # The logits in the model's dtype; every step from here is float32 (the fused kernels
        # upcast at the same point, as they load).
        raw = logits = logits.float()  # [rows, vocab]
        sampled = batch.column("temperature") > 0
        if batch.has_surface:
            logits = apply_surface(logits, *batch.surface())
        logits = self._processed(logits, batch)
        native = cpu_race.usable(logits)  # the same numbers, from one C pass each
        # The lowest id among equal maxima.
        greedy = cpu_race.argmax(logits) if native else logits.argmax(dim=-1)
        kept = None
        if batch.all_greedy:
            token_ids = greedy
        else:
            row_max = logits.amax(dim=-1, keepdim=True)
            if native:
                weights = cpu_race.exp_weights(logits, row_max[:, 0])
            else:
                weights = exp_weights(logits - row_max)
            kept = self._kept(logits, weights, batch)
            if native:
                seeds, counters = batch.ints[:, :2], batch.column("counter")
                raced = cpu_race.race(weights, kept, seeds, counters, sampled)
            else:
                raced = self._race(logits, weights, kept, batch)
            token_ids = torch.where(sampled, raced, greedy)
        # The argmax's processed logit is -inf only when every one is: no token is possible.
        # (token_ids stay valid ids below: they index the logprobs.) [rows], on the device.
        impossible = logits.gather(1, greedy[:, None])[:, 0] == float("-inf")
        out_ids = torch.where(impossible, NO_TOKEN, token_ids)
        support = None
        if batch.sampled_logprobs or batch.support_width:
            # The tokens each row could draw: its kept ones, a greedy row's argmax.
            argmax = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, greedy[:, None], True)
            everything = kept if kept is not None else torch.ones_like(argmax)
            support = torch.where(sampled[:, None], everything, argmax)
        sources = self._sources(raw, logits, support, batch)
        if sources is None and not batch.support_width:
            return SamplerOutput(out_ids)
        parts = [out_ids[:, None]]
        if sources is not None:
            logprobs = torch.log_softmax(sources, dim=-1)
            parts.append(logprobs.gather(-1, token_ids[:, None]))
            if batch.num_top_logprobs:
                top = top_ids(sources, batch.num_top_logprobs)
                parts += [top, logprobs.gather(-1, top)]
        else:
            parts.append(torch.zeros_like(parts[0]))  # logprob column unused
        if batch.support_width:
            assert support is not None
            parts += self._support(logits, support, sampled, batch)
        values = torch.cat([p.to(torch.float64) for p in parts], dim=1)
        k = batch.num_top_logprobs if sources is not None else 0
        return SamplerOutput(values, k, batch.support_width)

    @staticmethod
    def _processed(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Penalties, suppression, temperature: the logits a row samples from."""
        rows, vocab = logits.shape
        if batch.use_penalties:
            ids = batch.context_ids
            assert ids is not None
            repetition, frequency, presence = batch.floats[:, 3:].unbind(-1)
            # Only the output counts for frequency and presence; the prompt too for repetition.
            positions = torch.arange(ids.shape[1], device=ids.device)
            is_output = positions[None, :] >= batch.column("output_start")[:, None]
            # Over vocab + 1 columns: the last one soaks up padding.
            counts = torch.zeros(rows, vocab + 1, device=logits.device)
            counts = counts.scatter_add_(1, ids, is_output.to(counts.dtype))[:, :vocab]
            seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
            seen = seen.scatter_(1, ids, True)[:, :vocab]
            penalised = torch.where(
                logits > 0, logits / repetition[:, None], logits * repetition[:, None]
            )
            logits = torch.where(seen, penalised, logits)
            logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
        if batch.suppress_ids is not None:
            banned = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
            banned = banned.scatter_(1, batch.suppress_ids, True)[:, :vocab]
            logits = logits.masked_fill(banned, float("-inf"))
        if batch.all_greedy:  # every temperature counts as 1: the division would be a copy
            return logits
        temperature = batch.column("temperature")
        return logits / torch.where(temperature > 0, temperature, 1.0)[:, None]

    @staticmethod
    def _sources(
        raw: torch.Tensor,
        processed: torch.Tensor,
        support: torch.Tensor | None,
        batch: SamplingBatch,
    ) -> torch.Tensor | None:
        """The logits each row's logprobs are the log-softmax of (raw, processed, or processed
        outside the support set to -inf), or None when no row asks for logprobs."""
        if not (batch.logprobs or batch.raw_logprobs or batch.sampled_logprobs):
            return None
        source = processed
        if batch.raw_logprobs:
            rows = batch.raw_rows
            source = raw if rows is None else torch.where(rows[:, None], raw, source)
        if batch.sampled_logprobs:
            assert support is not None
            truncated = processed.masked_fill(~support, float("-inf"))
            rows = batch.sampled_rows
            source = truncated if rows is None else torch.where(rows[:, None], truncated, source)
        return source

    @staticmethod
    def _support(
        logits: torch.Tensor, support: torch.Tensor, sampled: torch.Tensor, batch: SamplingBatch
    ) -> list[torch.Tensor]:
        """[size, w ids] per row: the support's size (-1: every token, a row that truncates
        nothing) and its first w ids, most likely first, padded with -1."""
        size = support.sum(dim=-1)
        truncates = ~sampled | (batch.column("top_k") > 0)
        truncates |= (batch.column("top_p") < 1.0) | (batch.column("min_p") > 0.0)
        size = torch.where(truncates, size, -1)
        ids = top_ids(logits.masked_fill(~support, float("-inf")), batch.support_width)
        position = torch.arange(batch.support_width, device=logits.device)
        ids = torch.where(position[None, :] < size[:, None], ids, -1)
        return [size[:, None], ids]

    @classmethod
    def _kept(
        cls, logits: torch.Tensor, weights: torch.Tensor, batch: SamplingBatch
    ) -> torch.Tensor | None:
        """[rows, vocab] bool: the tokens top-k, top-p and min-p keep; None when none is on."""
        kept = None
        if batch.use_top_k or batch.use_top_p:
            kept = order_keys(logits) >= cls._threshold(logits, weights, batch)
        if batch.use_min_p:
            # The row max has weight 1 exactly, so this is p >= min_p * max p.
            above = weights >= batch.column("min_p")[:, None]
            kept = above if kept is None else kept & above
        return kept

    @staticmethod
    def _race(
        logits: torch.Tensor, weights: torch.Tensor, kept: torch.Tensor | None, batch: SamplingBatch
    ) -> torch.Tensor:
        """The exponential race over the kept tokens: [rows] token ids."""
        seeds = batch.ints[:, :2]
        noise = exponential_noise(seeds, batch.column("counter"), logits.shape[-1])
        scores = weights / noise
        if kept is not None:
            scores = torch.where(kept, scores, -1.0)
        return scores.argmax(dim=-1)  # the lowest id among equal scores

    @staticmethod
    def _threshold(
        logits: torch.Tensor, weights: torch.Tensor, batch: SamplingBatch
    ) -> torch.Tensor:
        """[rows, 1]: the least order key top-k and top-p keep.

        top-k keeps the keys >= the k-th largest key. top-p then keeps a token when the mass
        of the kept tokens strictly above it is at most top_p times their total mass, masses
        being q = floor(weight * 2^32) summed exactly in int64; tied tokens share that mass
        above, so they are kept or dropped together.
        """
        if logits.device.type == "cpu":
            return _prefix_threshold(logits, weights, batch)
        return _sorted_threshold(logits, weights, batch)


def _sorted_threshold(
    logits: torch.Tensor, weights: torch.Tensor, batch: SamplingBatch
) -> torch.Tensor:
    """Sampler._threshold over each row sorted whole."""
    vocab = logits.shape[-1]
    sorted_keys, order = order_keys(logits).sort(dim=-1, descending=True)
    k = torch.full_like(batch.column("top_k"), vocab)
    if batch.use_top_k:
        top_k = batch.column("top_k")
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    threshold = sorted_keys.gather(-1, k[:, None] - 1)
    if not batch.use_top_p:
        return threshold
    in_top_k = sorted_keys >= threshold
    mass = torch.floor(weights * MASS_SCALE).long().gather(-1, order)
    mass = torch.where(in_top_k, mass, 0)
    above = mass.cumsum(dim=-1) - mass
    limit = batch.column("top_p").double() * mass.sum(dim=-1).double()
    kept = (above.double() <= limit[:, None]) & in_top_k  # a prefix of the sorted row
    return sorted_keys.gather(-1, kept.sum(dim=-1, keepdim=True) - 1)


PREFIX = 128  # the sorted prefix the CPU's threshold looks at before it sorts a whole row


def _prefix_threshold(
    logits: torch.Tensor, weights: torch.Tensor, batch: SamplingBatch
) -> torch.Tensor:
    """Sampler._threshold from each row's largest keys only, for the CPU, where sorting every
    row of the vocabulary is most of a sampled step: the same thresholds as a whole sort.

    top-k needs the k-th largest key, which topk(m) gives for k <= m. top-p's kept tokens are
    a prefix of the sorted row: when the prefix of the m largest keys holds its end (a token
    of the top-k set whose mass above passes the limit, or the end of the top-k set), that
    end is the whole sort's too (tied keys have equal masses, so their order inside the
    prefix changes no sum that decides). The total mass is summed over the whole row. Rows
    whose end lies beyond the prefix are sorted whole (a host check: free on the CPU).
    """
    vocab = logits.shape[-1]
    keys = order_keys(logits)
    top_k = batch.column("top_k") if batch.use_top_k else torch.zeros_like(batch.column("top_k"))
    m = min(vocab, max(PREFIX, int(top_k.max())))
    top_keys, top_ids = keys.topk(m, dim=-1)  # the m largest keys, descending
    cut = (top_k > 0) & (top_k <= m)
    kth = top_keys.gather(-1, (top_k.clamp(min=1, max=m) - 1)[:, None])
    threshold = torch.where(cut[:, None], kth, keys.min(dim=-1, keepdim=True).values)
    if not batch.use_top_p:
        return threshold
    in_top_k = keys >= threshold
    mass = torch.floor(weights * MASS_SCALE).long()
    limit = batch.column("top_p").double() * torch.where(in_top_k, mass, 0).sum(dim=-1).double()
    top_in = top_keys >= threshold
    top_mass = torch.where(top_in, mass.gather(-1, top_ids), 0)
    above = top_mass.cumsum(dim=-1) - top_mass
    kept = ((above.double() <= limit[:, None]) & top_in).sum(dim=-1)
    truncating = batch.column("top_p") < 1.0  # else top-p keeps the whole top-k set
    resolved = ~truncating | (kept < m) | (in_top_k.sum(dim=-1) <= m)
    threshold = torch.where(
        truncating[:, None], top_keys.gather(-1, (kept - 1)[:, None]), threshold
    )
    if not bool(resolved.all()):
        rows = (~resolved).nonzero()[:, 0]
        sub = replace(batch, floats=batch.floats[rows], ints=batch.ints[rows])
        threshold[rows] = _sorted_threshold(logits[rows], weights[rows], sub)
    return threshold
