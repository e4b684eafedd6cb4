"""The model registry: every architecture a checkpoint may name resolves to a CausalLM, and a
family registered in engine/models/ alone is the model the engine serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.base import CausalLM, model_class
from engine.models.hf_config import UnsupportedModelError, load_model_config, parse_model_config
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import ARCHITECTURES
from tests.support.tiny_models import BASE_CONFIG, make_checkpoint, prompts


class ToyForCausalLM(LlamaForCausalLM):
    """A family outside the Llama rows (its layers borrowed): counts its forward passes."""

    forwards = 0

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        type(self).forwards += 1
        return super().forward(*args, **kwargs)


def test_every_registered_architecture_resolves_to_a_causal_lm():
    for architecture in ARCHITECTURES:
        assert issubclass(model_class(architecture), CausalLM), architecture


def test_a_family_checks_a_tensor_parallel_size_before_building_anything():
    raw = {**BASE_CONFIG, "architectures": ["Qwen2ForCausalLM"], "vocab_size": 320}
    cfg = parse_model_config(raw, {})
    layout = model_class(cfg.architecture).shard_layout(cfg, 1, 2)
    assert layout.full_shape("model.layers.0.self_attn.q_proj.weight", (32, 64)) == (64, 64)
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide"):
        model_class(cfg.architecture).shard_layout(cfg, 0, 3)


def test_an_unregistered_architecture_is_refused_naming_the_supported_ones(tmp_path: Path):
    checkpoint = make_checkpoint(tmp_path / "llama")
    _rename_architecture(checkpoint, "ToyForCausalLM")
    with pytest.raises(UnsupportedModelError, match=r"ToyForCausalLM.*LlamaForCausalLM"):
        load_model_config(checkpoint)


def test_a_family_registered_in_models_alone_is_the_model_the_engine_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    checkpoint = make_checkpoint(tmp_path / "llama")
    prompt = prompts(load_model_config(checkpoint).vocab_size, count=1)[0]
    want = _greedy(checkpoint, prompt)
    _rename_architecture(checkpoint, "ToyForCausalLM")
    monkeypatch.setitem(ARCHITECTURES, "ToyForCausalLM", (__name__, "ToyForCausalLM"))
    monkeypatch.setattr(ToyForCausalLM, "forwards", 0)
    assert _greedy(checkpoint, prompt) == want
    assert ToyForCausalLM.forwards > 0


def _rename_architecture(checkpoint: Path, name: str) -> None:
    path = checkpoint / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "architectures": [name]}))


def _greedy(checkpoint: Path, prompt: list[int]) -> list[int]:
    engine = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32"))
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        return engine.generate([prompt], params)[0].token_ids
    finally:
        engine.close()
