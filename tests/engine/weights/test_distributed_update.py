"""Distributed weight updates in the engine: a trainer (a thread here, hosting the group's
store as rank 0, with the client's TrainerGroup) broadcasts packed buckets; every rank stages
what it needs and all swap, or nothing changes and the group is left; a speculative draft
model's tensors come the same way."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sluice_client.trainer_group import TrainerGroup, bucket_layout

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.protocol.messages import (
    DistributedTensors,
    InflightPolicy,
    InitWeightTransfer,
    TensorSpec,
    TransferGroupSpec,
    UpdateWeights,
    WeightsPhase,
    WeightsProgress,
)
from engine.weights.buckets import bucket_layout as engine_layout
from engine.weights.staging import WeightUpdateError
from tests.support.tiny_models import make_checkpoint

PROMPTS = [[0, 17, 42, 99, 123, 7], [0, 5, 6, 7, 8, 9, 10, 11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BUCKET = 4096  # bytes: several buckets, and tensors larger than one (the embeddings)
TIMEOUT = 20.0


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama_b"), "llama", seed=1)


@pytest.fixture(scope="module")
def weights_b(checkpoint_b: Path) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in make_engine(checkpoint_b).model.checkpoint_tensors().items()}


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        engine.close()


def make_engine(model: Path, ranks: int = 1) -> LLMEngine:
    config = EngineConfig(
        model=str(model), device="cpu", dtype="float32", tensor_parallel_size=ranks, cpu_threads=1
    )
    return LLMEngine(config)


def greedy(engine: LLMEngine) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]


class Trainer:
    """Rank 0 of a group of 1 + `ranks`, its calls run in a background thread."""

    def __init__(self, ranks: int = 1, timeout: float = TIMEOUT) -> None:
        self.group = TrainerGroup(
            host="127.0.0.1", port=0, world_size=1 + ranks, group_name="test", timeout=timeout
        )
        self.spec = TransferGroupSpec(
            "127.0.0.1", self.group.port, 1 + ranks, 1, "gloo", "test", timeout
        )
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, fn: Callable[..., Any], *args: Any) -> None:
        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # surfaced by wait()
                self.error = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def wait(self) -> BaseException | None:
        assert self._thread is not None
        self._thread.join(TIMEOUT * 2)
        assert not self._thread.is_alive()
        return self.error


def join(engine: LLMEngine, trainer: Trainer) -> None:
    trainer.start(trainer.group.join)
    joined = engine.join_weight_transfer(InitWeightTransfer("join", trainer.spec))
    assert trainer.wait() is None
    assert (joined.error_code, joined.engine_ranks) == (None, engine.model.tp.size), joined.message


def update(tensors: dict[str, torch.Tensor], version: int = 0, **fields: Any) -> UpdateWeights:
    specs = tuple(TensorSpec(n, "F32", tuple(t.shape)) for n, t in tensors.items())
    return UpdateWeights(
        "dist",
        version,
        InflightPolicy.CONTINUE,
        distributed=DistributedTensors(specs, BUCKET),
        **fields,
    )


def push(
    engine: LLMEngine, trainer: Trainer, tensors: dict[str, torch.Tensor], version: int = 0
) -> WeightsProgress:
    msg = update(tensors, version)
    trainer.start(trainer.group.broadcast, list(tensors.values()), BUCKET)
    engine.start_weight_update(msg)  # CONTINUE: received and swapped now
    assert trainer.wait() is None
    return engine.updater.outcome(msg)


def events(engine: LLMEngine, msg: UpdateWeights) -> list[WeightsPhase]:
    phases = [e.phase for e in engine.updater.events if e.update_id == msg.update_id]
    engine.updater.events.clear()
    return phases


def test_a_push_of_every_tensor_serves_the_trainers_weights_under_the_next_version(
    tiny_llama, checkpoint_b, weights_b, engines
) -> None:
    engines.append(engine := make_engine(tiny_llama))
    want = greedy(make_engine(checkpoint_b))
    assert greedy(engine) != want
    trainer = Trainer()
    join(engine, trainer)
    applied = push(engine, trainer, weights_b)
    assert (applied.phase, applied.previous_version, applied.policy_version) == (
        WeightsPhase.APPLIED,
        0,
        1,
    )
    assert applied.replaced_all
    assert greedy(engine) == want and engine.policy_version == 1
    # The group stays joined: a second push (some tensors back to A's) needs no new join.
    reference_a = make_engine(tiny_llama)
    a = {n: t.clone() for n, t in reference_a.model.checkpoint_tensors().items()}
    applied = push(engine, trainer, a, version=5)
    assert applied.policy_version == 5 and greedy(engine) == greedy(reference_a)
    trainer.group.close()


def test_two_ranks_receive_every_bucket_and_serve_one_ranks_outputs(
    tiny_llama, checkpoint_b, weights_b, engines
) -> None:
    engines.append(two := make_engine(tiny_llama, ranks=2))
    trainer = Trainer(ranks=2)
    join(two, trainer)
    assert push(two, trainer, weights_b).phase is WeightsPhase.APPLIED
    assert greedy(two) == greedy(make_engine(checkpoint_b))
    trainer.group.close()


def test_a_trainer_gone_mid_broadcast_fails_aborted_and_leaves_weights_version_and_group(
    tiny_llama, weights_b, engines
) -> None:
    engines.append(engine := make_engine(tiny_llama))
    before = greedy(engine)
    trainer = Trainer(timeout=3.0)
    join(engine, trainer)
    first = dict(list(weights_b.items())[:1])  # the trainer sends one bucket, then leaves

    def send_one_and_leave() -> None:
        trainer.group.broadcast(list(first.values()), BUCKET)
        trainer.group.close()

    msg = update(weights_b)
    trainer.start(send_one_and_leave)
    engine.start_weight_update(msg)
    trainer.wait()
    with pytest.raises(WeightUpdateError, match="InitWeightTransfer again") as failed:
        engine.updater.outcome(msg)
    assert failed.value.code == "ABORTED"
    assert greedy(engine) == before and engine.policy_version == 0
    assert not engine.updater.transfer.joined
    again = update(weights_b)
    engine.start_weight_update(again)  # refused before anything pauses: no group
    assert events(engine, again) == [WeightsPhase.FAILED]
    assert engine.updater.last_final is not None
    assert engine.updater.last_final.error_code == "FAILED_PRECONDITION"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"shape": (3, 3)}, r"model.norm.weight: shape \(3, 3\)"),
        ({"dtype": "BF16"}, r"model.norm.weight: dtype BF16 != served dtype torch.float32"),
        ({"name": "model.nope"}, r"unknown tensor 'model.nope'"),
    ],
    ids=["shape", "dtype", "name"],
)
def test_a_bad_tensor_list_is_refused_naming_the_tensor_before_anything_pauses(
    tiny_llama, weights_b, engines, change, match
) -> None:
    engines.append(engine := make_engine(tiny_llama))
    trainer = Trainer()
    join(engine, trainer)
    specs = [TensorSpec(n, "F32", tuple(t.shape)) for n, t in weights_b.items()]
    index = next(i for i, s in enumerate(specs) if s.name == "model.norm.weight")
    fields = {"name": specs[index].name, "dtype": "F32", "shape": specs[index].shape} | change
    specs[index] = TensorSpec(**fields)
    msg = UpdateWeights("bad", 0, distributed=DistributedTensors(tuple(specs), BUCKET))
    engine.start_weight_update(msg)
    assert events(engine, msg) == [WeightsPhase.FAILED]
    with pytest.raises(WeightUpdateError, match=match) as refused:
        engine.updater.outcome(msg)
    assert refused.value.code == "INVALID_ARGUMENT"
    assert engine.updater.transfer.joined  # nothing moved: the group is still in step
    assert push(engine, trainer, weights_b).phase is WeightsPhase.APPLIED
    trainer.group.close()


def test_a_version_not_above_the_served_one_is_refused(tiny_llama, weights_b, engines) -> None:
    engines.append(engine := make_engine(tiny_llama))
    trainer = Trainer()
    join(engine, trainer)
    assert push(engine, trainer, weights_b, version=3).policy_version == 3
    msg = update(weights_b, version=3)
    engine.start_weight_update(msg)
    with pytest.raises(WeightUpdateError, match="must exceed the served 3") as refused:
        engine.updater.outcome(msg)
    assert refused.value.code == "FAILED_PRECONDITION"
    trainer.group.close()


def test_a_complete_update_must_replace_every_tensor(tiny_llama, weights_b, engines) -> None:
    engines.append(engine := make_engine(tiny_llama))
    trainer = Trainer()
    join(engine, trainer)
    some = dict(list(weights_b.items())[:2])
    msg = update(some, complete=True)
    engine.start_weight_update(msg)
    with pytest.raises(WeightUpdateError, match="must replace every tensor") as refused:
        engine.updater.outcome(msg)
    assert refused.value.code == "FAILED_PRECONDITION"
    trainer.group.close()


def test_a_join_nobody_answers_fails_unavailable_within_its_timeout(tiny_llama, engines) -> None:
    engines.append(engine := make_engine(tiny_llama))
    trainer = Trainer(timeout=1.0)  # hosts the store but never joins
    joined = engine.join_weight_transfer(InitWeightTransfer("lonely", trainer.spec))
    assert joined.error_code == "UNAVAILABLE" and "could not join" in joined.message
    assert not engine.updater.transfer.joined


def test_the_engine_and_the_trainer_lay_out_buckets_alike() -> None:
    shapes = [(7,), (300, 3), (5000,), (1,), (64, 64), (2, 2)]
    dtypes = ["F32", "BF16", "F32", "F16", "F32", "F16"]
    for bucket_bytes in (1, 100, 4096, 1 << 30):
        specs = [
            TensorSpec(f"t{i}", d, s) for i, (d, s) in enumerate(zip(dtypes, shapes, strict=True))
        ]
        engine = [
            (b.nbytes, [(int(p.spec.name[1:]), p.offset) for p in b.tensors])
            for b in engine_layout(specs, bucket_bytes)
        ]
        trainer = bucket_layout(list(zip(dtypes, shapes, strict=True)), bucket_bytes)
        assert engine == trainer
        for _, placed in trainer:
            assert all(offset % 64 == 0 for _, offset in placed)
    assert len(bucket_layout([("F32", (5000,))] * 2, 4096)) == 2  # too big: one bucket each


def test_a_push_may_set_a_draft_models_tensors(tiny_llama, checkpoint_b, engines) -> None:
    """With a speculative draft model (here another checkpoint's weights), tensors named
    `draft.` + its names set it: then it is the model, and every greedy proposal is kept."""
    config = EngineConfig(
        model=str(tiny_llama),
        device="cpu",
        dtype="float32",
        cpu_threads=1,
        speculative_method="draft",
        speculative_draft_model=str(checkpoint_b),
    )
    engines.append(engine := LLMEngine(config))
    trainer = Trainer()
    join(engine, trainer)
    draft = {f"draft.{n}": t.clone() for n, t in engine.model.checkpoint_tensors().items()}
    applied = push(engine, trainer, draft)
    assert applied.phase is WeightsPhase.APPLIED and not applied.replaced_all
    before = engine.stats()
    assert greedy(engine) == greedy(make_engine(tiny_llama))
    proposed = engine.stats().spec_proposed_tokens - before.spec_proposed_tokens
    accepted = engine.stats().spec_accepted_tokens - before.spec_accepted_tokens
    assert proposed > 0 and accepted == proposed
    trainer.group.close()
