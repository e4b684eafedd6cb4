"""Sleep and wake in the engine (LLMEngine.sleep / wake_up): memory really freed and given
back, the same greedy ids after waking, in-flight policies, refusals, and the weights' origin."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.protocol.messages import InflightPolicy, RequestOutput
from engine.sleep.sleeper import SleepError
from engine.weights.staging import WeightUpdateError
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

PROMPT = [0, 17, 42, 99, 123, 7, 88, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # > one page of 16
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes as tiny_llama, other weights."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama_b"), "llama", seed=1)


def make_engine(checkpoint: Path, **overrides: object) -> LLMEngine:
    config = {"model": str(checkpoint), "device": "cpu", "dtype": "float32", "num_kv_pages": 64}
    return LLMEngine(EngineConfig(**{**config, **overrides}))  # type: ignore[arg-type]


def greedy(engine: LLMEngine, batch: list[list[int]], max_tokens: int = 10) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.token_ids for r in engine.generate(batch, params)]


def steps(engine: LLMEngine, count: int) -> list[RequestOutput]:
    return [out for _ in range(count) for out in engine.step()]


def finals(outputs: list[RequestOutput]) -> dict[str, RequestOutput]:
    return {o.request_id: o for o in outputs if o.finished}


def kv_bytes(engine: LLMEngine) -> int:
    return engine.pool.k.untyped_storage().nbytes() + engine.pool.v.untyped_storage().nbytes()


def weight_bytes(engine: LLMEngine) -> int:
    return sum(p.untyped_storage().nbytes() for p in engine.model.parameters())


def test_level_1_then_wake_gives_hf_greedy_ids_before_and_after(tiny_llama: Path) -> None:
    engine, hf = make_engine(tiny_llama), load_hf_model(tiny_llama)
    batch = prompts(engine.model_config.vocab_size, count=4)
    expected = [hf_greedy(hf, p, 10)[0] for p in batch]
    assert greedy(engine, batch) == expected
    outcome = engine.sleep(level=1)
    assert (outcome.level, engine.sleeper.level) == (1, 1)
    woke = engine.wake_up()
    assert (woke.level, woke.reloaded) == (0, False)
    assert greedy(engine, batch) == expected


def test_sleep_frees_the_page_pool_and_empties_the_prefix_cache(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    full = kv_bytes(engine)
    greedy(engine, [PROMPT * 3])
    assert engine.stats().cached_pages > 0
    outcome = engine.sleep(level=1)
    assert outcome.released_bytes == full and kv_bytes(engine) == 0
    stats = engine.stats()
    assert (stats.cached_pages, stats.free_pages, stats.sleep_level) == (0, 64, 1)
    assert not engine.cache.page_of_hash
    assert weight_bytes(engine) > 0  # level 1 keeps the weights
    engine.wake_up()
    assert kv_bytes(engine) == full and engine.stats().total_pages == 64
    assert not engine.pool.k.any() and not engine.pool.v.any()  # reallocated zeroed


def test_level_2_frees_the_weights_and_wake_reloads_them(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    batch = prompts(engine.model_config.vocab_size, count=3)
    before, weights, kv = greedy(engine, batch), weight_bytes(engine), kv_bytes(engine)
    outcome = engine.sleep(level=2)
    assert outcome.released_bytes == weights + kv
    assert weight_bytes(engine) == 0
    woke = engine.wake_up()
    assert woke.reloaded and woke.policy_version == 0
    assert weight_bytes(engine) == weights
    assert greedy(engine, batch) == before


def test_level_2_wake_reloads_the_last_checkpoint_update_at_its_version(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    engine = make_engine(tiny_llama)
    engine.update_weights(checkpoint_b)
    served_b = greedy(engine, [PROMPT])
    engine.sleep(level=2)
    woke = engine.wake_up()
    assert woke.policy_version == 1 and engine.policy_version == 1
    assert greedy(engine, [PROMPT]) == served_b == greedy(make_engine(checkpoint_b), [PROMPT])


def test_level_2_after_in_process_tensors_stays_asleep_until_every_tensor_is_sent(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    engine = make_engine(tiny_llama)
    name = "model.norm.weight"
    tensor = engine.model.checkpoint_tensors()[name].clone() * 2
    engine.update_weights({name: tensor})  # the origin is now unknown: nothing to read again
    engine.sleep(level=2)
    with pytest.raises(SleepError) as refused:
        engine.wake_up()
    assert refused.value.code == "FAILED_PRECONDITION" and engine.sleeper.level == 2
    with pytest.raises(WeightUpdateError) as partial:
        engine.update_weights({name: tensor})
    assert partial.value.code == "FAILED_PRECONDITION" and engine.policy_version == 1
    applied = engine.update_weights(checkpoint_b)  # every tensor: restores the weights
    assert applied.policy_version == 2 and engine.sleeper.level == 2
    woke = engine.wake_up()
    assert not woke.reloaded and woke.policy_version == 2
    assert greedy(engine, [PROMPT]) == greedy(make_engine(checkpoint_b), [PROMPT])


def test_abort_ends_running_and_waiting_requests_aborted(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=1)
    engine.add_request("running", PROMPT, LONG)
    engine.add_request("waiting", PROMPT[:5], LONG)
    steps(engine, 3)
    outcome = engine.sleep(level=1, inflight=InflightPolicy.ABORT)
    assert outcome.aborted == 2
    ended = finals(engine.step())
    assert {rid: o.finish_reason for rid, o in ended.items()} == {
        "running": FinishReason.ABORTED,
        "waiting": FinishReason.ABORTED,
    }
    assert "sleep" in (ended["running"].error or "")
    assert engine.pool.num_free == engine.pool.num_pages and not engine.has_work()


def test_drain_lets_admitted_requests_finish_then_sleeps(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    expected = greedy(make_engine(tiny_llama), [PROMPT], max_tokens=40)[0]
    engine.add_request("r", PROMPT, LONG)
    outputs = steps(engine, 3)
    outcome = engine.sleep(level=1)  # DRAIN, the default
    assert (outcome.level, outcome.aborted) == (1, 0)
    outputs += engine.step()  # what the drain produced
    tokens = [t for o in outputs if o.request_id == "r" for t in o.new_token_ids]
    assert finals(outputs)["r"].finish_reason is FinishReason.LENGTH
    assert tokens == expected and kv_bytes(engine) == 0


def test_drain_timeout_fails_the_sleep_and_serving_goes_on(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    engine.add_request(
        "r", PROMPT, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    )
    steps(engine, 2)
    with pytest.raises(SleepError) as failed:
        engine.sleep(level=1, drain_timeout=0.0)
    assert failed.value.code == "ABORTED"
    assert engine.sleeper.level == 0 and kv_bytes(engine) > 0
    engine.abort(["r"])
    steps(engine, 1)
    assert greedy(engine, [PROMPT]) == greedy(make_engine(tiny_llama), [PROMPT])


def test_a_request_while_asleep_ends_aborted_at_once(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    engine.sleep(level=1)
    engine.add_request("late", PROMPT, LONG, n=2)
    outputs = engine.step()
    assert [(o.index, o.finish_reason) for o in outputs] == [
        (0, FinishReason.ABORTED),
        (1, FinishReason.ABORTED),
    ]
    assert "asleep" in (outputs[0].error or "") and not outputs[0].new_token_ids
    assert not engine.has_work()
    result = engine.generate([PROMPT], LONG)[0]
    assert result.finish_reason is FinishReason.ABORTED and not result.token_ids


@pytest.mark.parametrize(
    ("level", "policy"),
    [
        (0, InflightPolicy.DRAIN),
        (3, InflightPolicy.ABORT),
        (1, InflightPolicy.CONTINUE),
        (1, InflightPolicy.RECOMPUTE),
    ],
)
def test_a_bad_level_or_policy_is_invalid_argument(
    tiny_llama: Path, level: int, policy: InflightPolicy
) -> None:
    engine = make_engine(tiny_llama)
    with pytest.raises(SleepError) as refused:
        engine.sleep(level=level, inflight=policy)
    assert refused.value.code == "INVALID_ARGUMENT" and engine.sleeper.level == 0


def test_sleep_while_asleep_only_deepens_and_wake_while_awake_does_nothing(
    tiny_llama: Path,
) -> None:
    engine = make_engine(tiny_llama)
    assert engine.wake_up().seconds >= 0 and engine.sleeper.level == 0
    engine.sleep(level=1)
    again = engine.sleep(level=1)
    assert (again.level, again.released_bytes) == (1, 0)
    deeper = engine.sleep(level=2)
    assert deeper.level == 2 and deeper.released_bytes == weight_bytes(make_engine(tiny_llama))
    assert engine.sleep(level=1).level == 2
    assert engine.wake_up().reloaded


@pytest.mark.parametrize("policy", [InflightPolicy.DRAIN, InflightPolicy.ABORT])
def test_overlapped_steps_sleep_with_nothing_in_flight(
    tiny_llama: Path, policy: InflightPolicy
) -> None:
    engine = make_engine(tiny_llama, overlap_steps=True)
    expected = greedy(make_engine(tiny_llama), [PROMPT])
    engine.add_request("r", PROMPT, LONG)
    steps(engine, 4)
    engine.sleep(level=1, inflight=policy)
    assert engine.overlap is not None and not engine.overlap.busy
    steps(engine, 1)
    engine.wake_up()
    assert greedy(engine, [PROMPT]) == expected


def test_live_weights_while_asleep_at_level_2_is_refused(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    engine.sleep(level=2)
    with pytest.raises(WeightUpdateError) as refused, engine.live_weights():
        pass
    assert refused.value.code == "FAILED_PRECONDITION" and engine.policy_version == 0


def test_a_draft_model_sleeps_and_wakes_with_the_model(
    tiny_llama: Path, checkpoint_b: Path
) -> None:
    """Its pool at level 1, its weights at level 2 (each in the bytes released), read again
    from its checkpoint on a Wake: the same weights, proposing again."""
    spec = {"speculative_method": "draft", "speculative_draft_model": str(checkpoint_b)}
    engine = make_engine(tiny_llama, **spec)
    draft = engine.loop.spec.proposer.draft  # type: ignore[union-attr, attr-defined]
    params = list(draft.model.parameters())
    loaded = [p.clone() for p in params]
    draft_weights = sum(p.untyped_storage().nbytes() for p in params)
    batch = prompts(engine.model_config.vocab_size, count=3)
    before = greedy(engine, batch)
    weights, kv, draft_kv = weight_bytes(engine), kv_bytes(engine), draft.pool.num_bytes
    assert engine.sleep(level=1).released_bytes == kv + draft_kv
    assert draft.pool.k.untyped_storage().nbytes() == 0
    assert engine.sleep(level=2).released_bytes == weights + draft_weights
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    engine.wake_up()
    assert draft.pool.num_bytes == draft_kv and not draft.pool.k.any()
    assert all(p.equal(q) for p, q in zip(params, loaded, strict=True))
    proposed = engine.stats().spec_proposed_tokens
    assert greedy(engine, batch) == before
    assert engine.stats().spec_proposed_tokens > proposed


def test_a_draft_checkpoint_gone_by_the_wake_keeps_the_engine_asleep(
    tiny_llama: Path, checkpoint_b: Path, tmp_path: Path
) -> None:
    import shutil

    draft_dir = Path(shutil.copytree(checkpoint_b, tmp_path / "draft"))
    engine = make_engine(
        tiny_llama, speculative_method="draft", speculative_draft_model=str(draft_dir)
    )
    engine.sleep(level=2)
    shutil.move(draft_dir, tmp_path / "moved")
    with pytest.raises(SleepError, match="speculative draft model") as refused:
        engine.wake_up()
    assert refused.value.code.name == "FAILED_PRECONDITION" and engine.sleeper.level == 2
    shutil.move(tmp_path / "moved", draft_dir)
    engine.wake_up()
    assert engine.sleeper.level == 0 and greedy(engine, [PROMPT])
