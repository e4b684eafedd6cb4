"""gpt-oss's MXFP4 experts read by the model's names: `...experts.gate_up_proj_blocks` and
`_scales` are `...experts.gate_up_proj` (the same for down_proj), in transformers' layout
([experts, in, out]) and equal to its dequantization bit for bit; the tensors the config leaves
out (attention, router, biases) read as they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.parallel.shard_layout import ShardLayout
from engine.weights.checkpoint_reader import CheckpointReader

EXPERTS, HIDDEN, INTER = 4, 64, 32  # gate_up: [4, 64 in, 2 * 32 out], down: [4, 32 in, 64 out]
GPT_OSS_MXFP4 = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def packed(out: int, inputs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random [experts, out, in / 32, 16] blocks and [experts, out, in / 32] exponents near 127."""
    gen = torch.Generator().manual_seed(seed)
    groups = inputs // 32
    blocks = torch.randint(0, 256, (EXPERTS, out, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 132, (EXPERTS, out, groups), generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    prefix = "model.layers.0.mlp.experts"
    gate_up, down = packed(2 * INTER, HIDDEN, seed=1), packed(HIDDEN, INTER, seed=2)
    tensors = {
        f"{prefix}.gate_up_proj_blocks": gate_up[0],
        f"{prefix}.gate_up_proj_scales": gate_up[1],
        f"{prefix}.gate_up_proj_bias": torch.randn(EXPERTS, 2 * INTER),
        f"{prefix}.down_proj_blocks": down[0],
        f"{prefix}.down_proj_scales": down[1],
        f"{prefix}.down_proj_bias": torch.randn(EXPERTS, HIDDEN),
        "model.layers.0.mlp.router.weight": torch.randn(EXPERTS, HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(HIDDEN, HIDDEN).bfloat16(),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["GptOssForCausalLM"], "quantization_config": GPT_OSS_MXFP4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path, tensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocks_and_scales_read_as_the_dequantized_expert_tensor(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], dtype: torch.dtype
) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    directory, tensors = checkpoint
    prefix = "model.layers.0.mlp.experts"
    with CheckpointReader(directory) as reader:
        assert sorted(reader.names()) == sorted(
            [
                f"{prefix}.gate_up_proj",
                f"{prefix}.gate_up_proj_bias",
                f"{prefix}.down_proj",
                f"{prefix}.down_proj_bias",
                "model.layers.0.mlp.router.weight",
                "model.layers.0.self_attn.q_proj.weight",
            ]
        )
        assert reader.shape(f"{prefix}.gate_up_proj") == (EXPERTS, HIDDEN, 2 * INTER)
        assert reader.shape(f"{prefix}.down_proj") == (EXPERTS, INTER, HIDDEN)
        for proj in ("gate_up_proj", "down_proj"):
            ours = reader.read(f"{prefix}.{proj}", ShardLayout(), dtype)
            theirs = convert_moe_packed_tensors(
                tensors[f"{prefix}.{proj}_blocks"], tensors[f"{prefix}.{proj}_scales"], dtype=dtype
            )
            assert ours.dtype == dtype and torch.equal(ours, theirs), proj
        bias = reader.read(f"{prefix}.down_proj_bias", ShardLayout(), torch.float32)
        assert torch.equal(bias, tensors[f"{prefix}.down_proj_bias"])


def test_blocks_without_their_scales_are_refused(
    checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    directory, tensors = checkpoint
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    refused = "down_proj_blocks: quantized data without its scales"
    with pytest.raises(ValueError, match=refused), CheckpointReader(directory):
        pass
