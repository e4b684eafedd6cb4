"""GrammarMask: a step's allowed-token bitmask for its constrained rows.

Filled once, by whichever thread asks first: the host right after the step is launched, so that
xgrammar's work overlaps the forward pass (on CUDA the forward is queued; on the CPU it runs on
the device thread), or the sampler when it needs the mask. Unconstrained rows allow every token.
"""

from __future__ import annotations

import threading

import torch

from engine.structured.request_grammar import RequestGrammar


class GrammarMask:
    def __init__(
        self,
        rows: list[tuple[int, RequestGrammar]],
        num_rows: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.rows = rows
        self.shape = (num_rows, (vocab_size + 31) // 32)
        self.device = device
        self._lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None

    def fill(self) -> None:
        """Compute the mask (once; a second caller waits for the first)."""
        with self._lock:
            if self._bitmask is not None:
                return
            bitmask = torch.full(self.shape, -1, dtype=torch.int32)
            for row, grammar in self.rows:
                grammar.fill(bitmask, row)
            self._bitmask = bitmask.to(self.device, non_blocking=True)

    def bitmask(self) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32 on the device: bit i of word w allows token 32w + i."""
        self.fill()
        assert self._bitmask is not None
        return self._bitmask
