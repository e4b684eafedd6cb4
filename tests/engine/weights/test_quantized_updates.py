"""Weight updates to a model served from a quantized checkpoint: a quantized checkpoint (its
tensors with their scales) and a full-precision one both replace the served weights, as do
in-process tensors, quantized with their scales or not; a level-2 sleep's wake reads the
quantized checkpoint again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.protocol.messages import InflightPolicy, UpdateWeights, WeightsPhase
from engine.weights.staging import WeightUpdateError
from tests.support.quantized_checkpoints import quantize_checkpoint
from tests.support.tiny_models import make_checkpoint

QWEN3 = {
    "hidden_size": 256,
    "intermediate_size": 384,
    "head_dim": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
PROMPT = [0, 17, 42, 99, 123, 7, 88, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
NAME = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The served FP8 checkpoint (seed 0), and seed 1's in full precision and in FP8."""
    served = make_checkpoint(tmp_path_factory.mktemp("a_fp8"), "qwen3", seed=0, **QWEN3)
    full = make_checkpoint(tmp_path_factory.mktemp("b_full"), "qwen3", seed=1, **QWEN3)
    fp8 = Path(shutil.copytree(full, tmp_path_factory.mktemp("b") / "fp8"))
    return {
        "served": quantize_checkpoint(served, "fp8"),
        "full": full,
        "fp8": quantize_checkpoint(fp8, "fp8"),
    }


def engine_for(directory: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(directory), device="cpu", dtype="float32"))


def served(engine: LLMEngine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.model.checkpoint_tensors().items()}


@pytest.mark.parametrize("source", ["fp8", "full"])
def test_a_checkpoint_update_quantized_or_not_serves_its_weights(
    checkpoints: dict[str, Path], source: str
) -> None:
    engine = engine_for(checkpoints["served"])
    reference = engine_for(checkpoints[source])
    assert (
        engine.generate([PROMPT], GREEDY)[0].token_ids
        != reference.generate([PROMPT], GREEDY)[0].token_ids
    )
    applied = engine.update_weights(checkpoints[source])
    assert applied.phase == WeightsPhase.APPLIED
    expected = served(reference)
    for name, tensor in served(engine).items():
        assert torch.equal(tensor, expected[name]), name
    assert (
        engine.generate([PROMPT], GREEDY)[0].token_ids
        == reference.generate([PROMPT], GREEDY)[0].token_ids
    )


def test_in_process_quantized_tensors_with_their_scales_are_dequantized(
    checkpoints: dict[str, Path],
) -> None:
    engine = engine_for(checkpoints["served"])
    before = served(engine)
    file = load_file(str(checkpoints["fp8"] / "model.safetensors"))
    scale = NAME.removesuffix("weight") + "weight_scale_inv"
    engine.update_weights({NAME: file[NAME], scale: file[scale]})
    expected = served(engine_for(checkpoints["fp8"]))[NAME]
    for name, tensor in served(engine).items():
        assert torch.equal(tensor, expected if name == NAME else before[name]), name


def test_in_process_full_precision_tensors_replace_the_dequantized_ones(
    checkpoints: dict[str, Path],
) -> None:
    engine = engine_for(checkpoints["served"])
    new = torch.randn_like(served(engine)[NAME])
    engine.update_weights({NAME: new})
    assert torch.equal(served(engine)[NAME], new)


def test_quantized_data_without_its_scales_is_refused_and_changes_nothing(
    checkpoints: dict[str, Path],
) -> None:
    engine = engine_for(checkpoints["served"])
    before = served(engine)
    file = load_file(str(checkpoints["fp8"] / "model.safetensors"))
    with pytest.raises(WeightUpdateError, match="without its scales") as err:
        engine.update_weights({NAME: file[NAME]})
    assert err.value.code == "INVALID_ARGUMENT"
    for name, tensor in served(engine).items():
        assert torch.equal(tensor, before[name]), name


def test_a_checkpoint_in_a_quantization_sluice_does_not_compute_is_refused_before_the_pause(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    engine = engine_for(checkpoints["served"])
    before = served(engine)
    directory = Path(shutil.copytree(checkpoints["fp8"], tmp_path / "static"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (directory / "config.json").write_text(json.dumps(config))
    engine.add_request("running", PROMPT, GREEDY)
    engine.step()  # a request runs: a DRAIN that passed its checks would pause admission
    engine.start_weight_update(
        UpdateWeights("static", 0, InflightPolicy.DRAIN, checkpoint_dir=str(directory))
    )
    (failed,) = engine.updater.events  # no PAUSED before it
    assert failed.phase == WeightsPhase.FAILED and failed.error_code == "INVALID_ARGUMENT"
    assert "activation_scheme 'static'" in failed.message
    assert not engine.stats().updating_weights
    for name, tensor in served(engine).items():
        assert torch.equal(tensor, before[name]), name


def test_a_wake_after_a_level_2_sleep_reads_the_quantized_checkpoint_again(
    checkpoints: dict[str, Path],
) -> None:
    engine = engine_for(checkpoints["served"])
    before = engine.generate([PROMPT], GREEDY)[0].token_ids
    engine.sleep(level=2)
    engine.wake_up()
    assert engine.generate([PROMPT], GREEDY)[0].token_ids == before
