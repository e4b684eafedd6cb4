"""Tensor parallelism for mixture-of-experts models on the CPU (gloo, 2 ranks): each rank holds
a slice of every expert's (and the shared expert's) intermediate dimension; greedy ids equal one
rank's and transformers', logprobs within 1e-4, the routed experts one rank's (every rank
routes whole), and updates naming individual experts' tensors
(in-process tensors, live_weights) reach both ranks' slices."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.hf_config import load_model_config
from engine.models.sharding import Sharding
from engine.protocol.messages import WeightsPhase
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
CASES = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),  # the shared expert split too
    "qwen3_moe_dense_layer": ("qwen3_moe", {"mlp_only_layers": [1], "norm_topk_prob": True}),
}


def make_engine(model: Path, ranks: int) -> LLMEngine:
    # One torch thread per rank: two ranks of two threads on two cores run 10-100x slower.
    config = EngineConfig(
        model=str(model), device="cpu", dtype="float32", cpu_threads=1, tensor_parallel_size=ranks
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
    arch, overrides = CASES[case]
    checkpoint = make_checkpoint(tmp_path / case, arch, **overrides)
    one = make_engine(checkpoint, 1)
    engines.append(two := make_engine(checkpoint, 2))
    batch = prompts(one.info.vocab_size, count=4)
    params = dataclasses.replace(GREEDY, routed_experts=True)
    single, split = one.generate(batch, params), two.generate(batch, params)
    hf = load_hf_model(checkpoint)
    for prompt, a, b in zip(batch, single, split, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert b.token_ids == a.token_ids == expected
        assert b.routed_experts is not None and b.routed_experts == a.routed_experts
        chosen = hf_logprobs.gather(-1, torch.tensor(b.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(b.logprobs), chosen, atol=1e-4, rtol=0)


def test_updates_naming_experts_reach_every_ranks_slice(tmp_path, engines) -> None:
    first = make_checkpoint(tmp_path / "a", "qwen2_moe", seed=0)
    second = make_checkpoint(tmp_path / "b", "qwen2_moe", seed=1)
    new = load_file(second / "model.safetensors")
    # Every expert of both layers (gate, up and down), and nothing else.
    experts = [n for n in new if ".mlp.experts." in n]
    update = {name: new[name] for name in experts}
    one = make_engine(first, 1)
    engines.append(two := make_engine(first, 2))
    assert one.update_weights(update).phase is WeightsPhase.APPLIED
    assert two.update_weights(update).phase is WeightsPhase.APPLIED
    batch = prompts(one.info.vocab_size, count=3)
    want = [r.token_ids for r in one.generate(batch, GREEDY)]
    assert [r.token_ids for r in two.generate(batch, GREEDY)] == want
    untouched = [r.token_ids for r in make_engine(first, 1).generate(batch, GREEDY)]
    assert want != untouched  # the experts' update changed what is served
    # live_weights: whole tensors gathered from both ranks' slices, each rank's slice swapped.
    old = load_file(first / "model.safetensors")
    with two.live_weights() as params:
        assert torch.equal(params[experts[0]], new[experts[0]])
        for name in experts:
            params[name].copy_(old[name])
    assert [r.token_ids for r in two.generate(batch, GREEDY)] == untouched


@pytest.mark.parametrize(
    ("arch", "overrides", "key"),
    [
        ("qwen2_moe", {"moe_intermediate_size": 50}, "moe_intermediate_size=50"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 90}, "shared_expert_intermediate_size"),
        ("mixtral", {"intermediate_size": 50}, "intermediate_size=50"),
    ],
)
def test_a_size_that_does_not_divide_an_experts_width_is_refused(
    arch, overrides, key, tmp_path
) -> None:
    cfg = load_model_config(make_checkpoint(tmp_path / arch, arch, **overrides))
    Sharding(cfg, 0, 2)  # 2 divides every width
    with pytest.raises(ValueError, match=key):
        Sharding(cfg, 0, 4)
