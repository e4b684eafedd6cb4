"""Routed experts through gRPC (OutputOptions.routed_experts): the client's TokenChunk ids,
flattened [token, MoE layer, k], equal HF's routers at the position before each token, for
greedy and for n > 1 sampled completions, and the scored prompt positions' (Started.
prompt_logprobs.routed_experts: those of the position before each); ServerInfo says how to unflatten them; a dense model
and a request whose routed experts could pass the largest message are INVALID_ARGUMENT naming
`output.routed_experts`."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice_client import AsyncClient, build_request

from engine.protocol.messages import ModelInfo
from service.rpc.admission import (
    prompt_logprobs_violations,
    routed_bytes,
    routed_experts_violations,
)
from tests.support.service_harness import running_server
from tests.support.tiny_models import load_hf_model, make_checkpoint, prompts

NEW_TOKENS = 10


def hf_routing(model, ids: list[int]) -> torch.Tensor:
    """[positions, MoE layers, top_k]: HF's routers' expert ids (each returns (logits, scores,
    ids)), for every position of `ids` in one forward."""
    chosen: list[torch.Tensor] = []
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    hooks = [r.register_forward_hook(lambda m, i, out: chosen.append(out[2])) for r in routers]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, dim=1)


def assert_field_refused(err: grpc.aio.AioRpcError, field: str) -> None:
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert field in [v.field for v in bad.field_violations]


@pytest.mark.asyncio
async def test_routed_experts_through_the_service_equal_hf_routers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 18 bytes a token bounded by 4000: the 10-token requests fit, one up to the context not.
    monkeypatch.setattr("service.rpc.servicer.MAX_SEND_MESSAGE_BYTES", 4000)
    checkpoint = make_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe", mlp_only_layers=[1])
    batch = prompts(300, count=2)
    async with running_server(checkpoint, fake=False) as (_, target), AsyncClient(target) as c:
        info = await c.info()
        greedy = [
            await c.complete(p, max_tokens=NEW_TOKENS, temperature=0.0, routed_experts=True)
            for p in batch
        ]
        sampled = await c.complete(
            batch[1], n=2, max_tokens=NEW_TOKENS, temperature=1.0, seed=5, routed_experts=True
        )
        assert isinstance(sampled, list)
        plain = await c.complete(batch[0], max_tokens=NEW_TOKENS, temperature=0.0)
        scored = await c.complete(batch[1], max_tokens=0, prompt_logprobs=True, routed_experts=True)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.complete(batch[0], routed_experts=True)  # up to the context: too many
    assert (info.moe_layers, info.experts_per_token) == (1, 2)  # layer 1 is dense
    assert plain.routed_experts == [] and plain.token_ids == greedy[0].token_ids
    assert_field_refused(err.value, "output.routed_experts")
    hf = load_hf_model(checkpoint)
    checked = [*zip(batch, greedy, strict=True), (batch[1], sampled[0]), (batch[1], sampled[1])]
    for prompt, completion in checked:
        tokens = list(completion.token_ids)
        assert len(tokens) == NEW_TOKENS
        expected = hf_routing(hf, [*prompt, *tokens][:-1])[len(prompt) - 1 :]
        got = completion.experts_of(info.moe_layers, info.experts_per_token)
        assert torch.equal(torch.tensor(got), expected)
    assert sampled[0].token_ids != sampled[1].token_ids
    assert scored.started is not None
    prompt_routing = hf_routing(hf, batch[1])[: len(batch[1]) - 1]  # start 1: from position 0
    got_prompt = torch.tensor(list(scored.started.prompt_logprobs.routed_experts))
    assert torch.equal(got_prompt.view(prompt_routing.shape), prompt_routing)


@pytest.mark.asyncio
async def test_a_dense_model_refuses_routed_experts(tiny_llama: Path) -> None:
    async with running_server(tiny_llama, fake=False) as (_, target), AsyncClient(target) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.complete([0, 5, 6], max_tokens=4, routed_experts=True)
    assert_field_refused(err.value, "output.routed_experts")


def model_info(moe_layers: int, top_k: int, num_experts: int) -> ModelInfo:
    return ModelInfo(
        "m", "/m", "Qwen3MoeForCausalLM", 40_000, 1000, [1], "cpu", "float32", 16, 64, 0, 8,
        moe_layers=moe_layers, moe_top_k=top_k, num_experts=num_experts,
    )  # fmt: skip


def test_routed_experts_that_could_pass_the_largest_message_are_refused() -> None:
    info = model_info(48, 8, 128)  # Qwen3-30B-A3B: 384 one-byte ids per token
    unbounded = build_request([1] * 10, routed_experts=True)
    (violation,) = routed_experts_violations(unbounded, 10, info, max_message_bytes=1_000_000)
    assert violation[0] == "output.routed_experts" and "at most 2500 tokens" in violation[1]
    fits = build_request([1] * 10, routed_experts=True, max_tokens=2500)
    assert routed_experts_violations(fits, 10, info, max_message_bytes=1_000_000) == []
    # 256 experts: ids past 127 take two bytes each.
    wide = model_info(48, 8, 256)
    assert routed_experts_violations(fits, 10, wide, max_message_bytes=1_000_000) != []


def test_prompt_routed_experts_count_in_the_prompt_scores_bound() -> None:
    request = build_request([1] * 1000, prompt_logprobs=True, routed_experts=True)
    assert prompt_logprobs_violations(request, 1000, 100_000) == []  # 16 bytes a position
    routed = routed_bytes(model_info(48, 8, 128))  # 384 more
    (violation,) = prompt_logprobs_violations(request, 1000, 100_000, routed)
    assert violation[0] == "output.prompt_logprobs"
