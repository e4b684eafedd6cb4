"""gpt-oss's MXFP4 experts kept packed (the Triton layers: CUDA's choice, forced here on the
CPU under Triton's interpreter, float32): the experts hold the checkpoint's blocks and scales
byte for byte and run the MXFP4 grouped GEMM; greedy ids equal transformers' generate on the
dequantized checkpoint; two ranks give one rank's tokens; updates copy blocks with their
scales, and quantize full-precision stacks to MXFP4.

NOTE: `use_triton` runs at collection: it chooses the interpreter before triton is imported.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.moe.experts import StackedExperts
from engine.moe.packed_experts import packed_stack
from engine.weights.mxfp4_experts import quantize_mxfp4
from tests.support.mxfp4_checkpoints import load_hf_dequantized, quantize_experts
from tests.support.tiny_models import hf_greedy, make_checkpoint
from tests.support.triton_interpreter import use_triton

use_triton("cpu")

# MXFP4 scales 32 values of an expert's input dim: hidden 64 (gate_up), intermediate 64 (down).
GPT_OSS = {"hidden_size": 64, "intermediate_size": 64}
EXPERTS = "model.layers.1.mlp.experts"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The served MXFP4 checkpoint (seed 0); seed 1's in full precision and in MXFP4."""
    made = {}
    for seed, name in ((0, "full"), (1, "other_full")):
        directory = tmp_path_factory.mktemp(name)
        made[name] = make_checkpoint(directory, "gpt_oss", seed=seed, **GPT_OSS)
    for name, source in (("mxfp4", "full"), ("other_mxfp4", "other_full")):
        copy = Path(shutil.copytree(made[source], tmp_path_factory.mktemp(name) / "ckpt"))
        made[name] = quantize_experts(copy)
    return made


def engine_for(directory: Path, ranks: int = 1) -> LLMEngine:
    config = EngineConfig(
        model=str(directory),
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


def packed(engine: LLMEngine) -> dict[str, torch.Tensor]:
    """Every packed stack's blocks and scales (rank 0's), as checkpoint names."""
    out = {}
    for prefix, module in engine.model.named_modules():
        if isinstance(module, StackedExperts) and module.packed:
            for stack in ("gate_up_proj", "down_proj"):
                blocks, scales = packed_stack(module, stack)
                out[f"{prefix}.{stack}_blocks"] = blocks.reshape(*blocks.shape[:2], -1, 16)
                out[f"{prefix}.{stack}_scales"] = scales
    return {name: t.clone() for name, t in out.items()}


def test_the_experts_hold_the_checkpoints_blocks_and_scales(checkpoints: dict[str, Path]) -> None:
    stored = load_file(str(checkpoints["mxfp4"] / "model.safetensors"))
    ours = packed(engine_for(checkpoints["mxfp4"]))
    assert ours and set(ours) == {n for n in stored if n.endswith(("_blocks", "_scales"))}
    for name, tensor in ours.items():
        assert torch.equal(tensor, stored[name]), name


def test_greedy_ids_on_packed_experts_equal_hf_on_the_dequantized_ones(
    checkpoints: dict[str, Path],
) -> None:
    engine = engine_for(checkpoints["mxfp4"])
    hf = load_hf_dequantized(checkpoints["mxfp4"])
    batch = [[0, *range(5, 5 + n)] for n in (3, 20)]
    for prompt, result in zip(batch, engine.generate(batch, GREEDY), strict=True):
        assert result.token_ids == hf_greedy(hf, prompt, 6)[0]


def test_updates_copy_blocks_and_quantize_full_precision(checkpoints: dict[str, Path]) -> None:
    engine = engine_for(checkpoints["mxfp4"])
    engine.update_weights(checkpoints["other_mxfp4"])
    assert_equal(packed(engine), packed(engine_for(checkpoints["other_mxfp4"])))
    engine.update_weights(checkpoints["other_full"])  # full precision: quantized
    assert_equal(packed(engine), packed(engine_for(checkpoints["other_mxfp4"])))
    stored = load_file(str(checkpoints["mxfp4"] / "model.safetensors"))
    blocks, scales = f"{EXPERTS}.down_proj_blocks", f"{EXPERTS}.down_proj_scales"
    new = torch.randn(stored[blocks].shape[0], 64, 64, generator=torch.Generator().manual_seed(2))
    engine.update_weights(
        {
            f"{EXPERTS}.gate_up_proj_blocks": stored[f"{EXPERTS}.gate_up_proj_blocks"],
            f"{EXPERTS}.gate_up_proj_scales": stored[f"{EXPERTS}.gate_up_proj_scales"],
            f"{EXPERTS}.down_proj": new,
        }
    )
    ours = packed(engine)
    expected_blocks, expected_scales = quantize_mxfp4(new)
    assert torch.equal(ours[blocks], expected_blocks) and torch.equal(ours[scales], expected_scales)
    gate_up = f"{EXPERTS}.gate_up_proj_blocks"
    assert torch.equal(ours[gate_up], stored[gate_up])


def assert_equal(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name


def test_two_ranks_of_packed_experts_give_one_ranks_tokens(checkpoints: dict[str, Path]) -> None:
    one, two = engine_for(checkpoints["mxfp4"]), engine_for(checkpoints["mxfp4"], 2)
    try:
        assert packed(two)  # each rank's half of the intermediate dim: one 32-value block
        batch = [[0, *range(5, 5 + n)] for n in (3, 20)]
        for a, b in zip(one.generate(batch, GREEDY), two.generate(batch, GREEDY), strict=True):
            assert b.token_ids == a.token_ids
            torch.testing.assert_close(
                torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0
            )
    finally:
        two.close()


def test_a_wake_after_a_level_2_sleep_reads_the_blocks_again(checkpoints: dict[str, Path]) -> None:
    engine = engine_for(checkpoints["mxfp4"])
    before = packed(engine)
    engine.sleep(level=2)
    engine.wake_up()
    assert_equal(packed(engine), before)
