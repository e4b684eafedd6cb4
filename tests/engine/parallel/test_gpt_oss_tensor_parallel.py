"""gpt-oss under tensor parallelism on the CPU (gloo, 2 ranks): each rank holds its query heads'
sinks, its slice of every expert's interleaved gate/up columns and down rows (the down bias
added once); greedy ids equal one rank's and transformers', logprobs within 1e-4, routed
experts one rank's; an update of a fused expert tensor reaches both ranks' slices."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.gpt_oss_sharding import GptOssSharding
from engine.models.hf_config import load_model_config
from engine.protocol.messages import WeightsPhase
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
CASES = {
    "alternating_window_8": {},
    # One KV head for two ranks: replicated; the sinks still split with the query heads.
    "one_kv_head_window_16": {"num_key_value_heads": 1, "sliding_window": 16},
}


def make_engine(model: Path, ranks: int) -> LLMEngine:
    # One torch thread per rank: two ranks of two threads on two cores run 10-100x slower.
    config = EngineConfig(
        model=str(model),
        device="cpu",
        dtype="float32",
        cpu_threads=1,
        tensor_parallel_size=ranks,
        warmup=False,
    )
    return LLMEngine(config)


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    """Engines a test makes; their workers are stopped after it."""
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        engine.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_give_one_ranks_and_hf_greedy_ids(case, tmp_path, engines) -> None:
    checkpoint = make_checkpoint(tmp_path / case, "gpt_oss", **CASES[case])
    one = make_engine(checkpoint, 1)
    engines.append(two := make_engine(checkpoint, 2))
    batch = prompts(one.info.vocab_size, count=5)[1:]  # 12..36 tokens: past the window
    params = dataclasses.replace(GREEDY, routed_experts=True)
    single, split = one.generate(batch, params), two.generate(batch, params)
    hf = load_hf_model(checkpoint)
    for prompt, a, b in zip(batch, single, split, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert b.token_ids == a.token_ids == expected
        assert b.routed_experts is not None and b.routed_experts == a.routed_experts
        chosen = hf_logprobs.gather(-1, torch.tensor(b.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(b.logprobs), chosen, atol=1e-4, rtol=0)


def test_each_rank_holds_its_heads_sinks_and_its_expert_columns(tmp_path) -> None:
    checkpoint = make_checkpoint(tmp_path / "gpt_oss", "gpt_oss")
    cfg = load_model_config(checkpoint)
    whole = load_file(checkpoint / "model.safetensors")
    prefix = "model.layers.0."
    for rank in range(2):
        shard = GptOssSharding(cfg, rank, 2)
        sinks = shard.take(prefix + "self_attn.sinks", whole[prefix + "self_attn.sinks"])
        assert torch.equal(sinks, whole[prefix + "self_attn.sinks"][2 * rank : 2 * rank + 2])
        name = prefix + "mlp.experts.gate_up_proj"  # [experts, hidden, 2 * 48], interleaved
        cols = shard.take(name, whole[name])
        inter = range(24 * rank, 24 * (rank + 1))  # this rank's intermediate units
        assert torch.equal(cols[..., ::2], whole[name][..., ::2][..., inter])  # gate columns
        assert torch.equal(cols[..., 1::2], whole[name][..., 1::2][..., inter])  # up columns
        name = prefix + "mlp.experts.down_proj_bias"
        assert torch.equal(shard.take(name, whole[name]), whole[name])  # whole, added once


def test_an_update_of_a_fused_expert_tensor_reaches_both_ranks(tmp_path, engines) -> None:
    first = make_checkpoint(tmp_path / "a", "gpt_oss", seed=0)
    second = make_checkpoint(tmp_path / "b", "gpt_oss", seed=1)
    new = load_file(second / "model.safetensors")
    update = {name: new[name] for name in new if ".mlp.experts." in name}
    one = make_engine(first, 1)
    engines.append(two := make_engine(first, 2))
    assert one.update_weights(update).phase is WeightsPhase.APPLIED
    assert two.update_weights(update).phase is WeightsPhase.APPLIED
    batch = prompts(one.info.vocab_size, count=3)
    want = [r.token_ids for r in one.generate(batch, GREEDY)]
    assert [r.token_ids for r in two.generate(batch, GREEDY)] == want
    untouched = [r.token_ids for r in make_engine(first, 1).generate(batch, GREEDY)]
    assert want != untouched  # the experts' update changed what is served
