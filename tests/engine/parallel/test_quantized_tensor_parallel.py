"""A quantized checkpoint on two ranks (gloo, CPU): each rank dequantizes every quantized tensor
whole and keeps its slice, so the served weights, greedy ids and logprobs equal one rank's;
a quantized checkpoint update swaps on both ranks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.quantized_checkpoints import quantize_checkpoint
from tests.support.tiny_models import make_checkpoint, prompts

QWEN3 = {
    "hidden_size": 256,
    "intermediate_size": 384,
    "head_dim": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True)


def make_engine(model: Path, ranks: int) -> LLMEngine:
    config = {"device": "cpu", "dtype": "float32", "cpu_threads": 1}
    return LLMEngine(EngineConfig(model=str(model), tensor_parallel_size=ranks, **config))  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["fp8", "compressed-tensors"])
def test_two_ranks_of_a_quantized_checkpoint_give_one_ranks_tokens(
    tmp_path: Path, method: str
) -> None:
    checkpoint = make_checkpoint(tmp_path / "a", "qwen3", **QWEN3)
    quantize_checkpoint(checkpoint, method)
    update = make_checkpoint(tmp_path / "b", "qwen3", seed=1, **QWEN3)
    quantize_checkpoint(Path(shutil.copytree(update, tmp_path / "b_q")), method)
    one, two = make_engine(checkpoint, 1), make_engine(checkpoint, 2)
    try:
        batch = prompts(one.info.vocab_size, count=3)
        single = one.generate(batch, GREEDY)
        for a, b in zip(single, two.generate(batch, GREEDY), strict=True):
            assert b.token_ids == a.token_ids
            torch.testing.assert_close(
                torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0
            )
        one.update_weights(tmp_path / "b_q")
        two.update_weights(tmp_path / "b_q")
        updated = [r.token_ids for r in one.generate(batch, GREEDY)]
        assert updated != [r.token_ids for r in single]
        assert [r.token_ids for r in two.generate(batch, GREEDY)] == updated
    finally:
        two.close()
