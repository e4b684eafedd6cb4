"""The Llama family's own sliding windows, against transformers: Mistral with a window smaller
than the context (every layer slides) and Qwen2 with `use_sliding_window` (layers from
`max_window_layers` on slide, the others attend to everything: two KV groups). Prompts are
longer than the window, pages small, so the sliding groups give pages back while requests run:
greedy ids equal HF generate and logprobs agree within 1e-4 in float32, with chunked prefill,
preemption, prefix-cache hits, n > 1, prompt logprobs and the overlapped loop; and every page
is back when the requests end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.overlap_runs import assert_all_pages_returned
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

WINDOW = 12
NEW_TOKENS = 24
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "qwen2_mixed": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
SETUPS: dict[str, dict[str, Any]] = {
    "plain": {},
    "chunked_overlapped": {"max_num_batched_tokens": 16, "overlap_steps": True},
    # Few pages (just above what the longest request holds at most): requests preempt each
    # other and recompute.
    "preempting": {"max_num_batched_tokens": 16},
}
TIGHT_PAGES = {"mistral": 12, "qwen2": 30}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = CASES[request.param]
    return make_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)


@pytest.fixture(scope="module")
def hf(checkpoint: Path) -> Any:
    return load_hf_model(checkpoint)


def make_engine(checkpoint: Path, **overrides: Any) -> LLMEngine:
    config = EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", page_size=4)
    return LLMEngine(replace(config, **overrides))


def assert_equal_to_hf(hf: Any, prompt: list[int], token_ids: list[int], logprobs: Any) -> None:
    expected, hf_logprobs = hf_greedy(hf, prompt, len(token_ids))
    assert token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
    chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(logprobs), chosen, atol=1e-4, rtol=0)


def test_the_checkpoints_slide_as_intended(checkpoint: Path) -> None:
    raw = json.loads((checkpoint / "config.json").read_text())
    engine = make_engine(checkpoint)
    windows = engine.pool.groups.windows
    if raw["model_type"] == "qwen2":  # transformers' own mixed layer types: two groups
        assert raw["layer_types"] == ["full_attention", "sliding_attention"]
        assert windows == (None, WINDOW)
    else:
        assert windows == (WINDOW,)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_greedy_ids_and_logprobs_equal_hf(checkpoint: Path, hf: Any, setup: str) -> None:
    overrides = SETUPS[setup]
    if setup == "preempting":
        model_type = json.loads((checkpoint / "config.json").read_text())["model_type"]
        overrides = {**overrides, "num_kv_pages": TIGHT_PAGES[model_type]}
    engine = make_engine(checkpoint, **overrides)
    batch = [p for p in prompts(engine.info.vocab_size, 8) if len(p) > WINDOW][:5]
    results = engine.generate(batch, GREEDY)
    for prompt, result in zip(batch, results, strict=True):
        assert result.error is None
        assert_equal_to_hf(hf, prompt, result.token_ids, result.logprobs)
    if setup == "preempting":
        assert engine.scheduler.num_preemptions > 0
    assert_all_pages_returned(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_prefix_hit_gives_the_tokens_of_a_cold_run(
    checkpoint: Path, hf: Any, overlap: bool
) -> None:
    # Overlapped, with chunks longer than the window: pages are given back before the step
    # that computed them is published.
    engine = make_engine(checkpoint, overlap_steps=overlap, max_num_batched_tokens=32)
    prompt = prompts(engine.info.vocab_size, 8)[6]  # 52 tokens
    cold = engine.generate([prompt], GREEDY)[0]
    warm = engine.generate([prompt[:40] + prompt[:12]], GREEDY)[0]
    again = engine.generate([prompt], GREEDY)[0]
    # (Overlapped, the pages a chunk's successor gave back before they were published are
    # not cached: a shorter hit.)
    assert again.cached_tokens >= (32 if overlap else 40) and again.token_ids == cold.token_ids
    assert_equal_to_hf(hf, prompt, again.token_ids, again.logprobs)
    assert_equal_to_hf(hf, prompt[:40] + prompt[:12], warm.token_ids, warm.logprobs)
    assert_all_pages_returned(engine)


def test_n_samples_and_prompt_logprobs(checkpoint: Path, hf: Any) -> None:
    engine = make_engine(checkpoint, max_num_batched_tokens=16)
    prompt = prompts(engine.info.vocab_size, 8)[5]  # 44 tokens
    samples = engine.generate([prompt], replace(GREEDY, prompt_logprobs=True), n=3)
    result = samples[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(prompt[1:])[:, None])
    assert result.prompt_logprobs is not None
    torch.testing.assert_close(
        torch.tensor(result.prompt_logprobs.logprobs), expected[:, 0], atol=1e-4, rtol=0
    )
    assert len(samples) == 3
    for sample in samples:
        assert_equal_to_hf(hf, prompt, sample.token_ids, sample.logprobs)
    assert_all_pages_returned(engine)


def test_two_ranks_give_hf_greedy_ids(checkpoint: Path, hf: Any) -> None:
    """Tensor parallel (gloo): rank 0 sends every group's tables and slots to rank 1."""
    config = EngineConfig(
        model=str(checkpoint),
        device="cpu",
        dtype="float32",
        page_size=4,
        tensor_parallel_size=2,
        cpu_threads=1,
        max_num_batched_tokens=16,
    )
    engine = LLMEngine(config)
    try:
        batch = [p for p in prompts(engine.info.vocab_size, 8) if len(p) > WINDOW][:3]
        results = engine.generate(batch, GREEDY)
        for prompt, result in zip(batch, results, strict=True):
            assert_equal_to_hf(hf, prompt, result.token_ids, result.logprobs)
        assert_all_pages_returned(engine)
    finally:
        engine.close()


