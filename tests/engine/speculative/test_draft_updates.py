"""A weight update sets a speculative draft model's tensors named `draft.` + the draft's own
names, beside (or instead of) the model's, under one version: the draft then proposes with its
new weights (its old KV dropped), on one rank or split over two; names it lacks are refused;
"every tensor" stays the model's; a Wake from level 2 reads the draft again, then the draft
tensors of the update files it replays."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.protocol.messages import InflightPolicy, TensorRef, UpdateWeights, WeightsPhase
from engine.speculative.draft import DraftProposer
from engine.weights.staging import WeightUpdateError
from tests.support.tiny_models import make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[0, 17, 42, 99, 123, 7], [0, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The draft: tiny_llama's shapes, other weights, so it proposes worse than the model."""
    return make_checkpoint(tmp_path_factory.mktemp("draft"), "llama", seed=1)


def make_engine(model: Path, draft: Path, **overrides: object) -> LLMEngine:
    config = EngineConfig(
        model=str(model),
        device="cpu",
        dtype="float32",
        speculative_method="draft",
        speculative_draft_model=str(draft),
        **overrides,  # type: ignore[arg-type]
    )
    return LLMEngine(config)


def draft_of(engine: LLMEngine) -> DraftProposer:
    proposer = engine.loop.spec.proposer  # type: ignore[union-attr]
    assert isinstance(proposer, DraftProposer)
    return proposer


def as_draft(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"draft.{name}": t.clone() for name, t in tensors.items()}


def acceptance(engine: LLMEngine) -> tuple[int, int, list[list[int]]]:
    """(proposed, accepted) over a greedy run of PROMPTS, and its ids."""
    before = engine.stats()
    ids = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    after = engine.stats()
    proposed = after.spec_proposed_tokens - before.spec_proposed_tokens
    return proposed, after.spec_accepted_tokens - before.spec_accepted_tokens, ids


def test_an_update_of_the_draft_alone_makes_it_propose_with_its_new_weights(
    tiny_llama: Path, other: Path
) -> None:
    engine = make_engine(tiny_llama, other)
    proposed, accepted, ids = acceptance(engine)
    assert accepted < proposed  # another model's weights: some proposals rejected
    # The draft becomes the model itself: every greedy proposal is the model's own token.
    applied = engine.update_weights(as_draft(engine.model.checkpoint_tensors()))
    assert applied.phase is WeightsPhase.APPLIED and not applied.replaced_all
    assert engine.stats().policy_version == 1
    proposed, accepted, after = acceptance(engine)
    assert after == ids  # proposals never change the tokens
    assert proposed > 0 and accepted == proposed


def test_the_draft_keeps_no_kv_computed_under_its_old_weights(
    tiny_llama: Path, other: Path
) -> None:
    engine = make_engine(tiny_llama, other)
    for prompt in PROMPTS:
        engine.add_request(f"r{len(prompt)}", prompt, GREEDY)
    for _ in range(4):  # the draft holds KV of both requests, under its old weights
        engine.step()
    assert draft_of(engine).seqs
    engine.update_weights(
        as_draft(engine.model.checkpoint_tensors()), inflight=InflightPolicy.CONTINUE
    )
    before = engine.stats()
    while engine.has_work():
        engine.step()
    after = engine.stats()
    proposed = after.spec_proposed_tokens - before.spec_proposed_tokens
    assert proposed > 0 and after.spec_accepted_tokens - before.spec_accepted_tokens == proposed


def test_one_update_sets_the_model_and_the_draft_and_every_tensor_means_the_models(
    tiny_llama: Path, other: Path
) -> None:
    engine = make_engine(tiny_llama, other)
    model_b = make_engine(other, other).model.checkpoint_tensors()
    both = {**{n: t.clone() for n, t in model_b.items()}, **as_draft(model_b)}
    applied = engine.update_weights(both)
    assert applied.replaced_all  # every tensor of the model, with the draft's beside them
    for name, tensor in engine.model.checkpoint_tensors().items():
        assert torch.equal(tensor, model_b[name]), name
    for name, tensor in draft_of(engine).draft.model.checkpoint_tensors().items():
        assert torch.equal(tensor, model_b[name]), name
    # A checkpoint directory holds the model alone, as without a draft.
    assert engine.update_weights(tiny_llama).replaced_all


def test_a_name_the_draft_lacks_is_refused_by_name(tiny_llama: Path, other: Path) -> None:
    engine = make_engine(tiny_llama, other)
    with pytest.raises(WeightUpdateError, match=r"'draft\.model\.nothing\.weight'") as refused:
        engine.update_weights({"draft.model.nothing.weight": torch.zeros(2)})
    assert refused.value.code.name == "INVALID_ARGUMENT"
    plain = LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32"))
    norm = "draft.model.norm.weight"
    with pytest.raises(WeightUpdateError, match=re.escape(f"'{norm}'")):
        plain.update_weights({norm: torch.ones_like(plain.model.checkpoint_tensors()[norm[6:]])})


def test_an_update_of_the_draft_reaches_every_tensor_parallel_rank(
    tiny_llama: Path, other: Path
) -> None:
    engine = make_engine(tiny_llama, other, tensor_parallel_size=2)
    try:
        whole = LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32"))
        engine.update_weights(as_draft(whole.model.checkpoint_tensors()))
        proposed, accepted, _ = acceptance(engine)
        # Both ranks' shards of the draft are the model's now: every proposal is kept.
        assert proposed > 0 and accepted == proposed
    finally:
        engine.close()


def test_a_wake_reads_the_draft_again_then_the_draft_tensors_of_update_files(
    tiny_llama: Path, other: Path, tmp_path: Path
) -> None:
    engine = make_engine(tiny_llama, other)
    path, refs, offset = tmp_path / "tensors.bin", [], 0
    with open(path, "wb") as f:
        for name, tensor in as_draft(engine.model.checkpoint_tensors()).items():
            data = tensor.numpy().tobytes()
            f.write(data)
            refs.append(TensorRef(name, "F32", tuple(tensor.shape), offset, len(data)))
            offset += len(data)
    msg = UpdateWeights("file", 2, InflightPolicy.ABORT, tensor_file=str(path), tensors=tuple(refs))
    engine.start_weight_update(msg)
    assert engine.updater.events[-1].phase == WeightsPhase.APPLIED
    engine.sleep(level=2)
    assert engine.wake_up().reloaded
    proposed, accepted, _ = acceptance(engine)
    assert proposed > 0 and accepted == proposed  # the file's draft tensors, read again
