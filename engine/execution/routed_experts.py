"""The routed experts of a step's sampled rows (SamplingParams.routed_experts).

"The experts of a generated token" are those of the forward pass whose logits produced it: the
routing of the position its row samples from (for token i, the sequence position before it).
The forward records every MoE layer's expert ids for every token only when some sampled row's
request asks (`routing_record`): a step that returns none records nothing. The sampled rows'
ids are gathered on the device and come to the host with the sampled tokens, in the step's one
device-to-host copy (engine/execution/launched_step.py).
"""

from __future__ import annotations

import torch

from engine.models.llama import LlamaForCausalLM
from engine.scheduling.request import Request


def routing_record(model: LlamaForCausalLM, sampling: list[Request]) -> list[torch.Tensor] | None:
    """A list for the forward to append each MoE layer's expert ids to, when a row of
    `sampling` asks for its routed experts (a dense model has none to give); else None."""
    if model.config.moe is None or not any([r.params.routed_experts for r in sampling]):
        return None
    return []


def sampled_routing(
    routing: list[torch.Tensor], rows: torch.Tensor | None, num_sampled: int
) -> torch.Tensor:
    """[sampled rows, MoE layers, top_k] int32 expert ids of the sampled rows, from what the
    forward recorded ([tokens, top_k] per MoE layer); `rows`: the token of each LM-head row
    (None: row i is token i)."""
    ids = torch.stack(routing, dim=1)  # [tokens, MoE layers, top_k]
    picked = ids[:num_sampled] if rows is None else ids[rows[:num_sampled]]
    return picked.to(torch.int32)


def host_rows(routed: torch.Tensor) -> list[list[int]]:
    """Each sampled row's expert ids, flattened [MoE layer, k], from the host copy."""
    return routed.reshape(routed.shape[0], -1).tolist()
