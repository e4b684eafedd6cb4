"""LoRA adapters on Gemma 2 and Gemma 3 (q/k/v/o and gate/up/down) give peft's greedy ids and
logprobs (within 1e-4, float32), mixed with the base model in the same steps, on prompts longer
than the sliding window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.lora_adapters import make_adapter, peft_greedy, peft_model
from tests.support.tiny_models import make_checkpoint, prompts

NEW_TOKENS = 12


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_an_adapter_on_every_projection_equals_peft(arch: str, tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / arch, arch)
    adapter = make_adapter(checkpoint, tmp_path / "adapter", r=8, alpha=16)  # all seven
    engine = LLMEngine(
        EngineConfig(
            model=str(checkpoint),
            device="cpu",
            dtype="float32",
            page_size=4,
            max_loras=1,
            max_lora_rank=8,
        )
    )
    engine.load_adapter("a", adapter)
    batch = prompts(engine.info.vocab_size, count=3)[1:]  # 12 and 20 tokens
    cases = [(name, prompt) for prompt in batch for name in ("a", "")]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, adapter=name
        )
        for name, _ in cases
    ]
    results = engine.generate([p for _, p in cases], params)
    models = {"a": peft_model(checkpoint, adapter), "": peft_model(checkpoint, None)}
    for (name, prompt), result in zip(cases, results, strict=True):
        expected, logprobs = peft_greedy(models[name], prompt, NEW_TOKENS)
        assert result.error is None
        assert result.token_ids == expected, f"adapter {name!r}, {len(prompt)} tokens"
        torch.testing.assert_close(
            torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0
        )
    with_adapter, base = results[0].token_ids, results[1].token_ids
    assert with_adapter != base  # the adapter changed what is served
