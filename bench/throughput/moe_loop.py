"""A bench-only variant of the MoE layer: the per-expert loop, for bench/throughput/offline.py's
`--moe-loop`.

The engine's torch path (engine/moe/experts.py, StackedExperts) sorts the (token, choice) pairs
by expert once, gathers the tokens once, runs one GEMM per expert over a contiguous slice and
adds everything back with one index_add. This variant is the loop transformers runs (and the
engine would without grouping): for every expert, find its (token, choice) pairs with a mask,
gather them, run its MLP, scale and add back, one gather and one scatter per expert. Same
weights, same routing; the sums are in another order, so sampled tokens may differ in the last
bits. `per_expert_loop()` swaps it in for the engines built and run inside it (in this process).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.layers.linear import linear
from engine.moe.experts import StackedExperts


@contextmanager
def per_expert_loop() -> Iterator[None]:
    """StackedExperts run the per-expert loop inside the block."""
    original = StackedExperts.forward
    StackedExperts.forward = _loop_forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        StackedExperts.forward = original  # type: ignore[method-assign]


def _loop_forward(
    self: StackedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros_like(x)
    gate_up, down = self._expert_views()
    hit = torch.unique(ids).tolist()  # as transformers: only the experts with tokens
    for e in hit:
        token, choice = torch.where(ids == e)
        g, u = linear(x[token], gate_up[e], None).chunk(2, dim=-1)
        y = linear(self.act(g, u), down[e], None)
        out.index_add_(0, token, (y * weights[token, choice, None]).to(x.dtype))
    return out
