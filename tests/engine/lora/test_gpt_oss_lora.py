"""LoRA on gpt-oss: adapters of its attention projections (q/k/v/o, each with its bias), made
by peft, give peft's greedy ids and logprobs on transformers' model, mixed with the base model
in one batch; its experts are no LoRA target (peft's `target_parameters` adapter of them is
refused, naming the module, and changes nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.lora_adapters import ATTENTION, make_adapter, peft_greedy, peft_model
from tests.support.tiny_models import make_checkpoint, prompts

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss")


def make_engine(checkpoint: Path) -> LLMEngine:
    config = EngineConfig(
        model=str(checkpoint),
        device="cpu",
        dtype="float32",
        max_loras=2,
        max_lora_rank=8,
        warmup=False,
    )
    return LLMEngine(config)


def greedy(adapter: str) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, adapter=adapter
    )


def test_attention_adapters_equal_peft(gpt_oss: Path, tmp_path: Path) -> None:
    adapters = {
        "all": make_adapter(gpt_oss, tmp_path / "all", r=8, targets=ATTENTION),
        "qv": make_adapter(gpt_oss, tmp_path / "qv", r=4, targets=("q_proj", "v_proj"), seed=1),
    }
    engine = make_engine(gpt_oss)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    cases = [(name, p) for p in prompts(300, count=4)[1:] for name in ("", *adapters)]
    results = engine.generate([p for _, p in cases], [greedy(name) for name, _ in cases])
    models = {name: peft_model(gpt_oss, adapters.get(name)) for name in ("", *adapters)}
    for (name, prompt), result in zip(cases, results, strict=True):
        expected, logprobs = peft_greedy(models[name], prompt, NEW_TOKENS)
        assert result.error is None
        assert result.token_ids == expected, f"adapter {name!r}, {len(prompt)} tokens"
        torch.testing.assert_close(
            torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0
        )
    base = [r.token_ids for (name, _), r in zip(cases, results, strict=True) if not name]
    assert base != [r.token_ids for (name, _), r in zip(cases, results, strict=True) if name]


def test_an_adapter_of_the_experts_is_refused_naming_them(gpt_oss: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    from tests.support.tiny_models import load_hf_model

    config = LoraConfig(r=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    get_peft_model(load_hf_model(gpt_oss), config).save_pretrained(tmp_path / "experts")
    engine = make_engine(gpt_oss)
    with pytest.raises(ValueError, match="experts"):
        engine.load_adapter("experts", tmp_path / "experts")
    assert engine.adapters() == []
