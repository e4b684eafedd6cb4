"""Greedy ids and logprobs equal Hugging Face transformers on each supported architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

NEW_TOKENS = 64
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama_gqa_untied": ("llama", {}),
    "llama31_rope_scaling": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama_linear_rope": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "qwen2_bias_tied": ("qwen2", {}),
    "qwen3_qk_norm_head_dim": ("qwen3", {}),
    "mistral": ("mistral", {}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = CASES[request.param]
    return make_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)


def test_greedy_ids_and_logprobs_equal_hf_generate(checkpoint: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32"))
    batch = prompts(engine.info.vocab_size)
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=5
    )
    results = engine.generate(batch, params)  # all 16 batched together

    hf = load_hf_model(checkpoint)
    for prompt, result in zip(batch, results, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert result.error is None
        assert result.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(result.logprobs), chosen, atol=1e-4, rtol=0)
        hf_top_lps, hf_top_ids = hf_logprobs.topk(5, dim=-1)
        assert result.top_logprobs is not None
        ids = torch.tensor([ids for ids, _ in result.top_logprobs])
        lps = torch.tensor([lps for _, lps in result.top_logprobs])
        assert torch.equal(ids, hf_top_ids)
        torch.testing.assert_close(lps, hf_top_lps, atol=1e-4, rtol=0)
    assert engine.pool.num_free + engine.cache.num_cached == engine.pool.num_pages
