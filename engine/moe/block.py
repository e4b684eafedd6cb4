"""SparseMoeBlock: a decoder layer's mixture-of-experts feed-forward (router, stacked experts,
and Qwen2-MoE's gated shared expert), as transformers computes it.

The family that uses it passes its checkpoint names (the experts' part names) and its rank's
sizes (from its sharding table); the block names its modules as the checkpoints do (`gate`,
`experts`, `shared_expert`, `shared_expert_gate`; gpt-oss's router is `router`, with a bias,
and its experts' tensors transformers' fused ones: engine/moe/experts.py). Tensor parallelism:
each rank's partial sum of routed and shared outputs is summed by one all-reduce, as a dense
MLP's down_proj is.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import linear
from engine.layers.merged_linear import MergedLinear
from engine.layers.silu_and_mul import SiluAndMul
from engine.moe.config import MoeConfig
from engine.moe.experts import StackedExperts, route
from engine.parallel.tensor_parallel import TensorParallel


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a dense MLP (this rank's slice) whose down projection is not
    all-reduced here; SparseMoeBlock sums it with the routed experts' partial sums."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": inter, "up_proj": inter}, False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return linear(self.act(gate, up), self.down_proj.weight, None)


class SparseMoeBlock(nn.Module):
    """A decoder layer's MoE feed-forward: router, stacked experts, optional shared expert.
    Module names are the checkpoint's (`gate` or the family's router name, `experts`,
    `shared_expert`, `shared_expert_gate`)."""

    def __init__(
        self,
        hidden: int,
        moe: MoeConfig,
        expert_size: int,
        shared_size: int,
        parts: tuple[str, str, str] | None,
        tp: TensorParallel,
        router: str = "gate",
    ) -> None:
        """`expert_size`, `shared_size`: this rank's intermediate size of each expert and of
        the shared expert (0: none); `parts`: the checkpoints' names of each expert's (gate,
        up, down) projections (None: transformers' fused tensors); `router`: the checkpoints'
        name of the router."""
        super().__init__()
        self.moe = moe
        self.tp = tp
        self.router_name = router
        # Replicated; registered under the checkpoint's name.
        self.add_module(router, nn.Linear(hidden, moe.num_experts, bias=moe.router_bias))
        self.experts = StackedExperts(
            moe.num_experts,
            hidden,
            expert_size,
            parts,
            bias=moe.expert_bias,
            swiglu=moe.clamped_swiglu,
            adds_down_bias=tp.rank == 0,
        )
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(hidden, shared_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(
        self, x: torch.Tensor, routing: list[torch.Tensor] | None = None
    ) -> torch.Tensor:  # [tokens, hidden] -> same
        """`routing`, when given, gains this layer's expert ids [tokens, top_k] (the routed
        experts a request asked for: engine/moe/routed_experts.py)."""
        router = cast(nn.Linear, self.get_submodule(self.router_name))
        weights, ids = route(linear(x, router.weight, router.bias), self.moe)
        if routing is not None:
            routing.append(ids)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            scale = F.sigmoid(linear(x, self.shared_expert_gate.weight, None))  # [tokens, 1]
            out = out + scale * self.shared_expert(x)
        return self.tp.all_reduce(out)
