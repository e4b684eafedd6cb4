"""Quantized tiny checkpoints, written as the released ones are: a tiny random checkpoint
(tiny_models.make_checkpoint) whose decoder projections are quantized by the reference code of
their format, with the `quantization_config` its producers write.

- `fp8`: transformers' own Fp8Quantize (e4m3, one float32 `weight_scale_inv` per 128 x 128
  block), `quant_method: fp8`, `weight_block_size: [128, 128]`, dynamic activations (the
  config Qwen3-FP8 and DeepSeek-V3 ship).
- `compressed-tensors`: transformers' `quantize_fp8_per_row` (a scale per output channel),
  the scales stored in bfloat16 as llm-compressor writes them [out, 1], and the FP8-Dynamic
  scheme's config (static per-channel weights, dynamic per-token activations, lm_head
  ignored).

The embedding, the norms and the LM head stay as they are (what both formats leave out).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file, save_file

# The decoder's linear projections: what both formats quantize.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

FP8_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}
CT_FP8_DYNAMIC: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "global_compression_ratio": None,
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "sparsity_config": {},
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
                "group_size": None,
                "block_structure": None,
                "observer": "minmax",
            },
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
                "observer": None,
            },
            "output_activations": None,
        }
    },
}


def quantize_checkpoint(directory: Path, method: str) -> Path:
    """Quantize, in place, the projections of the checkpoint in `directory` (one
    model.safetensors) to `method` ("fp8" or "compressed-tensors") and declare it in config.json."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS):
            out[name] = tensor
        elif method == "fp8":
            out |= _fp8_block(name, tensor)
        else:
            out |= _fp8_per_channel(name, tensor)
    save_file(out, str(path), metadata={"format": "pt"})
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = FP8_CONFIG if method == "fp8" else CT_FP8_DYNAMIC
    config_path.write_text(json.dumps(config, indent=2))
    return directory


def _fp8_block(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    quantizer = SimpleNamespace(quantization_config=FineGrainedFP8Config())
    parts: dict[str, torch.Tensor] = Fp8Quantize(quantizer)._quantize_one(name, weight)
    assert parts[name].dtype == torch.float8_e4m3fn, f"{name} {tuple(weight.shape)}: not tiled"
    return parts


def _fp8_per_channel(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    from transformers.integrations.compressed_tensors import quantize_fp8_per_row

    quantized, scales = quantize_fp8_per_row(weight)
    scale_name = name.removesuffix(".weight") + ".weight_scale"
    return {name: quantized, scale_name: scales.to(torch.bfloat16).reshape(-1, 1)}


def load_hf_dequantized(directory: Path, method: str) -> Any:
    """The transformers reference: the quantized checkpoint dequantized at load into float32
    (on the CPU transformers dequantizes FP8 by itself; compressed-tensors is asked to)."""
    import transformers

    kwargs: dict[str, Any] = {}
    if method == "compressed-tensors":
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, **kwargs
    )
    return model.eval()
