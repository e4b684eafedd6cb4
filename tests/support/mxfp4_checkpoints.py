"""gpt-oss checkpoints with MXFP4 experts, written as the released gpt-oss checkpoints are: a
tiny random gpt-oss checkpoint (tiny_models.make_checkpoint) whose expert tensors
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) are replaced by `*_blocks` and `*_scales`,
with the `quantization_config` gpt-oss ships; every other tensor kept as it is.

transformers' own quantizer (`integrations/mxfp4.py`'s `quantize_to_mxfp4`) needs the
triton_kernels hub, so the packing is the engine's (engine/weights/mxfp4_experts.py's
`quantize_mxfp4`, which full-precision updates of packed experts go through), as the OCP MX
spec quantizes: per 32 values of the input dimension, an E8M0 exponent `floor(log2(amax)) - 2`
(e2m1's largest exponent), the values divided by 2^e rounded to the nearest e2m1 (saturating
at 6), two nibbles a byte, low nibble first. Its layout is checked by dequantizing with
transformers' `convert_moe_packed_tensors` (tests/engine/weights/test_mxfp4_checkpoints.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.weights.mxfp4_experts import quantize_mxfp4

__all__ = ["GPT_OSS_MXFP4", "load_hf_dequantized", "quantize_experts", "quantize_mxfp4"]

# The quantization_config of openai/gpt-oss-20b and -120b.
GPT_OSS_MXFP4: dict[str, Any] = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def quantize_experts(directory: Path) -> Path:
    """Quantize, in place, the expert tensors of the gpt-oss checkpoint in `directory` (one
    model.safetensors) to MXFP4 and declare it in config.json as gpt-oss does."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(EXPERT_TENSORS):
            out[f"{name}_blocks"], out[f"{name}_scales"] = quantize_mxfp4(tensor)
        else:
            out[name] = tensor
    save_file(out, str(path), metadata={"format": "pt"})
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = GPT_OSS_MXFP4
    config_path.write_text(json.dumps(config, indent=2))
    return directory


def load_hf_dequantized(directory: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The transformers reference: the MXFP4 checkpoint dequantized at load (on the CPU
    transformers has no MXFP4 kernels and is asked to dequantize)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, quantization_config=transformers.Mxfp4Config(dequantize=True)
    )
    return model.eval()
