"""A mixture-of-experts checkpoint served through gRPC: the service loads Qwen2-MoE (shared
expert) and Qwen3-MoE (a dense layer) checkpoints unchanged, and the client's greedy ids and
logprobs equal transformers'."""

from __future__ import annotations

import pytest
import torch
from sluice_client import AsyncClient

from tests.support.service_harness import running_server
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

pytestmark = pytest.mark.asyncio

NEW_TOKENS = 16
CASES = {"qwen2_moe": ("qwen2_moe", {}), "qwen3_moe": ("qwen3_moe", {"mlp_only_layers": [1]})}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_greedy_ids_and_logprobs_through_the_service_equal_hf(case, tmp_path) -> None:
    arch, overrides = CASES[case]
    checkpoint = make_checkpoint(tmp_path / case, arch, **overrides)
    batch = prompts(300, count=3)
    async with running_server(checkpoint, fake=False) as (_, target), AsyncClient(target) as c:
        completions = [
            await c.complete(
                prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True
            )
            for prompt in batch
        ]
    hf = load_hf_model(checkpoint)
    for prompt, completion in zip(batch, completions, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert completion.reason == "LENGTH", completion.finished
        assert list(completion.token_ids) == expected, f"prompt of {len(prompt)} tokens diverged"
        chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        got = torch.tensor(list(completion.logprobs), dtype=torch.float32)
        torch.testing.assert_close(got, chosen, atol=1e-4, rtol=0)
