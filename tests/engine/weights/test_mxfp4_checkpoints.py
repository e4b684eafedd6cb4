"""A gpt-oss checkpoint whose experts are shipped as MXFP4 (`*_blocks` / `*_scales` and
`quant_method: mxfp4`, as the released gpt-oss checkpoints are) loads unchanged: every tensor
equals transformers' `Mxfp4Config(dequantize=True)` load bit for bit, greedy ids equal its
`generate` and logprobs are within 1e-4 in float32; weight updates take a full-precision or an
MXFP4 checkpoint, and in-process blocks with their scales; a level-2 sleep's wake reads the
blocks again; two tensor-parallel ranks each keep their slice of the dequantized experts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.protocol.messages import WeightsPhase
from engine.weights.staging import WeightUpdateError
from tests.support.mxfp4_checkpoints import load_hf_dequantized, quantize_experts, quantize_mxfp4
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

# MXFP4 scales 32 values of an expert's input dim: hidden 64 (gate_up), intermediate 64 (down).
GPT_OSS = {"hidden_size": 64, "intermediate_size": 64}
NEW_TOKENS = 24
EXPERTS = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The served MXFP4 checkpoint (seed 0) and its full-precision original; seed 1's in full
    precision and in MXFP4 (the updates)."""
    made = {}
    for seed, name in ((0, "full"), (1, "other_full")):
        directory = tmp_path_factory.mktemp(name)
        made[name] = make_checkpoint(directory, "gpt_oss", seed=seed, **GPT_OSS)
    for name, source in (("mxfp4", "full"), ("other_mxfp4", "other_full")):
        copy = Path(shutil.copytree(made[source], tmp_path_factory.mktemp(name) / "ckpt"))
        made[name] = quantize_experts(copy)
    return made


def engine_for(directory: Path, dtype: str = "float32") -> LLMEngine:
    config = EngineConfig(model=str(directory), device="cpu", dtype=dtype, warmup=False)
    return LLMEngine(config)


def served(engine: LLMEngine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.model.checkpoint_tensors().items()}


def greedy(tokens: int = NEW_TOKENS, **extra: bool) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, **extra)


