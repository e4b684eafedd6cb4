"""The sampling surface: logit_bias, allowed_token_ids, bad_token_ids and bad words, applied to
the float32 logits before either sampler's first step (penalties), as vLLM v1 does.

Both samplers call `apply_surface` on the same float32 logits, so the fused kernels see exactly
the torch Sampler's numbers and pick its tokens. The torch Sampler keeps the logits it had
before for raw logprobs (the model's unmodified logits); the fused one does not separate them,
so a step asking for raw logprobs with a surface runs the torch one (sampler_choice.py).

Per row: tokens outside `allowed_ids` (when the row has any) become -inf, then `bias_values`
are added at `bias_ids` (bans are -inf entries: bad_token_ids, one-token bad words, and the
last token of each longer bad word whose prefix the output ends with). Two scatters and two
element-wise ops over [rows, vocab], whatever the number of entries. Last, a structured-output
constraint's bitmask (engine/structured/) sets every token it does not allow to -inf.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TokenBitmask(Protocol):
    """A step's allowed tokens, packed (engine/structured/grammar_mask.py)."""

    def fill(self) -> None:
        """Compute them now, if not done yet."""
        ...

    def bitmask(self) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32: bit i of word w allows token 32w + i."""
        ...


def apply_surface(
    logits: torch.Tensor,
    allowed_ids: torch.Tensor | None,
    allowed_rows: torch.Tensor | None,
    bias_ids: torch.Tensor | None,
    bias_values: torch.Tensor | None,
    grammar: TokenBitmask | None = None,
) -> torch.Tensor:
    """`logits` ([rows, vocab] float32) with a SamplingBatch's surface applied (its fields of
    these names); the same tensor when it has none."""
    rows, vocab = logits.shape
    if allowed_ids is not None:
        assert allowed_rows is not None
        # Over vocab + 1 columns: the last one soaks up padding.
        allowed = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
        allowed = allowed.scatter_(1, allowed_ids, True)[:, :vocab]
        allowed |= ~allowed_rows[:, None]
        logits = logits.masked_fill(~allowed, float("-inf"))
    if bias_ids is not None:
        assert bias_values is not None
        bias = torch.zeros(rows, vocab + 1, device=logits.device)
        bias = bias.scatter_add_(1, bias_ids, bias_values)[:, :vocab]
        logits = logits + bias  # x + 0 is x: untouched tokens keep their logit exactly
    if grammar is not None:
        logits = logits.masked_fill(~unpack_bitmask(grammar.bitmask(), vocab), float("-inf"))
    return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bits -> [rows, vocab] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.bool().reshape(bitmask.shape[0], -1)[:, :vocab]