def test_padded_graph_steps_read_every_groups_table(checkpoint: Path, hf: Any) -> None:
    """Decode steps through the CUDA graph runner's padded, page-major buffers (run eagerly
    on the CPU: what a captured graph replays), each KV group's table and slots among them."""
    engine = make_engine(checkpoint)
    engine.runner.attach_graphs(capture=False)
    graphs = engine.runner.graphs
    assert (
        graphs is not None
        and graphs.inputs.group_slots.shape[0] == len(engine.pool.groups.windows) - 1
    )
    run, sizes = graphs.run, []

    def counted(host: Any, arrays: Any, num_seqs: int, width: int, patch: Any = None) -> Any:
        sizes.append(num_seqs)
        return run(host, arrays, num_seqs, width, patch)

    graphs.run = counted  # type: ignore[method-assign]
    batch = [p for p in prompts(engine.info.vocab_size, 8) if len(p) > WINDOW][:3]
    results = engine.generate(batch, GREEDY)
    assert sizes, "no decode step went through the graph runner"
    for prompt, result in zip(batch, results, strict=True):
        assert_equal_to_hf(hf, prompt, result.token_ids, result.logprobs)
    assert_all_pages_returned(engine)


def test_sleep_frees_every_groups_storage_and_wake_serves_again(checkpoint: Path, hf: Any) -> None:
    engine = make_engine(checkpoint)
    storage = engine.pool.storage
    full = sum(t.untyped_storage().nbytes() for t in storage)
    prompt = prompts(engine.info.vocab_size, 8)[4]
    engine.generate([prompt], GREEDY)
    outcome = engine.sleep(level=1)
    assert outcome.released_bytes == full
    assert sum(t.untyped_storage().nbytes() for t in storage) == 0
    engine.wake_up()
    assert all(not t.any() for t in storage)  # reallocated zeroed
    result = engine.generate([prompt], GREEDY)[0]
    assert_equal_to_hf(hf, prompt, result.token_ids, result.logprobs)