def test_the_packing_is_what_transformers_dequantizes(checkpoints: dict[str, Path]) -> None:
    """The test's own quantizer, checked against transformers' dequantization: each value
    within its block's rounding step, and the dequantized tensor quantizes to the same bytes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = load_hf_model(checkpoints["full"]).state_dict()
    for proj in ("gate_up_proj", "down_proj"):
        weight = model[f"{EXPERTS}.{proj}"]  # [experts, in, out]
        blocks, scales = quantize_mxfp4(weight)
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert theirs.shape == weight.shape, proj
        # 2^e per value, laid out as the weight: [experts, out, in / 32] -> [experts, in, out].
        step = (scales.float() - 127).exp2().repeat_interleave(32, dim=-1).transpose(1, 2)
        assert bool(((theirs - weight).abs() <= 2 * step).all()), proj  # 6..8 saturate at 6
        assert (theirs - weight).norm() < 0.15 * weight.norm(), proj
        again = quantize_mxfp4(theirs)
        assert torch.equal(again[0], blocks) and torch.equal(again[1], scales), proj


def test_the_checkpoint_holds_blocks_and_scales_in_place_of_the_experts(
    checkpoints: dict[str, Path],
) -> None:
    full = load_file(checkpoints["full"] / "model.safetensors")
    quantized = load_file(checkpoints["mxfp4"] / "model.safetensors")
    expert_names = {n for n in full if n.endswith(("gate_up_proj", "down_proj"))}
    assert len(expert_names) == 4  # two layers
    packed = {f"{n}{part}" for n in expert_names for part in ("_blocks", "_scales")}
    assert set(quantized) == (set(full) - expert_names) | packed
    assert all(quantized[n].dtype == torch.uint8 for n in packed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_tensor_equals_transformers_dequantized_bit_for_bit(
    checkpoints: dict[str, Path], dtype: str
) -> None:
    theirs = load_hf_dequantized(checkpoints["mxfp4"], getattr(torch, dtype)).state_dict()
    ours = engine_for(checkpoints["mxfp4"], dtype).model.checkpoint_tensors()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert theirs[name].dtype == tensor.dtype, name
        assert torch.equal(tensor, theirs[name].to(tensor.dtype)), name


def test_greedy_ids_and_logprobs_equal_hf_on_the_dequantized_experts(
    checkpoints: dict[str, Path],
) -> None:
    engine = engine_for(checkpoints["mxfp4"])
    batch = prompts(engine.info.vocab_size, count=6)  # 4..44 tokens: past the 8-token window
    results = engine.generate(batch, greedy(logprobs=True))
    hf = load_hf_dequantized(checkpoints["mxfp4"])
    for prompt, result in zip(batch, results, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert result.error is None
        assert result.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(result.logprobs), chosen, atol=1e-4, rtol=0)


@pytest.mark.parametrize("source", ["other_full", "other_mxfp4"])
def test_a_checkpoint_update_full_precision_or_mxfp4_serves_its_weights(
    checkpoints: dict[str, Path], source: str
) -> None:
    engine = engine_for(checkpoints["mxfp4"])
    reference = engine_for(checkpoints[source])
    expected = served(reference)
    name = f"{EXPERTS}.gate_up_proj"
    assert not torch.equal(served(engine)[name], expected[name])
    assert engine.update_weights(checkpoints[source]).phase is WeightsPhase.APPLIED
    for name, tensor in served(engine).items():
        assert torch.equal(tensor, expected[name]), name
    batch = prompts(engine.info.vocab_size, count=3)
    ours, theirs = engine.generate(batch, greedy(12)), reference.generate(batch, greedy(12))
    assert [r.token_ids for r in ours] == [r.token_ids for r in theirs]


def test_in_process_blocks_with_their_scales_are_dequantized(
    checkpoints: dict[str, Path],
) -> None:
    engine = engine_for(checkpoints["mxfp4"])
    before = served(engine)
    name = f"{EXPERTS}.down_proj"
    file = load_file(checkpoints["other_mxfp4"] / "model.safetensors")
    update = {f"{name}_blocks": file[f"{name}_blocks"], f"{name}_scales": file[f"{name}_scales"]}
    assert engine.update_weights(update).phase is WeightsPhase.APPLIED
    expected = served(engine_for(checkpoints["other_mxfp4"]))[name]
    assert not torch.equal(expected, before[name])
    for key, tensor in served(engine).items():
        assert torch.equal(tensor, expected if key == name else before[key]), key


def test_blocks_without_their_scales_are_refused_and_change_nothing(
    checkpoints: dict[str, Path],
) -> None:
    engine = engine_for(checkpoints["mxfp4"])
    before = served(engine)
    name = f"{EXPERTS}.gate_up_proj_blocks"
    file = load_file(checkpoints["other_mxfp4"] / "model.safetensors")
    with pytest.raises(WeightUpdateError, match="without its scales") as err:
        engine.update_weights({name: file[name]})
    assert err.value.code == "INVALID_ARGUMENT"
    for key, tensor in served(engine).items():
        assert torch.equal(tensor, before[key]), key


def test_a_wake_after_a_level_2_sleep_reads_the_mxfp4_experts_again(
    checkpoints: dict[str, Path],
) -> None:
    engine = engine_for(checkpoints["mxfp4"])
    before = served(engine)
    engine.sleep(level=2)
    assert engine.model.model.layers[1].mlp.experts.down_proj.untyped_storage().nbytes() == 0
    engine.wake_up()
    for name, tensor in served(engine).items():
        assert torch.equal(tensor, before[name]), name


def test_two_ranks_each_keep_their_slice_of_the_dequantized_experts(
    checkpoints: dict[str, Path],
) -> None:
    """Tensor parallel (gloo, CPU): each rank dequantizes an expert tensor whole and keeps its
    columns or rows; greedy ids equal transformers' and logprobs one rank's within 1e-4."""
    config = EngineConfig(
        model=str(checkpoints["mxfp4"]),
        device="cpu",
        dtype="float32",
        cpu_threads=1,  # two ranks of two threads on two cores run 10-100x slower
        tensor_parallel_size=2,
        warmup=False,
    )
    two = LLMEngine(config)
    try:
        batch = prompts(two.info.vocab_size, count=4)[1:]  # 12..28 tokens: past the window
        params = greedy(12, logprobs=True)
        split = two.generate(batch, params)
        single = engine_for(checkpoints["mxfp4"]).generate(batch, params)
    finally:
        two.close()
    hf = load_hf_dequantized(checkpoints["mxfp4"])
    for prompt, a, b in zip(batch, single, split, strict=True):
        assert b.token_ids == a.token_ids == hf_greedy(hf, prompt, 12)[0]
        torch.testing.assert_close(
            torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0
        )
