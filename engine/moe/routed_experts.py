"""The routed experts of a step's LM-head rows (SamplingParams.routed_experts).

"The experts of a generated token" are those of the forward pass whose logits produced it: the
routing of the position its row samples from (for token i, the sequence position before it);
a scored prompt position's, likewise, are those of the row whose logits score it. The forward
records every MoE layer's expert ids for every token only when a request of the step asks
(`routing_record`): a step that returns none records nothing. The LM-head rows' ids (sampled,
then scored) are gathered on the device and come to the host with the sampled tokens
(engine/execution/launched_step.py).
"""

from __future__ import annotations

import torch

from engine.moe.config import MoeConfig


def routing_record(moe: MoeConfig | None, asked: bool) -> list[torch.Tensor] | None:
    """A list for the forward to append each MoE layer's expert ids to, when a request of the
    step `asked` for its routed experts and the model has experts (`moe`; a dense model has
    none to give); else None."""
    return [] if moe is not None and asked else None


def row_routing(routing: list[torch.Tensor], rows: torch.Tensor | None, count: int) -> torch.Tensor:
    """[LM-head rows, MoE layers, top_k] int32 expert ids of the first `count` LM-head rows,
    from what the forward recorded ([tokens, top_k] per MoE layer); `rows`: the token of each
    LM-head row (None: row i is token i)."""
    ids = stack_routing(routing)
    return ids[:count] if rows is None else ids[rows[:count]]


def stack_routing(routing: list[torch.Tensor]) -> torch.Tensor:
    """[tokens, MoE layers, top_k] int32 from each MoE layer's expert ids [tokens, top_k]."""
    return torch.stack(routing, dim=1).to(torch.int32)


def host_rows(routed: torch.Tensor) -> list[list[int]]:
    """Each sampled row's expert ids, flattened [MoE layer, k], from the host copy."""
    return routed.reshape(routed.shape[0], -1).tolist()
