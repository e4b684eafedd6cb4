"""FixedBitmask: a structured-output mask given outright, as engine/structured/grammar_mask.py
hands one to the samplers (SamplingBatch.grammar), for sampler tests without a grammar."""

from __future__ import annotations

import torch


class FixedBitmask:
    def __init__(self, bits: torch.Tensor) -> None:
        self.bits = bits  # [rows, ceil(vocab / 32)] int32

    def fill(self) -> None:
        pass

    def bitmask(self) -> torch.Tensor:
        return self.bits
