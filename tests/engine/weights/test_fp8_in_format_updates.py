"""Weight updates into FP8 projections held in format (the Triton layers: forced on the CPU
under Triton's interpreter, float32): quantized tensors with their scales are copied in as
they are, full-precision ones are quantized to the model's format (amax / 448 per block, bit
for bit transformers' quantizers), from a checkpoint directory or in process; e4m3 data without
its scales, or scales that do not fit, are refused and change nothing; live_weights (in-place
edits of the e4m3 views) is refused.

NOTE: `use_triton` runs at collection: it chooses the interpreter before triton is imported.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from engine import EngineConfig, LLMEngine
from engine.weights.fp8_format import Fp8Format
from engine.weights.fp8_layers import Fp8Slot
from engine.weights.in_format import in_format
from engine.weights.staging import WeightUpdateError
from tests.support.quantized_checkpoints import quantize_checkpoint
from tests.support.tiny_models import make_checkpoint
from tests.support.triton_interpreter import use_triton

use_triton("cpu")

QWEN3 = {
    "hidden_size": 256,
    "intermediate_size": 384,
    "head_dim": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
}
NAME = "model.layers.1.mlp.down_proj.weight"
SCALE = "model.layers.1.mlp.down_proj.weight_scale_inv"
BLOCK = Fp8Format((128, 128))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The served FP8 checkpoint (seed 0), and seed 1's in full precision and in FP8."""
    served = make_checkpoint(tmp_path_factory.mktemp("a"), "qwen3", seed=0, **QWEN3)
    full = make_checkpoint(tmp_path_factory.mktemp("b_full"), "qwen3", seed=1, **QWEN3)
    fp8 = Path(shutil.copytree(full, tmp_path_factory.mktemp("b") / "fp8"))
    return {
        "served": quantize_checkpoint(served, "fp8"),
        "full": full,
        "fp8": quantize_checkpoint(fp8, "fp8"),
    }


def engine_for(directory: Path) -> LLMEngine:
    config = EngineConfig(
        model=str(directory),
        device="cpu",
        dtype="float32",
        attention_backend="torch_ref",
        layer_kernels="triton",
        enforce_eager=True,
        warmup=False,
    )
    return LLMEngine(config)


def fp8_slots(engine: LLMEngine) -> dict[str, Fp8Slot]:
    slots = in_format(engine.model).slots
    assert all(isinstance(slot, Fp8Slot) for slot in slots.values())
    return slots  # type: ignore[return-value]


def served(engine: LLMEngine) -> dict[str, torch.Tensor]:
    """Every served tensor (e4m3 ones as their bytes), and each in-format one's scales."""
    tensors = engine.model.checkpoint_tensors()
    out = {n: t.view(torch.uint8) if t.element_size() == 1 else t for n, t in tensors.items()}
    out |= {f"{n} scales": slot.scale for n, slot in fp8_slots(engine).items()}
    return {name: t.clone() for name, t in out.items()}


def assert_serves(engine: LLMEngine, expected: dict[str, torch.Tensor]) -> None:
    ours = served(engine)
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name


def test_the_quantizer_is_transformers_bit_for_bit() -> None:
    from transformers import FineGrainedFP8Config
    from transformers.integrations.compressed_tensors import quantize_fp8_per_row
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    weight = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * 0.05
    weight[:128, :128] = 0  # an all-zero block keeps scale 1
    op = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config()))
    theirs = op._quantize_one("w.weight", weight)
    data, scales = BLOCK.quantize(weight)
    assert torch.equal(data.view(torch.uint8), theirs["w.weight"].view(torch.uint8))
    assert torch.equal(scales, theirs["w.weight_scale_inv"])
    data, scales = Fp8Format(None).quantize(weight)
    their_data, their_scales = quantize_fp8_per_row(weight)
    assert torch.equal(data.view(torch.uint8), their_data.view(torch.uint8))
    assert torch.equal(scales, their_scales[:, None])


@pytest.mark.parametrize("source", ["fp8", "full"])
def test_a_checkpoint_update_copies_fp8_and_quantizes_full_precision(
    checkpoints: dict[str, Path], source: str
) -> None:
    engine = engine_for(checkpoints["served"])
    engine.update_weights(checkpoints[source])
    # The reference: the FP8 checkpoint as loaded; the full one quantized by transformers'
    # quantizer, which is what quantize_checkpoint writes (the test above: ours is the same).
    assert_serves(engine, served(engine_for(checkpoints["fp8"])))


def test_in_process_fp8_tensors_with_their_scales_are_copied_in(
    checkpoints: dict[str, Path],
) -> None:
    engine = engine_for(checkpoints["served"])
    before = served(engine)
    file = load_file(str(checkpoints["fp8"] / "model.safetensors"))
    engine.update_weights({NAME: file[NAME], SCALE: file[SCALE]})
    expected = served(engine_for(checkpoints["fp8"]))
    changed = {NAME, f"{NAME} scales"}
    assert_serves(engine, {n: expected[n] if n in changed else t for n, t in before.items()})


def test_in_process_full_precision_tensors_are_quantized_to_the_format(
    checkpoints: dict[str, Path],
) -> None:
    engine = engine_for(checkpoints["served"])
    before = served(engine)
    new = torch.randn(256, 384, generator=torch.Generator().manual_seed(3)) * 0.05
    engine.update_weights({NAME: new})
    data, scales = BLOCK.quantize(new)
    expected = {NAME: data.view(torch.uint8), f"{NAME} scales": BLOCK.row_scales(scales, 256, 384)}
    assert_serves(engine, before | expected)


BAD = {
    "data without scales": ({NAME}, "down_proj.weight: quantized data without its scales"),
    "scales without data": ({SCALE}, "weight_scale_inv has no .*down_proj.weight to scale"),
    "a wrong grid": ({NAME, SCALE}, "weight_scale_inv: scales of shape"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_fp8_update_is_refused_by_name_and_changes_nothing(
    checkpoints: dict[str, Path], case: str
) -> None:
    engine = engine_for(checkpoints["served"])
    before = served(engine)
    file = load_file(str(checkpoints["fp8"] / "model.safetensors"))
    names, message = BAD[case]
    tensors = {n: file[n] for n in names}
    if case == "a wrong grid":
        tensors[SCALE] = tensors[SCALE][:, :2]
    with pytest.raises(WeightUpdateError, match=message) as err:
        engine.update_weights(tensors)
    assert err.value.code == "INVALID_ARGUMENT"
    assert_serves(engine, before)


def test_live_weights_is_refused_on_a_model_in_fp8(checkpoints: dict[str, Path]) -> None:
    engine = engine_for(checkpoints["served"])
    with pytest.raises(WeightUpdateError, match="in format") as err, engine.live_weights():
        pass
    assert err.value.code == "FAILED_PRECONDITION"


def test_a_wake_after_a_level_2_sleep_reads_the_fp8_data_and_scales_again(
    checkpoints: dict[str, Path],
) -> None:
    engine = engine_for(checkpoints["served"])
    before = served(engine)
    with torch.no_grad():  # scales are buffers, kept through the sleep: prove they are read
        for slot in fp8_slots(engine).values():
            slot.scale.zero_()
    engine.sleep(level=2)
    engine.wake_up()
    assert_serves(engine, before)
