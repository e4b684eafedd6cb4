"""Routed experts (SamplingParams.routed_experts) through the engine: for every generated token,
each MoE layer's top-k expert ids equal those HF's routers choose at the position whose logits
produced it (the position before the token), highest weight first; with n > 1, preemption,
chunked prefill and the overlapped loop too; only the rows that ask get them; a dense model
refuses them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.protocol.generation_result import GenerationResult
from tests.support.tiny_models import load_hf_model, make_checkpoint, prompts

NEW_TOKENS = 16
CASES = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe_shared_expert": ("qwen2_moe", {}),
    "qwen3_moe_dense_layer": ("qwen3_moe", {"mlp_only_layers": [1], "norm_topk_prob": True}),
}


def make_engine(checkpoint: Path, **overrides: object) -> LLMEngine:
    config = {"device": "cpu", "dtype": "float32", **overrides}
    return LLMEngine(EngineConfig(model=str(checkpoint), **config))  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = CASES[request.param]
    return make_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


def hf_routing(model: Any, ids: list[int]) -> torch.Tensor:
    """[positions, MoE layers, top_k]: the expert ids HF's routers choose for each position of
    `ids` (one forward over the whole sequence; each router returns (logits, scores, ids))."""
    chosen: list[torch.Tensor] = []
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    assert routers, "transformers' MoE blocks route in a TopKRouter module"
    hooks = [r.register_forward_hook(lambda m, i, out: chosen.append(out[2])) for r in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(chosen, dim=1)


def assert_routing_equals_hf(model: Any, result: GenerationResult) -> None:
    """Token i of the completion: the routing of sequence position prompt_len + i - 1."""
    assert result.routed_experts is not None
    assert len(result.routed_experts) == len(result.token_ids)
    sequence = result.prompt_token_ids + result.token_ids
    expected = hf_routing(model, sequence[:-1])[len(result.prompt_token_ids) - 1 :]
    got = torch.tensor(result.routed_experts).view(expected.shape)
    assert torch.equal(got, expected)


def test_routed_experts_of_greedy_tokens_equal_hf_routers(checkpoint: Path) -> None:
    engine = make_engine(checkpoint)
    batch = prompts(engine.info.vocab_size, count=4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, routed_experts=True)
    results = engine.generate(batch, params)
    info = engine.info
    hf = load_hf_model(checkpoint)
    for result in results:
        assert result.error is None
        assert len(result.routed_experts or [[]]) == len(result.token_ids)
        assert all(len(r) == info.moe_layers * info.moe_top_k for r in result.routed_experts or [])
        assert_routing_equals_hf(hf, result)


def test_sampled_tokens_with_n_preemption_and_chunked_prefill_route_as_hf(qwen3_moe: Path) -> None:
    shared = [0, 11, 12, 13, 14, 15, 16, 17, 18]  # two full pages: a prefix-cache hit
    batch = [[*shared, 40 + k] for k in range(3)] + prompts(300, count=4)[1:]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, routed_experts=True)
    # 16 pages of 4 tokens for up to 6 sequences: requests are preempted and recomputed;
    # 16 tokens a step: the longer prompts are prefilled in chunks.
    tight = make_engine(
        qwen3_moe, num_kv_pages=16, page_size=4, max_num_seqs=6, max_num_batched_tokens=16
    )
    results = tight.generate(batch, params, n=2)
    assert tight.stats().preemptions > 0
    assert results[0].token_ids != results[1].token_ids  # n = 2 sampled two sequences
    hf = load_hf_model(qwen3_moe)
    for result in results:
        assert_routing_equals_hf(hf, result)


def test_the_overlapped_loop_returns_the_plain_loops_routed_experts(qwen3_moe: Path) -> None:
    batch = prompts(300, count=5)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10, routed_experts=True)
    plain = make_engine(qwen3_moe).generate(batch, params, n=2)
    overlapped = make_engine(qwen3_moe, overlap_steps=True).generate(batch, params, n=2)
    assert [r.token_ids for r in overlapped] == [r.token_ids for r in plain]
    assert [r.routed_experts for r in overlapped] == [r.routed_experts for r in plain]
    hf = load_hf_model(qwen3_moe)
    for result in overlapped[:4]:
        assert_routing_equals_hf(hf, result)


def test_only_the_requests_that_ask_get_routed_experts(qwen3_moe: Path) -> None:
    engine = make_engine(qwen3_moe)
    batch = prompts(300, count=2)
    asks = SamplingParams(temperature=0.0, max_tokens=6, routed_experts=True)
    plain = SamplingParams(temperature=0.0, max_tokens=6)
    with_routing, without = engine.generate(batch, [asks, plain])
    assert with_routing.routed_experts is not None and len(with_routing.routed_experts) == 6
    assert without.routed_experts is None
    assert without.token_ids == engine.generate(batch[1:], plain)[0].token_ids


def test_a_dense_model_refuses_routed_experts(tmp_path: Path) -> None:
    engine = make_engine(make_checkpoint(tmp_path / "llama", "llama"))
    [result] = engine.generate([[0, 5, 6]], SamplingParams(max_tokens=4, routed_experts=True))
    assert result.finish_reason is FinishReason.ERROR
    assert result.error is not None and result.error.startswith("routed_experts:")


def test_scored_prompt_positions_carry_the_routing_of_the_row_that_scores_them(
    qwen3_moe: Path,
) -> None:
    """Position p's score comes from the logits of position p - 1: so do its routed experts;
    chunked prefill (8 tokens a step) splits the scored rows over several steps."""
    engine = make_engine(qwen3_moe, max_num_batched_tokens=8, max_num_seqs=4)
    batch = prompts(300, count=4)[1:]  # 12, 20 and 28 tokens
    score_only = SamplingParams(
        max_tokens=0, prompt_logprobs=True, prompt_logprobs_start=3, routed_experts=True
    )
    generating = SamplingParams(
        temperature=0.0, max_tokens=4, prompt_logprobs=True, routed_experts=True
    )
    results = engine.generate(batch, [score_only, generating, score_only])
    hf = load_hf_model(qwen3_moe)
    for prompt, result in zip(batch, results, strict=True):
        scores = result.prompt_logprobs
        assert scores is not None and scores.routed_experts is not None
        expected = hf_routing(hf, prompt)[scores.start - 1 : len(prompt) - 1]
        assert len(scores.routed_experts) == len(scores.logprobs) == len(prompt) - scores.start
        assert torch.equal(torch.tensor(scores.routed_experts).view(expected.shape), expected)
    assert_routing_equals_hf(hf, results[1])
    plain = engine.generate(batch[:1], SamplingParams(max_tokens=0, prompt_logprobs=True))
    assert plain[0].prompt_logprobs is not None
    assert plain[0].prompt_logprobs.routed_experts is None
