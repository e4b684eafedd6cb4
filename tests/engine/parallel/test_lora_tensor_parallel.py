"""LoRA adapters at 2 tensor-parallel ranks (gloo, CPU) give one rank's and peft's tokens.

Each rank holds its slice of every adapter (B's rows of a column-parallel part, A's columns of
o_proj and down_proj); two adapters (one rsLoRA) and the base model mixed in the same steps
give greedy ids equal to one rank's and to peft's model on Hugging Face, logprobs within 1e-4
in float32; an unloaded adapter's slot is cleared and rewritten on both ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.lora_adapters import MLP, make_adapter, peft_greedy, peft_model
from tests.support.tiny_models import prompts

NEW_TOKENS = 8
SPECS: dict[str, dict[str, Any]] = {
    "a": {"r": 8, "alpha": 16},
    "b": {"r": 4, "alpha": 8, "use_rslora": True, "targets": ("q_proj", "v_proj", "down_proj")},
    "c": {"r": 16, "alpha": 32, "targets": (*MLP, "o_proj")},
}


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(tiny_llama, root / name, seed=i, **spec)
        for i, (name, spec) in enumerate(SPECS.items())
    }


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        engine.close()


def make_engine(checkpoint: Path, ranks: int) -> LLMEngine:
    # One torch thread per rank: CI's two cores.
    config = EngineConfig(
        model=str(checkpoint),
        device="cpu",
        dtype="float32",
        cpu_threads=1,
        tensor_parallel_size=ranks,
        max_loras=2,
        max_lora_rank=16,
    )
    return LLMEngine(config)


def greedy(adapter: str) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, adapter=adapter
    )


def generate(engine: LLMEngine, cases: list[tuple[str, list[int]]]) -> list[Any]:
    """Every case in one batch: the adapters and the base model in the same steps."""
    return engine.generate([p for _, p in cases], [greedy(a) for a, _ in cases])


def test_two_ranks_with_adapters_give_one_ranks_and_peft_greedy_ids(
    tiny_llama: Path, adapters: dict[str, Path], engines: list[LLMEngine]
) -> None:
    one = make_engine(tiny_llama, 1)
    engines.append(two := make_engine(tiny_llama, 2))
    batch = prompts(one.info.vocab_size, count=2)
    references = {name: peft_model(tiny_llama, adapters.get(name)) for name in ("", *SPECS)}

    def check(names: tuple[str, ...]) -> None:
        cases = [(name, p) for p in batch for name in names]
        for (name, prompt), a, b in zip(
            cases, generate(one, cases), generate(two, cases), strict=True
        ):
            expected, logprobs = peft_greedy(references[name], prompt, NEW_TOKENS)
            assert a.error is None and b.error is None
            assert b.token_ids == a.token_ids == expected, f"adapter {name!r}"
            for got in (a.logprobs, b.logprobs):
                torch.testing.assert_close(
                    torch.tensor(got), torch.tensor(logprobs), atol=1e-4, rtol=0
                )

    for engine in (one, two):
        engine.load_adapter("a", adapters["a"])
        engine.load_adapter("b", adapters["b"])
    check(("", "a", "b"))
    # "a"'s slot is cleared on both ranks, then "c" is written into it.
    for engine in (one, two):
        engine.unload_adapter("a")
        engine.load_adapter("c", adapters["c"])
    check(("c", "", "b"))
