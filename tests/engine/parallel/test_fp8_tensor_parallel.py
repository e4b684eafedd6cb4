"""An FP8 checkpoint kept in format on two ranks (gloo, the CPU, Triton's interpreter in
float32): each rank holds its rows (column-parallel) or its columns and their scale columns
(row-parallel) of every e4m3 weight, a row-parallel split off a 128-column boundary keeps that
projection dequantized, and the greedy ids and logprobs equal one rank's, before and after an
update in process (an FP8 tensor with its scales; a full-precision one, quantized where the
projection is in FP8).

NOTE: `use_triton` runs at collection: it chooses the interpreter before triton is imported
(the workers inherit TRITON_INTERPRET).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from engine import EngineConfig, GenerationResult, LLMEngine, SamplingParams
from engine.weights.fp8_format import Fp8Format
from tests.support.quantized_checkpoints import quantize_checkpoint
from tests.support.tiny_models import make_checkpoint
from tests.support.triton_interpreter import use_triton

use_triton("cpu")

# Two ranks: q 128 rows each, k/v 64 (half a block), o_proj 128 input columns each (a block
# boundary), down_proj 192 (off one: dequantized).
QWEN3 = {
    "hidden_size": 256,
    "intermediate_size": 384,
    "head_dim": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
}
O_PROJ = "model.layers.0.self_attn.o_proj.weight"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True)


def engine_for(model: Path, ranks: int) -> LLMEngine:
    config = EngineConfig(
        model=str(model),
        device="cpu",
        dtype="float32",
        cpu_threads=1,
        attention_backend="torch_ref",
        layer_kernels="triton",
        tensor_parallel_size=ranks,
        enforce_eager=True,
        warmup=False,
    )
    return LLMEngine(config)


def in_fp8(engine: LLMEngine) -> dict[str, bool]:
    return {
        name.rpartition(".")[2]: module.weight.dtype == torch.float8_e4m3fn
        for name, module in engine.model.named_modules()
        if name.startswith("model.layers.0.") and hasattr(module, "fp8_block_k")
    }


def assert_rank0_share(engine: LLMEngine, checkpoint: Path) -> None:
    """Rank 0 of two holds its o_proj columns' e4m3 data and their scale column, and its
    k_proj rows' scales, as the checkpoint stores them."""
    stored = load_file(str(checkpoint / "model.safetensors"))
    attn = engine.model.get_submodule("model.layers.0.self_attn")
    fmt, prefix = Fp8Format((128, 128)), "model.layers.0.self_attn."
    o_data = stored[prefix + "o_proj.weight"][:, :128]
    assert torch.equal(attn.o_proj.weight.view(torch.uint8), o_data.view(torch.uint8))
    o_rows = fmt.row_scales(stored[prefix + "o_proj.weight_scale_inv"], 256, 256)
    assert torch.equal(attn.o_proj.weight_scale, o_rows[:, :1])
    k_rows = fmt.row_scales(stored[prefix + "k_proj.weight_scale_inv"], 128, 256)
    assert torch.equal(attn.qkv_proj.weight_scale[128:192], k_rows[:64])  # after q's 128 rows


def assert_same_tokens(ones: list[GenerationResult], twos: list[GenerationResult]) -> None:
    for a, b in zip(ones, twos, strict=True):
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(
            torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0
        )


def test_two_ranks_in_fp8_give_one_ranks_tokens(tmp_path: Path) -> None:
    checkpoint = quantize_checkpoint(make_checkpoint(tmp_path, "qwen3", **QWEN3), "fp8")
    one, two = engine_for(checkpoint, 1), engine_for(checkpoint, 2)
    try:
        assert set(in_fp8(one).values()) == {True}
        assert in_fp8(two) == {
            "qkv_proj": True,
            "o_proj": True,
            "gate_up_proj": True,
            "down_proj": False,
        }
        assert_rank0_share(two, checkpoint)
        batch = [[0, *range(5, 5 + n)] for n in (3, 20)]
        single = one.generate(batch, GREEDY)
        assert_same_tokens(single, two.generate(batch, GREEDY))
        # Updates in process: down_proj (in FP8 on one rank, dequantized on two) an FP8 tensor
        # with its scales; o_proj (in FP8 on both) a full-precision tensor, quantized.
        stored = load_file(str(checkpoint / "model.safetensors"))
        down = "model.layers.1.mlp.down_proj.weight"
        update = {
            down: stored[down.replace("layers.1", "layers.0")],
            down + "_scale_inv": stored[down.replace("layers.1", "layers.0") + "_scale_inv"],
            O_PROJ: torch.randn(256, 256, generator=torch.Generator().manual_seed(3)) * 0.05,
        }
        one.update_weights(update)
        two.update_weights(update)
        updated = one.generate(batch, GREEDY)
        assert [r.token_ids for r in updated] != [r.token_ids for r in single]
        assert_same_tokens(updated, two.generate(batch, GREEDY))
    finally:
        two.close()
