"""YaRN rotary tables equal transformers': the inverse frequencies and attention factor of
`_compute_yarn_parameters` (gpt-oss's own parameters, DeepSeek's mscale pair, a missing factor,
the truncated correction range), read from config.json by the config reader; and the cos/sin
the model rotates with equal GptOssRotaryEmbedding's, attention factor applied; a Llama-family
checkpoint with YaRN scaling serves HF's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.layers.rope import RotaryEmbedding, yarn
from engine.models.hf_config import parse_model_config
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

HEAD_DIM = 16
CASES: dict[str, dict[str, Any]] = {
    "gpt_oss": {
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
    },
    "truncated_range": {"factor": 4.0, "original_max_position_embeddings": 128},
    "mscale_pair": {"factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0},
    "explicit_attention_factor": {"factor": 8.0, "attention_factor": 0.9, "beta_fast": 16},
    "factor_from_lengths": {"factor": None, "original_max_position_embeddings": 128},
}


def hf_config(params: dict[str, Any]) -> transformers.GptOssConfig:
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **params}
    return transformers.GptOssConfig(
        hidden_size=64,
        head_dim=HEAD_DIM,
        num_attention_heads=4,
        max_position_embeddings=512,
        rope_parameters=rope,
    )


def ours(config: transformers.GptOssConfig) -> tuple[float, dict[str, Any]]:
    raw = {**config.to_dict(), "architectures": ["GptOssForCausalLM"]}
    cfg = parse_model_config(raw, {})
    assert cfg.rope_scaling is not None
    return cfg.rope_theta, cfg.rope_scaling


@pytest.mark.parametrize("case", sorted(CASES))
def test_inverse_frequencies_and_attention_factor_equal_transformers(case: str) -> None:
    config = hf_config(CASES[case])
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    theta, scaling = ours(config)
    inv_freq, factor = yarn(HEAD_DIM, theta, scaling)
    assert torch.equal(inv_freq, want_freq)
    assert factor == want_factor


def test_cos_and_sin_carry_the_attention_factor_as_gpt_oss_rotary() -> None:
    config = hf_config(CASES["gpt_oss"])
    theta, scaling = ours(config)
    positions = torch.arange(300)
    rotary = RotaryEmbedding(HEAD_DIM, 512, theta, scaling)
    hf = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(config)
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    half = HEAD_DIM // 2  # gpt-oss keeps half a head; our tables repeat it for rotate-half
    assert torch.equal(rotary.cos[positions, :half], cos[0])
    assert torch.equal(rotary.sin[positions, half:], sin[0])
    assert not torch.allclose(cos[0], torch.cos(positions[:, None] * hf.inv_freq))  # scaled


def test_a_llama_family_checkpoint_with_yarn_generates_hf_greedy_ids(tmp_path: Path) -> None:
    """YaRN is common to every family: a Qwen2 checkpoint scaled by it (Qwen2.5's long
    context recipe) serves HF's tokens."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    checkpoint = make_checkpoint(tmp_path / "qwen2", "qwen2", rope_parameters=rope)
    config = EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", warmup=False)
    engine = LLMEngine(config)
    batch = prompts(engine.info.vocab_size, count=6)[3:]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=True)
    hf = load_hf_model(checkpoint)
    for prompt, result in zip(batch, engine.generate(batch, params), strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, 16)
        assert result.token_ids == expected
        chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(result.logprobs), chosen, atol=1e-4, rtol=0)
