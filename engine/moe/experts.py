"""The experts of a mixture-of-experts feed-forward (Qwen2-MoE, Qwen3-MoE, Mixtral), and the
routing that picks them, as transformers computes it.

A router (`gate`, [experts, hidden]: engine/moe/block.py) scores every token; each token goes
to its top-k experts (`route`), and its output is the routing-weighted sum of theirs.

Expert weights are stacked at load time: `StackedExperts.gate_up_proj` [experts, 2 * inter,
hidden] (each expert's gate rows, then its up rows, as MergedLinear stacks a dense MLP's) and
`down_proj` [experts, hidden, inter]. Checkpoints name each expert apart
(`mlp.experts.3.gate_proj.weight`; Mixtral `block_sparse_moe.experts.3.w1.weight`: the family
passes its names), so `checkpoint_tensors` names each expert's part by its checkpoint name, as a view of the stack:
loading and weight updates write through these views.
gpt-oss's checkpoints hold transformers' fused tensors instead (`mlp.experts.gate_up_proj`
[experts, hidden, 2 * inter], gate and up columns interleaved, and `down_proj` [experts, inter,
hidden], with `gate_up_proj_bias` and `down_proj_bias`): the stack keeps the gate/up rows in
that interleaved order, so each fused tensor is the transpose of its stack, again a view; its
activation (engine/moe/clamped_swiglu.py) reads gate and up as the even and odd columns.

The forward groups the (token, choice) pairs by expert (one sort) and runs each expert that has
tokens as one GEMM over all of them, never a loop over tokens. The torch path (the reference,
and the CPU's) loops over the experts with tokens and reads the per-expert counts on the host.
The Triton path (chosen with the layer kernels: engine/layers/kernel_choice.py, CUDA only) runs
each projection for every expert in one grouped-GEMM launch (engine/layers/grouped_gemm_kernel.py)
whose grid depends on the token count alone: no host sync, so decode steps of MoE models are
CUDA-graph captured with it (engine/execution/cuda_graph.py).

Tensor parallelism: every expert is split on its intermediate dimension (the family's sharding
table: engine/models/sharding.py); the block sums the ranks' partial outputs. The routing
weights are per-token scalars that every rank computes whole, so scaling before the sum is
exact.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.layers.linear import linear
from engine.layers.silu_and_mul import SiluAndMul
from engine.moe.clamped_swiglu import ClampedSwiGLU
from engine.moe.config import MoeConfig
from engine.moe.packed_experts import packed_stack, register_packed


def route(logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), each [tokens, top_k], highest weight first, from the router's
    logits [tokens, experts] (in the model's dtype): softmax in float32, top-k, renormalised if
    `norm_topk_prob`, then cast back to the logits' dtype unless `weights_in_float32`; with
    `softmax_after_topk` (gpt-oss), the top-k logits, then their softmax in the logits' dtype."""
    if moe.softmax_after_topk:
        top, ids = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not moe.weights_in_float32:
        weights = weights.to(logits.dtype)
    return weights, ids


