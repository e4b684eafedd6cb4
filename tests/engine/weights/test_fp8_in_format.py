"""FP8 checkpoints in format: with the layers on Triton (CUDA's choice; forced here on the CPU
through Triton's interpreter, float32), every projection holds its e4m3 weight and scales and
runs the FP8 kernel, and the engine's greedy ids equal transformers' generate on the
dequantized checkpoint; on the torch layers (the CPU's choice) the checkpoint is dequantized
at load as before.

NOTE: `use_triton` runs at collection: it chooses the interpreter before triton is imported.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.layers.merged_linear import MergedLinear
from engine.layers.parallel_linear import RowParallelLinear
from tests.support.quantized_checkpoints import load_hf_dequantized, quantize_checkpoint
from tests.support.tiny_models import hf_greedy, make_checkpoint
from tests.support.triton_interpreter import use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
use_triton(DEVICE)

METHODS = ("fp8", "compressed-tensors")
# k/v: 2 heads of 64 = 128 rows; o_proj and down_proj: whole blocks of input columns.
QWEN3 = {
    "hidden_size": 256,
    "intermediate_size": 384,
    "head_dim": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
}
NEW_TOKENS = 6


def float32_scales(directory: Path) -> Path:
    """The per-channel scales stored in float32 (as some producers write them): a float32
    model computes them exactly in format (bfloat16 ones round the reference's product)."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        tensors[name] = tensors[name].float()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module", params=METHODS)
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = make_checkpoint(tmp_path_factory.mktemp(request.param), "qwen3", **QWEN3)
    directory = quantize_checkpoint(directory, request.param)
    return float32_scales(directory) if request.param == "compressed-tensors" else directory


def engine_for(directory: Path, kernels: str, ranks: int = 1) -> LLMEngine:
    config = EngineConfig(
        model=str(directory),
        device=DEVICE,
        dtype="float32",
        attention_backend="torch_ref",
        layer_kernels=kernels,
        tensor_parallel_size=ranks,
        page_size=16,
        enforce_eager=True,
        warmup=False,  # a full step under the interpreter takes long
    )
    return LLMEngine(config)


def projections(engine: LLMEngine) -> list[MergedLinear | RowParallelLinear]:
    kinds = (MergedLinear, RowParallelLinear)
    return [m for m in engine.model.modules() if isinstance(m, kinds)]


def test_on_triton_layers_every_projection_stays_in_fp8(quantized: Path) -> None:
    engine = engine_for(quantized, "triton")
    found = projections(engine)
    assert found and all(m.weight.dtype == torch.float8_e4m3fn for m in found)
    assert all(m.weight_scale is not None for m in found)


def test_on_torch_layers_the_checkpoint_is_dequantized_at_load(quantized: Path) -> None:
    engine = engine_for(quantized, "torch")
    found = projections(engine)
    assert all(m.weight.dtype == torch.float32 and m.weight_scale is None for m in found)


def test_greedy_ids_in_fp8_equal_hf_on_the_dequantized_weights(quantized: Path) -> None:
    method = json.loads((quantized / "config.json").read_text())["quantization_config"]
    engine = engine_for(quantized, "triton")
    batch = [[0, *range(5, 5 + n)] for n in (3, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    hf = load_hf_dequantized(quantized, method["quant_method"])
    for prompt, result in zip(batch, engine.generate(batch, params), strict=True):
        assert result.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)[0]


def test_bfloat16_channel_scales_stay_dequantized_in_a_float32_model(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, "qwen3", **QWEN3)
    engine = engine_for(quantize_checkpoint(directory, "compressed-tensors"), "triton")
    assert all(m.weight_scale is None for m in projections(engine))
