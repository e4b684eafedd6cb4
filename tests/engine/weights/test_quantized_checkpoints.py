"""Quantized checkpoints (FP8 block-128, compressed-tensors FP8 per channel) load unchanged:
every tensor equals transformers' dequantization of it bit for bit, and greedy ids and logprobs
equal transformers' generate on the dequantized model; configs Sluice does not compute are
refused by name."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.hf_config import UnsupportedModelError, load_model_config
from engine.weights.quantization import Quantization, read_quantization
from tests.support.quantized_checkpoints import (
    CT_FP8_DYNAMIC,
    FP8_CONFIG,
    PROJECTIONS,
    load_hf_dequantized,
    quantize_checkpoint,
)
from tests.support.tiny_models import hf_greedy, make_checkpoint, prompts

METHODS = ("fp8", "compressed-tensors")
# Every projection a whole number of 128 x 128 blocks (k/v: 2 heads of 64 = 128 rows).
QWEN3 = {
    "hidden_size": 256,
    "intermediate_size": 384,
    "head_dim": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=METHODS)
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = make_checkpoint(tmp_path_factory.mktemp(request.param), "qwen3", **QWEN3)
    return quantize_checkpoint(directory, request.param)


def method_of(directory: Path) -> str:
    return str(
        json.loads((directory / "config.json").read_text())["quantization_config"]["quant_method"]
    )


def engine_for(directory: Path, dtype: str = "float32") -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(directory), device="cpu", dtype=dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_tensor_equals_transformers_dequantized_bit_for_bit(
    quantized: Path, dtype: str
) -> None:
    import transformers

    kwargs: dict[str, Any] = {}
    if method_of(quantized) == "compressed-tensors":
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        quantized, dtype=getattr(torch, dtype), **kwargs
    )
    theirs = hf.state_dict()
    ours = engine_for(quantized, dtype).model.checkpoint_tensors()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        if name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):  # the dequantized ones
            assert theirs[name].dtype == tensor.dtype, name
        # NOTE: transformers keeps the tensors it did not quantize in the checkpoint's float32.
        assert torch.equal(tensor, theirs[name].to(tensor.dtype)), name


def test_greedy_ids_and_logprobs_equal_hf_on_the_dequantized_weights(quantized: Path) -> None:
    engine = engine_for(quantized)
    batch = prompts(engine.info.vocab_size, count=6)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
    results = engine.generate(batch, params)
    hf = load_hf_dequantized(quantized, method_of(quantized))
    for prompt, result in zip(batch, results, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert result.error is None
        assert result.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(result.logprobs), chosen, atol=1e-4, rtol=0)


def with_quantization(directory: Path, config: dict[str, Any]) -> Path:
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    raw["quantization_config"] = config
    path.write_text(json.dumps(raw))
    return directory


def ct_config(**group_changes: Any) -> dict[str, Any]:
    config = copy.deepcopy(CT_FP8_DYNAMIC)
    config["config_groups"]["group_0"].update(group_changes)
    return config


REFUSED = {
    "fp8 static activations": ({**FP8_CONFIG, "activation_scheme": "static"}, "activation_scheme"),
    "fp8 per-tensor": ({**FP8_CONFIG, "weight_block_size": None}, "weight_block_size"),
    "fp8 fp4 experts": ({**FP8_CONFIG, "expert_dtype": "fp4"}, "expert_dtype"),
    "awq": ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    "ct static activations": (
        ct_config(input_activations={"num_bits": 8, "type": "float", "dynamic": False}),
        "group_0.input_activations",
    ),
    "ct int4 weights": (
        ct_config(weights={"num_bits": 4, "type": "int", "strategy": "group"}),
        "group_0.weights",
    ),
    "ct block strategy": (
        ct_config(weights={"num_bits": 8, "type": "float", "strategy": "block"}),
        "group_0.weights.strategy",
    ),
    "ct kv cache": ({**CT_FP8_DYNAMIC, "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    "ct packed": ({**CT_FP8_DYNAMIC, "format": "pack-quantized"}, "format"),
    "ct not compressed": (
        {**CT_FP8_DYNAMIC, "quantization_status": "frozen"},
        "quantization_status",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_quantization_sluice_does_not_compute_is_refused_by_name(case: str) -> None:
    config, named = REFUSED[case]
    with pytest.raises(UnsupportedModelError, match=named.replace(".", r"\.")):
        read_quantization({"quantization_config": config})


def test_an_engine_refuses_the_checkpoint_at_start_naming_the_key(
    tiny_llama: Path, tmp_path: Path
) -> None:
    import shutil

    directory = Path(shutil.copytree(tiny_llama, tmp_path / "static"))
    with_quantization(directory, {**FP8_CONFIG, "activation_scheme": "static"})
    load_model_config(directory)  # the config itself reads; the weights' format is refused
    with pytest.raises(UnsupportedModelError, match="activation_scheme"):
        engine_for(directory)


def test_a_quantized_weight_without_its_scales_is_refused(quantized: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    directory = Path(shutil.copytree(quantized, tmp_path / "no_scale"))
    tensors = load_file(str(directory / "model.safetensors"))
    scale = next(n for n in tensors if n.endswith(("weight_scale_inv", "weight_scale")))
    del tensors[scale]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="without its scales"):
        engine_for(directory)


# Qwen3-MoE with its experts quantized too (Qwen3-30B-A3B-FP8's layout: one scale grid per
# expert projection; the router stays unquantized).
QWEN3_MOE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "head_dim": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize("method", METHODS)
def test_quantized_experts_give_hf_greedy_ids(tmp_path: Path, method: str) -> None:
    """FP8 experts equal transformers' bit for bit. compressed-tensors: transformers multiplies
    an expert's scale in float32, where its dense layers and the format's reference
    (compressed_tensors' dequantize) multiply in the scale's dtype, which Sluice follows: the
    ids are compared, not the expert tensors."""
    directory = make_checkpoint(tmp_path / method, "qwen3_moe", **QWEN3_MOE)
    quantize_checkpoint(directory, method)
    engine = engine_for(directory)
    hf = load_hf_dequantized(directory, method)
    if method == "fp8":
        ours, theirs = engine.model.checkpoint_tensors(), hf.state_dict()
        prefix = "model.layers.1.mlp.experts"
        gate_up = torch.cat(
            [ours[f"{prefix}.3.gate_proj.weight"], ours[f"{prefix}.3.up_proj.weight"]]
        )
        assert torch.equal(gate_up, theirs[f"{prefix}.gate_up_proj"][3])
        assert torch.equal(ours[f"{prefix}.3.down_proj.weight"], theirs[f"{prefix}.down_proj"][3])
    batch = prompts(engine.info.vocab_size, count=4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, result in zip(batch, engine.generate(batch, params), strict=True):
        assert result.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)[0]


def test_scales_beside_data_that_is_not_quantized_are_refused() -> None:
    """A full-precision weight with scales beside it (fake-quantized, not stored as FP8) would
    be scaled twice."""
    with pytest.raises(ValueError, match=r"a\.weight: dtype BF16 is not fp8 data"):
        Quantization("fp8").group({"a.weight": "BF16", "a.weight_scale_inv": "F32"})
