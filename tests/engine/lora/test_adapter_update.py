"""An adapter updated in place under a new version (engine/lora/adapter_update.py): what its
running requests do under each policy, the version each token reports, and peft's tokens for
the new adapter afterwards. Two peft adapters of the same shape stand for versions 1 and 2."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.lora.adapter_update import AdapterUpdateError
from engine.protocol.messages import InflightPolicy, RequestOutput
from tests.support.lora_adapters import make_adapter, peft_greedy, peft_model
from tests.support.tiny_models import prompts

NEW_TOKENS = 12
BEFORE_SWAP = 4  # steps the running request takes on version 1


@pytest.fixture(scope="module")
def versions(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("versions")
    return {v: make_adapter(tiny_llama, root / f"v{v}", r=8, seed=10 + v) for v in (1, 2)}


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, versions: dict[int, Path]) -> Any:
    """(version, prompt, tokens) -> peft's greedy ids under that adapter version."""
    models = {v: peft_model(tiny_llama, path) for v, path in versions.items()}

    @functools.cache
    def greedy(version: int, prompt: tuple[int, ...], tokens: int = NEW_TOKENS) -> list[int]:
        return peft_greedy(models[version], list(prompt), tokens)[0]

    return greedy


def make_engine(checkpoint: Path, first: Path, max_loras: int = 2, **config: Any) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(checkpoint),
            device="cpu",
            dtype="float32",
            max_loras=max_loras,
            max_lora_rank=8,
            **config,
        )
    )
    engine.load_adapter("x", first)
    return engine


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, adapter="x")


def run(engine: LLMEngine, steps: int | None = None) -> dict[str, list[RequestOutput]]:
    """Step `steps` times (None: until idle); each request's outputs."""
    seen: dict[str, list[RequestOutput]] = {}
    count = 0
    while engine.has_work() and (steps is None or count < steps):
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
        count += 1
    return seen


def tokens(outs: list[RequestOutput]) -> list[tuple[int, int]]:
    """(token, its policy version) of each token produced."""
    return [(t, o.policy_version) for o in outs for t in o.new_token_ids]


def started(engine: LLMEngine, prompt: list[int]) -> list[RequestOutput]:
    """Request "r"'s outputs once it has BEFORE_SWAP tokens (with overlapped steps, the next
    step is launched by then: the replace must undo it)."""
    engine.add_request("r", prompt, greedy())
    outs: list[RequestOutput] = []
    while len(tokens(outs)) < BEFORE_SWAP:
        outs += [out for out in engine.step() if out.request_id == "r"]
    assert len(tokens(outs)) == BEFORE_SWAP
    return outs


def test_drain_lets_running_requests_finish_on_the_old_version(
    tiny_llama: Path, versions: dict[int, Path], reference: Any
) -> None:
    engine = make_engine(tiny_llama, versions[1])
    prompt = prompts(engine.info.vocab_size, 2)[1]
    before = started(engine, prompt)
    first = engine.lora.key_of("x")
    new = engine.replace_adapter("x", versions[2], 0, InflightPolicy.DRAIN)
    assert new.version == 2 and engine.lora.version_of("x") == 2
    engine.add_request("after", prompt, greedy())
    seen = run(engine)
    old = tokens(before + seen["r"])
    assert [t for t, _ in old] == reference(1, tuple(prompt))
    assert {v for _, v in old} == {1}
    after = tokens(seen["after"])
    assert [t for t, _ in after] == reference(2, tuple(prompt))
    assert {v for _, v in after} == {2}
    assert seen["after"][0].cached_tokens == 0  # version 1's prompt KV is not reused
    engine.replace_adapter("x", versions[1])  # sweeps version 1: no request holds it now
    assert first not in engine.lora.files and first not in engine.lora.slot_of_key


