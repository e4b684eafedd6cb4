"""Phi-3's fused checkpoint tensors (`qkv_proj`, `gate_up_proj`): two tensor-parallel ranks cut
them projection by projection and equal one rank (base model and peft adapters); weight updates
name them whole; LoRA adapters made by peft on the fused modules equal peft's model."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLMEngine
from engine.protocol.messages import WeightsPhase
from engine.weights.staging import WeightUpdateError
from tests.engine.models.test_phi3 import (
    ALL,
    FUSED_TARGETS,
    GREEDY,
    NEW_TOKENS,
    checkpoint_of,
    long_prompts,
    make_engine,
)
from tests.support.lora_adapters import make_adapter, peft_greedy, peft_model


@pytest.fixture(scope="module")
def everything(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint_of(tmp_path_factory.mktemp("phi_all"), **ALL)


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    """Engines a test makes; their workers are stopped after it."""
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        engine.close()


def test_two_ranks_cut_the_fused_tensors_and_adapters_as_one_rank_holds_them(
    everything: Path, tmp_path: Path, engines: list[LLMEngine]
) -> None:
    """Greedy ids (base and with a peft adapter on the fused modules) equal one rank's and
    transformers'/peft's; live weights gathered from both ranks equal the checkpoint's; an
    update naming the fused qkv_proj reaches both ranks' slices."""
    adapter = make_adapter(everything, tmp_path / "lora", r=8, targets=FUSED_TARGETS)
    lora = {"max_loras": 1, "max_lora_rank": 8, "cpu_threads": 1}
    one = make_engine(everything, **lora)
    engines.append(two := make_engine(everything, tensor_parallel_size=2, **lora))
    batch = long_prompts(one.info.vocab_size, 2)
    tuned = replace(GREEDY, adapter="lora")
    for engine in (one, two):
        engine.load_adapter("lora", adapter)
    for params in (GREEDY, tuned):
        a, b = one.generate(batch, params), two.generate(batch, params)
        assert [r.token_ids for r in b] == [r.token_ids for r in a]
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(
                torch.tensor(y.logprobs), torch.tensor(x.logprobs), atol=1e-4, rtol=0
            )
    reference = peft_model(everything, adapter)
    for prompt, result in zip(batch, two.generate(batch, tuned), strict=True):
        assert result.token_ids == peft_greedy(reference, prompt, NEW_TOKENS)[0]

    weights = load_file(everything / "model.safetensors")
    with two.live_weights() as live:  # gathered from both ranks, by checkpoint name
        assert set(live) == set(weights)
        assert all(torch.equal(live[name], tensor) for name, tensor in weights.items())

    other = load_file(checkpoint_of(tmp_path / "other", seed=1, **ALL) / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    for engine in (one, two):
        assert engine.update_weights({name: other[name]}).phase is WeightsPhase.APPLIED
    with two.live_weights() as live:
        assert torch.equal(live[name], other[name])
    after_one, after_two = one.generate(batch, GREEDY), two.generate(batch, GREEDY)
    assert [r.token_ids for r in after_two] == [r.token_ids for r in after_one]


def test_a_peft_adapter_on_the_fused_modules_equals_peft(everything: Path, tmp_path) -> None:
    adapters = {
        "all": make_adapter(everything, tmp_path / "all", r=8, targets=FUSED_TARGETS),
        "qkv": make_adapter(
            everything, tmp_path / "qkv", r=4, targets=("qkv_proj",), use_rslora=True, seed=1
        ),
    }
    engine = make_engine(everything, max_loras=2, max_lora_rank=8)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    batch = long_prompts(engine.info.vocab_size, 2)
    cases = [(name, p) for p in batch for name in ("", *adapters)]
    params = [replace(GREEDY, adapter=name) for name, _ in cases]
    results = engine.generate([p for _, p in cases], params)
    models = {name: peft_model(everything, adapters.get(name)) for name in ("", *adapters)}
    for (name, prompt), result in zip(cases, results, strict=True):
        expected, logprobs = peft_greedy(models[name], prompt, NEW_TOKENS)
        assert result.token_ids == expected, f"adapter {name!r}"
        torch.testing.assert_close(
            torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0
        )


def test_an_adapter_naming_unfused_projections_is_refused_by_module(everything, tmp_path) -> None:
    directory = make_adapter(everything, tmp_path / "a", r=4, targets=FUSED_TARGETS)
    tensors = load_file(directory / "adapter_model.safetensors")
    renamed = {k.replace("qkv_proj", "q_proj"): v for k, v in tensors.items()}
    save_file(renamed, directory / "adapter_model.safetensors")
    engine = make_engine(everything, max_loras=1, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"self_attn\.q_proj: the base model has no such module"):
        engine.load_adapter("a", directory)


def test_an_update_by_the_fused_names_lands_in_the_merged_weights(
    everything: Path, tmp_path: Path
) -> None:
    other_dir = checkpoint_of(tmp_path / "other", seed=1, **ALL)
    other = load_file(other_dir / "model.safetensors")
    engine = make_engine(everything)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    assert engine.update_weights({name: other[name]}).phase is WeightsPhase.APPLIED
    assert torch.equal(engine.model.model.layers[0].mlp.gate_up_proj.weight, other[name])
    assert engine.update_weights(other_dir).phase is WeightsPhase.APPLIED
    batch = long_prompts(engine.info.vocab_size, 2)
    want = [r.token_ids for r in make_engine(other_dir).generate(batch, GREEDY)]
    assert [r.token_ids for r in engine.generate(batch, GREEDY)] == want
    wrong = other["model.layers.0.self_attn.qkv_proj.weight"][:-16]  # v's rows missing
    with pytest.raises(WeightUpdateError, match=r"qkv_proj\.weight: shape \(112, 64\) != model"):
        engine.update_weights({"model.layers.0.self_attn.qkv_proj.weight": wrong})