class StackedExperts(nn.Module):
    """Every expert's gate/up and down weights (this rank's slice of each), stacked."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        parts: tuple[str, ...] | None,
        act: nn.Module | None = None,
        bias: bool = False,
        swiglu: tuple[float, float] | None = None,
        adds_down_bias: bool = True,
    ) -> None:
        """`parts`: the checkpoints' names of each expert's (gate, up, down) projections; None:
        transformers' fused tensors (gpt-oss), gate/up rows interleaved. `act`: the gate's
        activation times up, `act(gate, up)` (SiluAndMul unless given: Gemma 4's experts pass
        GeLU-tanh's). `bias`: every projection has a bias per expert; `adds_down_bias`: this
        rank adds the down bias (under tensor parallelism one rank does: each rank's output is
        a partial sum). `swiglu`: (alpha, limit) of a clamped SwiGLU instead of SiLU(gate) * up."""
        super().__init__()
        self.inter = inter
        self.parts = parts  # checkpoint names of (gate, up, down); None: the fused tensors
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * inter))
            self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden))
        self.adds_down_bias = bias and adds_down_bias
        if act is None:
            act = SiluAndMul() if swiglu is None else ClampedSwiGLU(*swiglu)
        self.act = act
        self.triton = False  # the grouped-GEMM kernel (engine/layers/grouped_gemm_kernel.py)
        self.packed = False  # the stacks in MXFP4 (keep_mxfp4)
        self._packed_shapes: dict[str, tuple[int, int, int]] = {}  # their checkpoint shapes
        matrices = self.checkpoint_tensors().values() if parts else self._matrices()
        for view in matrices:  # as nn.Linear initialises each
            if view.dim() == 2:  # the weights, not the biases (zeros)
                nn.init.kaiming_uniform_(view, a=math.sqrt(5))
        # Per-expert views, rebuilt when the parameters' storage moves (to_empty, sleep):
        # `linear` caches a packed CPU copy on the weight tensor it is given, so it must be
        # given the same tensor every step.
        self._views: tuple[tuple[int, int], list[torch.Tensor], list[torch.Tensor]] | None = None

    def keep_mxfp4(self) -> None:
        """Hold both stacks in MXFP4 (engine/moe/packed_experts.py), on the Triton path only:
        at build, on the meta device, after the dtype cast. The dense stacks shrink to
        [experts, 0, 0]; `checkpoint_tensors` then names each stack by a meta tensor of its
        checkpoint shape (there is no served value to view)."""
        assert self.parts is None and self.triton, "packed experts: gpt-oss's, on Triton"
        stacks = {"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj}
        shapes = {name: (w.shape[1], w.shape[2]) for name, w in stacks.items()}
        weight = self.gate_up_proj
        register_packed(self, weight.shape[0], shapes, weight.device)
        self.packed = True
        for name in stacks:
            empty = torch.empty(weight.shape[0], 0, 0, dtype=weight.dtype, device=weight.device)
            setattr(self, name, nn.Parameter(empty, requires_grad=False))
        self._packed_shapes = {name: (weight.shape[0], k, n) for name, (n, k) in shapes.items()}

    def _matrices(self) -> list[torch.Tensor]:
        return [*self.gate_up_proj.detach().unbind(0), *self.down_proj.detach().unbind(0)]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """`{expert}.{gate|up|down}.weight` (and `.bias`) -> that expert's part of the stack;
        fused (`parts` None): `gate_up_proj`, `down_proj` (the stacks' transposes),
        `gate_up_proj_bias`, `down_proj_bias`. Views sharing the stacks' storage, outside
        autograd."""
        gate_up, down_w = self.gate_up_proj.detach(), self.down_proj.detach()
        gate_up_b, down_b = self.gate_up_proj_bias, self.down_proj_bias
        if self.parts is None:
            tensors = {"gate_up_proj": gate_up.transpose(1, 2), "down_proj": down_w.transpose(1, 2)}
            if self.packed:  # [experts, in, out], as the checkpoint's
                tensors = {
                    n: torch.empty(s, dtype=gate_up.dtype, device="meta")
                    for n, s in self._packed_shapes.items()
                }
            if gate_up_b is not None and down_b is not None:
                tensors |= {
                    "gate_up_proj_bias": gate_up_b.detach(),
                    "down_proj_bias": down_b.detach(),
                }
            return tensors
        gate, up, down = self.parts
        tensors = {}
        for e in range(gate_up.shape[0]):
            tensors[f"{e}.{gate}.weight"] = gate_up[e, : self.inter]
            tensors[f"{e}.{up}.weight"] = gate_up[e, self.inter :]
            tensors[f"{e}.{down}.weight"] = down_w[e]
            if gate_up_b is not None and down_b is not None:
                tensors[f"{e}.{gate}.bias"] = gate_up_b.detach()[e, : self.inter]
                tensors[f"{e}.{up}.bias"] = gate_up_b.detach()[e, self.inter :]
                tensors[f"{e}.{down}.bias"] = down_b.detach()[e]
        return tensors

    def forward(
        self,
        x: torch.Tensor,  # [tokens, hidden]
        weights: torch.Tensor,  # [tokens, top_k]
        ids: torch.Tensor,  # [tokens, top_k]
    ) -> torch.Tensor:  # [tokens, hidden]: sum over k of weights[:, k] * expert ids[:, k](x)
        top_k = ids.shape[1]
        flat = ids.reshape(-1)  # [tokens * top_k] (token, choice) pairs
        order = flat.argsort(stable=True)  # the pairs grouped by expert
        token_of = order // top_k  # each grouped pair's token
        if self.triton:
            out = self._grouped(x, flat, token_of, flat[order])
        else:
            out = self._per_expert(x[token_of], flat)
        # As transformers: each product in the weights' dtype (float32 for Mixtral), then cast
        # back and summed per token in the model's dtype.
        scaled = (out * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, scaled)

    def _per_expert(self, grouped: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """The torch path: one GEMM per expert with pairs, [pairs, hidden] in grouped order."""
        assert not self.packed, "packed experts run on the Triton path"
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()  # host sync
        gate_up, down = self._expert_views()
        out = torch.empty_like(grouped)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            h = linear(grouped[rows], gate_up[e], None)  # [n, 2 * inter]
            if self.gate_up_proj_bias is not None:  # as transformers: the GEMM, then the bias
                h = h + self.gate_up_proj_bias[e]
            y = linear(self._activate(h), down[e], None)
            if self.adds_down_bias and self.down_proj_bias is not None:
                y = y + self.down_proj_bias[e]
            out[rows] = y
            start += n
        return out

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2 * inter] -> [n, inter]
        if isinstance(self.act, ClampedSwiGLU):
            return self.act(gate_up)  # gate and up interleaved
        return self.act(*gate_up.chunk(2, dim=-1))  # the gate half, then the up half

    def _grouped(
        self, x: torch.Tensor, flat: torch.Tensor, token_of: torch.Tensor, expert_of: torch.Tensor
    ) -> torch.Tensor:
        """The Triton path: each projection one grouped-GEMM launch over every expert's pairs,
        the counts kept on the device; biases (gpt-oss) added after each launch, gathered by
        each pair's expert (`expert_of`). [pairs, hidden] in grouped order."""
        from engine.layers.grouped_gemm_kernel import group_blocks

        experts = self.gate_up_proj.shape[0]
        # Counted by scatter_add, not bincount: CUDA's bincount reads the largest id on the host.
        counts = torch.zeros(experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        starts = group_blocks(counts)
        gate_up = self._gemm("gate_up_proj", x, token_of, starts)
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[expert_of]
        h = self._activate(gate_up)  # [pairs, inter]
        rows = torch.arange(h.shape[0], device=x.device)
        out = self._gemm("down_proj", h, rows, starts)
        if self.adds_down_bias and self.down_proj_bias is not None:
            out = out + self.down_proj_bias[expert_of]
        return out

    def _gemm(
        self,
        stack: str,
        a: torch.Tensor,
        rows: torch.Tensor,
        starts: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """One grouped-GEMM launch of `stack`: dense, or MXFP4 when packed."""
        if self.packed:
            from engine.layers.mxfp4_grouped_gemm_kernel import mxfp4_grouped_gemm

            return mxfp4_grouped_gemm(a, rows, *packed_stack(self, stack), *starts)
        from engine.layers.grouped_gemm_kernel import grouped_gemm

        weight: torch.Tensor = getattr(self, stack)
        return grouped_gemm(a, rows, weight.detach(), *starts)

    def drop_views(self) -> None:
        """Forget the per-expert views and the packed CPU copies `linear` cached on them (a
        sleep releasing the weights: engine/sleep/model_memory.py)."""
        self._views = None

    def _expert_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        key = (self.gate_up_proj.data_ptr(), self.down_proj.data_ptr())
        if self._views is None or self._views[0] != key:
            gate_up = list(self.gate_up_proj.detach().unbind(0))
            down = list(self.down_proj.detach().unbind(0))
            self._views = (key, gate_up, down)
        return self._views[1], self._views[2]
