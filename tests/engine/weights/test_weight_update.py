"""Live weight updates in the engine: sources, in-flight policies, atomicity, versions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.protocol.messages import (
    MAX_POLICY_VERSION,
    InflightPolicy,
    RequestOutput,
    TensorRef,
    UpdateWeights,
    WeightsPhase,
    WeightsProgress,
)
from engine.weights.staging import WeightUpdateError
from tests.support.tiny_models import make_checkpoint

PROMPT = [0, 17, 42, 99, 123, 7, 88, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # > one page of 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes as tiny_llama, other weights."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama_b"), "llama", seed=1)


def make_engine(checkpoint: Path, **overrides: object) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", **overrides)
    )


def greedy(engine: LLMEngine, prompt: list[int] = PROMPT, max_tokens: int = 12) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return engine.generate([prompt], params)[0].token_ids


def run_until(engine: LLMEngine, request_id: str, tokens: int) -> list[int]:
    """Step until `request_id` has `tokens` tokens; returns them."""
    got: list[int] = []
    while len(got) < tokens:
        got += [t for o in engine.step() if o.request_id == request_id for t in o.new_token_ids]
    return got


def drain(engine: LLMEngine) -> list[RequestOutput]:
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    return outputs


def test_update_from_a_checkpoint_serves_its_weights_under_the_next_version(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    engine, reference_b = make_engine(tiny_llama), make_engine(checkpoint_b)
    assert greedy(engine) != greedy(reference_b)
    applied = engine.update_weights(checkpoint_b)
    assert (applied.phase, applied.previous_version, applied.policy_version) == (
        WeightsPhase.APPLIED,
        0,
        1,
    )
    result = engine.generate([PROMPT], GREEDY)[0]
    assert result.token_ids == greedy(reference_b)
    assert set(result.policy_versions) == {1} and engine.stats().policy_version == 1


def test_continue_swaps_between_steps_and_tags_every_token(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    engine = make_engine(tiny_llama)
    engine.add_request("r", PROMPT, GREEDY)
    before = run_until(engine, "r", 4)
    engine.update_weights(checkpoint_b, inflight=InflightPolicy.CONTINUE)
    outputs = [o for o in drain(engine) if o.request_id == "r"]
    versions = [o.policy_version for o in outputs for _ in o.new_token_ids]
    assert before == greedy(make_engine(tiny_llama))[:4]
    assert len(before) + len(versions) == 12 and set(versions) == {1}


def test_recompute_continues_like_the_new_weights_from_the_tokens_so_far(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    engine = make_engine(tiny_llama)
    engine.add_request("r", PROMPT, GREEDY)
    before = run_until(engine, "r", 5)
    applied = engine.update_weights(checkpoint_b, inflight=InflightPolicy.RECOMPUTE)
    assert applied.recomputed == 1
    after = [t for o in drain(engine) if o.request_id == "r" for t in o.new_token_ids]
    expected = greedy(make_engine(checkpoint_b), PROMPT + before, max_tokens=12 - len(before))
    assert after == expected


def test_abort_ends_running_requests_with_their_partial_output(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=1)
    engine.add_request("running", PROMPT, GREEDY)
    partial = run_until(engine, "running", 3)
    engine.add_request("waiting", PROMPT, GREEDY)  # max_num_seqs=1: still queued
    applied = engine.update_weights(checkpoint_b, inflight=InflightPolicy.ABORT)
    assert applied.aborted == 1
    outputs = drain(engine)
    ended = next(o for o in outputs if o.request_id == "running")
    assert ended.finish_reason == FinishReason.ABORTED and ended.completion_tokens == len(partial)
    waiting = [t for o in outputs if o.request_id == "waiting" for t in o.new_token_ids]
    assert waiting == greedy(make_engine(checkpoint_b))


def test_drain_lets_running_requests_finish_on_the_old_weights_and_holds_new_ones(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    engine = make_engine(tiny_llama)
    engine.add_request("old", PROMPT, GREEDY)
    run_until(engine, "old", 2)
    engine.start_weight_update(
        UpdateWeights("u1", 0, InflightPolicy.DRAIN, checkpoint_dir=str(checkpoint_b))
    )
    engine.add_request("new", PROMPT, GREEDY)  # arrives while draining: waits
    outputs = drain(engine)
    old = [o for o in outputs if o.request_id == "old"]
    new = [o for o in outputs if o.request_id == "new"]
    assert {o.policy_version for o in old} == {0} and {o.policy_version for o in new} == {1}
    assert [t for o in new for t in o.new_token_ids] == greedy(make_engine(checkpoint_b))
    phases = [e.phase for e in engine.updater.events]
    assert phases[0] == WeightsPhase.PAUSED and phases[-1] == WeightsPhase.APPLIED


def test_drain_timeout_fails_and_keeps_the_old_weights(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    engine = make_engine(tiny_llama)
    engine.add_request(
        "long", PROMPT, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    )
    run_until(engine, "long", 1)
    with pytest.raises(WeightUpdateError) as err:
        engine.update_weights(checkpoint_b, drain_timeout=0.0)
    assert err.value.code == "ABORTED"
    assert engine.stats().policy_version == 0 and greedy(engine) == greedy(make_engine(tiny_llama))


def bad_updates(engine: LLMEngine, tmp_path: Path) -> dict[str, tuple[dict, str]]:
    weight = engine.model.checkpoint_tensors()["model.layers.0.mlp.up_proj.weight"]
    return {
        "wrong shape": (
            {"source": {"model.layers.0.mlp.up_proj.weight": weight[:-1].clone()}},
            "INVALID_ARGUMENT",
        ),
        "unknown name": (
            {"source": {"model.layers.7.mlp.up_proj.weight": weight.clone()}},
            "INVALID_ARGUMENT",
        ),
        "wrong dtype": (
            {"source": {"model.layers.0.mlp.up_proj.weight": weight.to(torch.float16)}},
            "INVALID_ARGUMENT",
        ),
        "same version": (
            {"source": {}, "policy_version": engine.policy_version},
            "FAILED_PRECONDITION",
        ),
        "unreadable checkpoint": ({"source": str(tmp_path / "nowhere")}, "INVALID_ARGUMENT"),
        "version past the largest": (
            {"source": {}, "policy_version": MAX_POLICY_VERSION + 1},
            "OUT_OF_RANGE",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "wrong shape",
        "unknown name",
        "wrong dtype",
        "same version",
        "unreadable checkpoint",
        "version past the largest",
    ],
)
def test_a_refused_update_changes_nothing(tiny_llama: Path, tmp_path: Path, case: str) -> None:
    engine = make_engine(tiny_llama, policy_version=5)
    before = greedy(engine)
    update, code = bad_updates(engine, tmp_path)[case]
    with pytest.raises(WeightUpdateError) as err:
        engine.update_weights(**update)
    assert err.value.code == code
    assert engine.stats().policy_version == 5 and not engine.stats().updating_weights
    assert greedy(engine) == before


def test_a_tensor_file_update_changes_exactly_the_tensors_it_names(
    tiny_llama: Path, tmp_path: Path
) -> None:
    engine = make_engine(tiny_llama)
    before = checkpoint_tensors(engine)
    # k_proj: the middle rows of the merged qkv_proj; the norm: a parameter of its own.
    names = ["model.layers.0.self_attn.k_proj.weight", "model.norm.weight"]
    new = {name: torch.randn_like(before[name]) for name in names}
    path, refs, offset = tmp_path / "tensors.bin", [], 0
    with open(path, "wb") as f:
        for name, tensor in new.items():
            data = tensor.numpy().tobytes()
            f.write(data)
            refs.append(TensorRef(name, "F32", tuple(tensor.shape), offset, len(data)))
            offset += len(data)
    msg = UpdateWeights(
        "file", 5, InflightPolicy.CONTINUE, tensor_file=str(path), tensors=tuple(refs)
    )
    engine.start_weight_update(msg)
    assert engine.updater.events[-1].phase == WeightsPhase.APPLIED
    assert engine.stats().policy_version == 5
    for name, tensor in checkpoint_tensors(engine).items():
        assert torch.equal(tensor, new.get(name, before[name])), name


def test_prefixes_cached_under_old_weights_are_not_reused(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    engine = make_engine(tiny_llama, page_size=4)
    engine.generate([PROMPT], GREEDY)
    assert engine.generate([PROMPT], GREEDY)[0].cached_tokens > 0
    engine.update_weights(checkpoint_b)
    assert engine.generate([PROMPT], GREEDY)[0].cached_tokens == 0


def test_live_weights_mutates_in_place_and_publishes_a_version(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    engine = make_engine(tiny_llama)
    b = make_engine(checkpoint_b).model.checkpoint_tensors()
    with engine.live_weights(policy_version=3) as params:
        for name, param in params.items():
            param.copy_(b[name])  # plain in-place copy: the engine holds no autograd state
    assert engine.stats().policy_version == 3
    assert greedy(engine) == greedy(make_engine(checkpoint_b))
    with pytest.raises(WeightUpdateError), engine.live_weights(policy_version=2):
        pass


def checkpoint_tensors(engine: LLMEngine) -> dict[str, torch.Tensor]:
    """Copies of the served weights, by checkpoint name."""
    return {name: t.clone() for name, t in engine.model.checkpoint_tensors().items()}


def test_the_next_version_after_the_largest_is_out_of_range_and_changes_nothing(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    engine = make_engine(tiny_llama, policy_version=MAX_POLICY_VERSION)
    before = checkpoint_tensors(engine)
    for inflight in (InflightPolicy.DRAIN, InflightPolicy.CONTINUE):
        with pytest.raises(WeightUpdateError) as err:
            engine.update_weights(checkpoint_b, inflight=inflight)  # 0 = served + 1
        assert err.value.code == "OUT_OF_RANGE"
    with pytest.raises(WeightUpdateError) as err, engine.live_weights() as params:
        params["model.norm.weight"].zero_()  # never reached
    assert err.value.code == "OUT_OF_RANGE"
    stats = engine.stats()
    assert stats.policy_version == MAX_POLICY_VERSION and not stats.updating_weights
    assert all(torch.equal(p, before[name]) for name, p in checkpoint_tensors(engine).items())
    assert engine.generate([PROMPT], GREEDY)[0].policy_versions == [MAX_POLICY_VERSION] * 12


def test_the_largest_version_itself_is_accepted(tiny_llama: Path, checkpoint_b: Path) -> None:
    engine = make_engine(tiny_llama, policy_version=MAX_POLICY_VERSION - 1)
    applied = engine.update_weights(checkpoint_b)
    assert applied.policy_version == engine.stats().policy_version == MAX_POLICY_VERSION


def test_a_start_version_outside_the_range_is_refused() -> None:
    for version in (-1, MAX_POLICY_VERSION + 1):
        with pytest.raises(ValueError, match="policy_version"):
            EngineConfig(model="demo", policy_version=version)
    assert EngineConfig(model="demo", policy_version=MAX_POLICY_VERSION).policy_version


def test_progress_goes_to_an_installed_sink_and_update_weights_still_answers(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    engine = make_engine(tiny_llama)
    received: list[WeightsProgress] = []
    engine.updater.sink = received.append
    applied = engine.update_weights(checkpoint_b)
    assert applied.phase == WeightsPhase.APPLIED and received[-1] == applied
    assert [e.phase for e in received[:2]] == [WeightsPhase.PAUSED, WeightsPhase.LOADING]
    assert engine.updater.events == []
