"""A weight update whose source is bad fails before anything pauses; progress carries totals."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.protocol.messages import InflightPolicy, TensorRef, UpdateWeights, WeightsPhase

PROMPT = [0, 17, 42, 99, 123, 7]
NORM = "model.norm.weight"


def make_engine(checkpoint: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32"))


def rewritten(source: Path, directory: Path, change: str) -> Path:
    """A copy of checkpoint `source` with one thing wrong in its tensors."""
    shutil.copytree(source, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    match change:
        case "unknown tensor":
            tensors["model.layers.9.nope.weight"] = tensors[NORM].clone()
        case "wrong shape":
            tensors[NORM] = tensors[NORM][:-1].clone()
        case "missing tensor":
            del tensors[NORM]
        case "integer dtype":
            tensors[NORM] = tensors[NORM].to(torch.int32)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def tensor_file(directory: Path, name: str, tensor: torch.Tensor, dtype: str) -> UpdateWeights:
    path = directory / "tensors.bin"
    data = tensor.numpy().tobytes()
    path.write_bytes(data)
    ref = TensorRef(name, dtype, tuple(tensor.shape), 0, len(data))
    return UpdateWeights("bad", 0, InflightPolicy.DRAIN, tensor_file=str(path), tensors=(ref,))


def bad_update(case: str, tiny_llama: Path, tmp_path: Path) -> tuple[UpdateWeights, str]:
    """(the update, what its refusal must name)."""
    norm = load_file(str(tiny_llama / "model.safetensors"))[NORM]
    checkpoint = {
        "missing directory": (str(tmp_path / "nowhere"), "nowhere"),
        "unknown tensor": ("unknown tensor", "model.layers.9.nope.weight"),
        "wrong shape": ("wrong shape", NORM),
        "missing tensor": ("missing tensor", NORM),
        "integer dtype": ("integer dtype", NORM),
    }
    if case in checkpoint:
        change, named = checkpoint[case]
        directory = (
            change
            if case == "missing directory"
            else str(rewritten(tiny_llama, tmp_path / "ckpt", change))
        )
        return UpdateWeights("bad", 0, InflightPolicy.DRAIN, checkpoint_dir=directory), named
    if case == "inline wrong dtype":
        return tensor_file(tmp_path, NORM, norm.to(torch.float16), "F16"), NORM
    if case == "inline unknown tensor":
        return tensor_file(tmp_path, "model.layers.9.nope.weight", norm, "F32"), "nope"
    assert case == "inline wrong shape"
    return tensor_file(tmp_path, NORM, norm[:-1].clone(), "F32"), NORM


@pytest.mark.parametrize(
    "case",
    [
        "missing directory",
        "unknown tensor",
        "wrong shape",
        "missing tensor",
        "integer dtype",
        "inline wrong dtype",
        "inline unknown tensor",
        "inline wrong shape",
    ],
)
def test_a_bad_drain_update_fails_at_once_and_new_requests_run_beside_the_long_one(
    tiny_llama: Path, tmp_path: Path, case: str
) -> None:
    engine = make_engine(tiny_llama)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine.add_request("long", PROMPT, long)
    engine.step()
    msg, named = bad_update(case, tiny_llama, tmp_path)
    engine.start_weight_update(msg)
    (failed,) = engine.updater.events  # no PAUSED: nothing stopped admitting
    assert failed.phase == WeightsPhase.FAILED and failed.error_code == "INVALID_ARGUMENT"
    assert named in failed.message
    assert not engine.stats().updating_weights
    engine.add_request("short", PROMPT, SamplingParams(temperature=0.0, max_tokens=2))
    finished: list[str] = []
    while "short" not in finished:
        finished += [o.request_id for o in engine.step() if o.finish_reason is not None]
    assert "long" not in finished  # the short one ran beside it, not after it


@pytest.mark.parametrize("source", ["checkpoint", "tensor file"])
def test_every_loading_event_carries_totals_that_bound_its_counts(
    tiny_llama: Path, tmp_path: Path, source: str
) -> None:
    engine = make_engine(tiny_llama)
    params = engine.model.checkpoint_tensors()
    if source == "checkpoint":
        msg = UpdateWeights("u", 0, InflightPolicy.CONTINUE, checkpoint_dir=str(tiny_llama))
        expected = (sum(p.numel() * 4 for p in params.values()), len(params))
    else:
        msg = replace(
            tensor_file(tmp_path, NORM, params[NORM].detach().clone(), "F32"),
            inflight=InflightPolicy.CONTINUE,
        )
        expected = (params[NORM].numel() * 4, 1)
    engine.start_weight_update(msg)
    loading = [e for e in engine.updater.events if e.phase is WeightsPhase.LOADING]
    assert engine.updater.events[-1].phase == WeightsPhase.APPLIED and len(loading) >= 2
    for event in loading:
        assert (event.bytes_total, event.tensors_total) == expected
        assert 0 < event.bytes_done <= event.bytes_total
        assert 0 < event.tensors_done <= event.tensors_total
    assert (loading[-1].bytes_done, loading[-1].tensors_done) == expected