def test_abort_ends_running_requests_and_the_new_version_equals_peft(
    tiny_llama: Path, versions: dict[int, Path], reference: Any
) -> None:
    engine = make_engine(tiny_llama, versions[1])
    prompt = prompts(engine.info.vocab_size, 2)[1]
    started(engine, prompt)
    engine.replace_adapter("x", versions[2], 7, InflightPolicy.ABORT)
    [ended] = engine.step()
    assert ended.request_id == "r" and ended.finish_reason is FinishReason.ABORTED
    [result] = engine.generate([prompt], greedy())
    assert result.token_ids == reference(2, tuple(prompt))
    assert engine.lora.slot_of_key.keys() == {engine.lora.key_of("x")}  # the old one's freed


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_continue_keeps_the_kv_and_the_versions_switch_at_the_swap(
    tiny_llama: Path, versions: dict[int, Path], reference: Any, overlap: bool
) -> None:
    engine = make_engine(tiny_llama, versions[1], max_loras=1, overlap_steps=overlap)
    prompt = prompts(engine.info.vocab_size, 2)[1]
    before = started(engine, prompt)
    engine.replace_adapter("x", versions[2], 0, InflightPolicy.CONTINUE)
    produced = tokens(before + run(engine)["r"])
    assert [v for _, v in produced] == [1] * BEFORE_SWAP + [2] * (NEW_TOKENS - BEFORE_SWAP)
    assert [t for t, _ in produced[:BEFORE_SWAP]] == reference(1, tuple(prompt))[:BEFORE_SWAP]
    [fresh] = engine.generate([prompt], greedy())
    assert fresh.token_ids == reference(2, tuple(prompt))
    assert fresh.cached_tokens == 0  # the continued request's mixed KV was never published


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_recompute_continues_as_the_new_version_would_from_the_same_tokens(
    tiny_llama: Path, versions: dict[int, Path], reference: Any, overlap: bool
) -> None:
    engine = make_engine(tiny_llama, versions[1], overlap_steps=overlap)
    prompt = prompts(engine.info.vocab_size, 2)[1]
    before = tokens(started(engine, prompt))
    engine.replace_adapter("x", versions[2], 0, InflightPolicy.RECOMPUTE)
    rest = tokens(run(engine)["r"])
    assert {v for _, v in rest} == {2}
    prefix = tuple(prompt + [t for t, _ in before])
    assert [t for t, _ in rest] == reference(2, prefix, NEW_TOKENS - BEFORE_SWAP)


def test_a_failed_replace_changes_nothing(
    tiny_llama: Path, versions: dict[int, Path], reference: Any, tmp_path: Path
) -> None:
    engine = make_engine(tiny_llama, versions[1])
    before = engine.adapters()
    fits = make_adapter(tiny_llama, tmp_path / "r4", r=4)
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        engine.replace_adapter("x", tmp_path / "missing", 0, InflightPolicy.ABORT)
    with pytest.raises(
        AdapterUpdateError, match="must exceed the version of adapter 'x', 1"
    ) as exc:
        engine.replace_adapter("x", fits, 1, InflightPolicy.ABORT)
    assert exc.value.code == "FAILED_PRECONDITION"
    with pytest.raises(AdapterUpdateError) as missing:
        engine.replace_adapter("nobody", fits)
    assert missing.value.code == "NOT_FOUND"
    assert engine.adapters() == before and not engine.lora.retired
    prompt = prompts(engine.info.vocab_size, 1)[0]
    [result] = engine.generate([prompt], greedy())
    assert result.token_ids == reference(1, tuple(prompt))


def test_min_policy_version_compares_with_the_adapters_version(
    tiny_llama: Path, versions: dict[int, Path]
) -> None:
    engine = make_engine(tiny_llama, versions[1], page_size=4)
    prompt = prompts(engine.info.vocab_size, 1)[0]
    engine.add_request("early", prompt, greedy(), min_policy_version=2)
    [refused] = engine.step()
    assert refused.finish_reason is FinishReason.ERROR
    assert refused.error == "min_policy_version: 2 > version 1 of adapter 'x'"
    engine.replace_adapter("x", versions[2])
    engine.add_request("late", prompt, greedy(), min_policy_version=2)
    late = run(engine)["late"]
    assert late[-1].finish_reason is FinishReason.LENGTH
    assert {o.policy_version for o in late} == {2}
    base = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))
    assert base[0].error is None  # the base model's version (0) is its own
