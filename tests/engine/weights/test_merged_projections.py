"""Merged q/k/v and gate/up projections: weights come in and go out by checkpoint name.

The model holds one qkv_proj and one gate_up_proj per layer; a checkpoint, an update and
live_weights name q_proj, k_proj, v_proj, gate_proj and up_proj apart, with their own shapes.
Each case compares the merged parameters with the checkpoint's tensors stacked, and the served
tokens with transformers' model given the same tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.weights.staging import WeightUpdateError
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint

NEW_TOKENS = 12
PROMPT = [0, 17, 42, 99, 123, 7, 88, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
CASES = {
    "llama": ("llama", {}),
    "llama_attention_and_mlp_bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen2_qkv_bias_tied": ("qwen2", {}),
    "qwen3_qk_norm": ("qwen3", {}),
}
# The tensors an update replaces, one at a time: the last and the middle rows of qkv_proj, the
# second half of gate_up_proj, and a bias's rows where the architecture has one.
UPDATED = {
    "llama": ["model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight"],
    "llama_attention_and_mlp_bias": [
        "model.layers.0.self_attn.k_proj.bias",
        "model.layers.1.mlp.gate_proj.bias",
    ],
    "qwen2_qkv_bias_tied": ["model.layers.0.self_attn.v_proj.bias"],
    "qwen3_qk_norm": ["model.layers.1.self_attn.k_proj.weight"],
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, overrides = CASES[request.param]
    directory = make_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)
    return request.param, directory


def make_engine(checkpoint: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32"))


def greedy(engine: LLMEngine) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return engine.generate([PROMPT], params)[0].token_ids


def stacked(tensors: dict[str, torch.Tensor], layer: int, parts: list[str], kind: str):
    """The merged parameter as the checkpoint's tensors stacked: the layout under test."""
    return torch.cat([tensors[f"model.layers.{layer}.{part}.{kind}"] for part in parts])


QKV = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
GATE_UP = ["mlp.gate_proj", "mlp.up_proj"]


def assert_merged_equal(engine: LLMEngine, tensors: dict[str, torch.Tensor]) -> None:
    for i, layer in enumerate(engine.model.model.layers):
        for merged, parts in ((layer.self_attn.qkv_proj, QKV), (layer.mlp.gate_up_proj, GATE_UP)):
            assert torch.equal(merged.weight, stacked(tensors, i, parts, "weight"))
            if merged.bias is not None:
                assert torch.equal(merged.bias, stacked(tensors, i, parts, "bias"))


def test_a_loaded_layer_holds_the_checkpoints_projections_stacked(case) -> None:
    _, checkpoint = case
    assert_merged_equal(make_engine(checkpoint), load_file(checkpoint / "model.safetensors"))


def test_live_weights_are_the_checkpoints_tensors_by_name(case) -> None:
    _, checkpoint = case
    saved = load_file(checkpoint / "model.safetensors")
    engine = make_engine(checkpoint)
    with engine.live_weights() as live:
        assert list(live) == list(engine.model.checkpoint_tensors())
        assert {n: t.shape for n, t in live.items()} == {n: t.shape for n, t in saved.items()}
        for name, tensor in saved.items():
            assert torch.equal(live[name], tensor), name


def test_an_update_of_one_projection_changes_its_rows_and_serves_like_hf(case) -> None:
    name, checkpoint = case
    saved = load_file(checkpoint / "model.safetensors")
    hf = load_hf_model(checkpoint)
    for tensor_name in UPDATED[name]:
        engine = make_engine(checkpoint)
        before = greedy(engine)
        generator = torch.Generator().manual_seed(7)
        new = torch.randn(saved[tensor_name].shape, generator=generator) * 0.5
        engine.update_weights({tensor_name: new})
        assert_merged_equal(engine, saved | {tensor_name: new})
        hf.state_dict()[tensor_name].copy_(new)  # the same tensor changed in transformers
        expected = hf_greedy(hf, PROMPT, NEW_TOKENS)[0]
        assert greedy(engine) == expected, tensor_name
        assert expected != before, f"{tensor_name}: the update changed no token"
        hf.state_dict()[tensor_name].copy_(saved[tensor_name])


def test_an_update_refused_for_one_tensor_leaves_the_others_rows_unchanged(case) -> None:
    _, checkpoint = case
    saved = load_file(checkpoint / "model.safetensors")
    engine = make_engine(checkpoint)
    v, up = "model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight"
    update = {v: torch.zeros_like(saved[v]), up: saved[up][:-1]}  # v fits, up does not
    with pytest.raises(WeightUpdateError, match="up_proj"):
        engine.update_weights(update)
    assert_merged_equal(engine, saved)
