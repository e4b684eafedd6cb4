"""gpt-oss checkpoints with MXFP4 experts, written as the released gpt-oss checkpoints are: a
tiny random gpt-oss checkpoint (tiny_models.make_checkpoint) whose expert tensors
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) are replaced by `*_blocks` and `*_scales`,
with the `quantization_config` gpt-oss ships; every other tensor kept as it is.

transformers' own quantizer (`integrations/mxfp4.py`'s `quantize_to_mxfp4`) needs the
triton_kernels hub, so the packing is written here, as the OCP MX spec quantizes: per 32 values
of the input dimension, an E8M0 exponent `floor(log2(amax)) - 2` (e2m1's largest exponent), the
values divided by 2^e rounded to the nearest e2m1 (saturating at 6), two nibbles a byte, low
nibble first. Its layout is checked by dequantizing with transformers'
`convert_moe_packed_tensors` (tests/engine/weights/test_mxfp4_checkpoints.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

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
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MAX_EXPONENT = 2  # 6 = 1.5 * 2^2
BLOCK = 32


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A gpt-oss expert tensor as transformers holds it, [experts, in, out] (in a multiple of
    32) -> its blocks [experts, out, in / 32, 16] and scales [experts, out, in / 32], uint8."""
    experts, inputs, out = weight.shape
    assert inputs % BLOCK == 0, f"input dim {inputs} is not a multiple of {BLOCK}"
    groups = weight.float().transpose(1, 2).reshape(experts, out, inputs // BLOCK, BLOCK)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    exponent = torch.where(amax > 0, amax.log2().floor() - E2M1_MAX_EXPONENT, -127.0)
    exponent = exponent.clamp(-127, 127)
    scaled = groups / exponent.exp2()
    magnitude = (scaled.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(dim=-1)
    nibbles = (magnitude | ((scaled < 0) & (magnitude > 0)).long() << 3).to(torch.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    scales = (exponent.squeeze(-1) + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


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
