"""Sampling semantics: seeds, truncation, penalties, logprobs and stop conditions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.sampling.sampler import Sampler, SamplingBatch
from tests.support.tiny_models import load_hf_model

PROMPT = [0, 17, 42, 99, 123, 7, 88]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def hf(tiny_llama: Path):  # type: ignore[no-untyped-def]
    return load_hf_model(tiny_llama)


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Logits [len(tokens), vocab] of the reference model for every position."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def others(count: int) -> list[list[int]]:
    return [[0, *range(10 + i, 20 + 2 * i)] for i in range(count)]


def test_seed_gives_the_same_tokens_alone_and_among_15_others(engine: LLMEngine) -> None:
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=32, ignore_eos=True)
    alone = engine.generate([PROMPT], seeded)[0].token_ids
    noisy = SamplingParams(temperature=1.2, max_tokens=40, ignore_eos=True)
    batch = engine.generate([*others(8), PROMPT, *others(7)], [noisy] * 8 + [seeded] + [noisy] * 7)
    assert batch[8].token_ids == alone
    other_seed = SamplingParams(
        temperature=1.0, top_k=50, seed=4321, max_tokens=32, ignore_eos=True
    )
    assert engine.generate([PROMPT], other_seed)[0].token_ids != alone


def test_unseeded_sampling_varies(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = {tuple(engine.generate([PROMPT], params)[0].token_ids) for _ in range(3)}
    assert len(runs) > 1


@pytest.mark.parametrize(
    "truncation", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=["top_k", "top_p", "min_p"]
)
def test_extreme_truncation_equals_greedy(engine: LLMEngine, truncation: dict) -> None:
    greedy = engine.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    )
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=16, ignore_eos=True, **truncation)
    assert engine.generate([PROMPT], params)[0].token_ids == greedy[0].token_ids


def test_sampled_tokens_stay_inside_top_k(engine: LLMEngine, hf) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=2.0, top_k=3, seed=11, max_tokens=24, ignore_eos=True)
    result = engine.generate([PROMPT], params)[0]
    logits = hf_logits(hf, PROMPT + result.token_ids)[len(PROMPT) - 1 : -1]
    top3 = logits.topk(3, dim=-1).indices
    assert all(tok in top3[i].tolist() for i, tok in enumerate(result.token_ids))


def test_penalised_greedy_matches_a_reference_loop(engine: LLMEngine, hf) -> None:  # type: ignore[no-untyped-def]
    rep, freq, pres = 1.3, 0.5, 0.4
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=rep,
        frequency_penalty=freq,
        presence_penalty=pres,
        max_tokens=24,
        ignore_eos=True,
        logprobs=True,
    )
    result = engine.generate([PROMPT], params)[0]
    tokens = list(PROMPT)
    for i in range(24):
        logits = hf_logits(hf, tokens)[-1]
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[tokens] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        counts = torch.bincount(
            torch.tensor(tokens[len(PROMPT) :], dtype=torch.long), minlength=logits.numel()
        )
        logits = logits - freq * counts - pres * (counts > 0)
        token = int(logits.argmax())
        assert result.token_ids[i] == token
        assert abs(result.logprobs[i] - float(logits.log_softmax(-1)[token])) < 1e-4
        tokens.append(token)
    plain = engine.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    )
    assert plain[0].token_ids != result.token_ids, "the penalties should change this output"


def test_logprobs_are_temperature_scaled_and_raw_logprobs_are_not(engine: LLMEngine, hf) -> None:  # type: ignore[no-untyped-def]
    common = {"temperature": 0.7, "seed": 5, "max_tokens": 12, "ignore_eos": True, "logprobs": True}
    scaled = engine.generate([PROMPT], SamplingParams(**common))[0]
    raw = engine.generate([PROMPT], SamplingParams(**common, raw_logprobs=True))[0]
    assert raw.token_ids == scaled.token_ids  # logprob mode never changes sampling
    logits = hf_logits(hf, PROMPT + scaled.token_ids)[len(PROMPT) - 1 : -1]
    ids = torch.tensor(scaled.token_ids)[:, None]
    expect_scaled = (logits / 0.7).log_softmax(-1).gather(-1, ids).squeeze(-1)
    expect_raw = logits.log_softmax(-1).gather(-1, ids).squeeze(-1)
    torch.testing.assert_close(torch.tensor(scaled.logprobs), expect_scaled, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(raw.logprobs), expect_raw, atol=1e-4, rtol=0)


def test_stop_token_id_stops_and_min_tokens_suppresses_it(engine: LLMEngine) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = engine.generate([PROMPT], greedy)[0].token_ids[0]
    stopped = engine.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(first,))
    )
    assert stopped[0].token_ids == [first] and stopped[0].finish_reason == FinishReason.STOP
    held = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(first,), min_tokens=5)
    result = engine.generate([PROMPT], held)[0]
    assert first not in result.token_ids[:5] and len(result.token_ids) >= 5


def test_max_tokens_and_context_limit_end_with_length(engine: LLMEngine) -> None:
    result = engine.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    )[0]
    assert len(result.token_ids) == 5 and result.finish_reason == FinishReason.LENGTH
    max_len = engine.info.max_model_len
    near_full = [0] + [5] * (max_len - 4)
    result = engine.generate(
        [near_full], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    )[0]
    assert result.finish_reason == FinishReason.LENGTH
    assert len(near_full) + len(result.token_ids) == max_len


def test_generation_stops_at_any_eos_id_of_generation_config(
    engine: LLMEngine, tiny_llama: Path, tmp_path: Path
) -> None:
    first = engine.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )[0].token_ids[0]
    checkpoint = tmp_path / "eos"
    shutil.copytree(tiny_llama, checkpoint)
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    generation["eos_token_id"] = [1, first]
    (checkpoint / "generation_config.json").write_text(json.dumps(generation))
    multi_eos = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32"))
    assert multi_eos.info.eos_token_ids == [1, first]
    result = multi_eos.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert result.token_ids == [first] and result.finish_reason == FinishReason.STOP
    ignored = multi_eos.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )[0]
    assert len(ignored.token_ids) == 8


def sample_counts(probs: torch.Tensor, draws: int, top_k: int = 0) -> torch.Tensor:
    """How often each token is drawn over `draws` rows sharing `probs`: one seed per row, at
    successive output indices, as a long generation's steps would draw them."""
    floats = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]).repeat(draws, 1)
    seeds = torch.stack([torch.arange(draws) * 7919 + 1, torch.arange(draws) % 3], dim=1)
    ints = torch.cat([seeds, (torch.arange(draws) % 97)[:, None], torch.zeros(draws, 2)], dim=1)
    ints[:, 3] = top_k
    batch = SamplingBatch(floats, ints.long(), use_top_k=top_k > 0)
    logits = probs.log().expand(draws, -1).contiguous()
    ids = Sampler()(logits, batch).values
    return torch.bincount(ids, minlength=probs.numel()).double()


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    draws = 40_000
    counts = sample_counts(probs, draws)
    # 7 degrees of freedom: chi-square above 24.3 has probability 0.001 for a fair sampler.
    assert chi_square(counts, probs.double() * draws) < 24.3
    # A sampler that ignored the rarest token or skewed the order would be far off.
    assert counts[-1] > 0.5 * 0.02 * draws


def test_top_k_then_renormalised_frequencies() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    draws = 20_000
    counts = sample_counts(probs, draws, top_k=2)
    assert counts[2:].sum() == 0
    kept = probs[:2].double() / probs[:2].sum()
    assert chi_square(counts[:2], kept * draws) < 10.8  # 1 degree of freedom, p = 0.001


def test_uniform_noise_is_flat_and_uncorrelated_across_tokens_and_steps() -> None:
    from engine.sampling.sampling_math import uniform

    rows, vocab = 512, 1024
    seeds = torch.stack([torch.full((rows,), 1234), torch.zeros(rows, dtype=torch.long)], dim=1)
    u = uniform(seeds, torch.arange(rows), vocab).double()  # one request, 512 steps
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    # Ten equal bins: chi-square with 9 degrees of freedom, p = 0.001 at 27.9.
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert chi_square(counts, torch.full((10,), u.numel() / 10.0)) < 27.9
    centred = u - 0.5
    neighbours = (centred[:, 1:] * centred[:, :-1]).mean() / centred.var()
    next_step = (centred[1:] * centred[:-1]).mean() / centred.var()
    # Correlation of independent samples: about 1/sqrt(n) ~ 0.002; 0.02 is ten sigma.
    assert abs(float(neighbours)) < 0.02 and abs(float(next_step)) < 0.02


# A (seed, output index, token) whose hash has its top 24 bits all ones: (2^24 - 1 + 0.5) * 2^-24
# rounds to 1 in float32 (found by a search over output indices; checked below).
TOP_OF_RANGE = {"seed": 1234, "step": 4891, "token": 222}


def top_of_range_batch(top_p: float = 1.0) -> SamplingBatch:
    floats = torch.tensor([[1.0, top_p, 0.0, 1.0, 0.0, 0.0]])
    ints = torch.tensor([[TOP_OF_RANGE["seed"], 0, TOP_OF_RANGE["step"], 0, 0]])
    return SamplingBatch(floats, ints, use_top_p=top_p < 1.0)


def test_noise_at_the_top_of_the_hash_range_stays_below_1() -> None:
    from engine.sampling.sampling_math import U_MAX, exponential_noise, uniform

    seeds, counters = top_of_range_batch().ints[:, :2], torch.tensor([TOP_OF_RANGE["step"]])
    u = uniform(seeds, counters, 1024)
    assert float(u[0, TOP_OF_RANGE["token"]]) == U_MAX  # the largest float32 below 1
    assert float(u.max()) < 1.0
    assert bool((exponential_noise(seeds, counters, 1024) > 0).all())


def test_a_draw_at_the_top_of_the_noise_range_wins_among_equal_weights() -> None:
    # The smallest Exp(1) draw wins the race. Noise of -0 (-log(1)) made its score -inf:
    # the token could not be drawn at this step.
    ids = Sampler()(torch.zeros(1, 1024), top_of_range_batch()).values
    assert ids.tolist() == [TOP_OF_RANGE["token"]]


def test_a_token_of_weight_0_is_never_drawn_whatever_its_noise() -> None:
    # exp(-1000) is 0 in float32: 0 / 0 noise would be NaN, which argmax picks.
    logits = torch.zeros(1, 1024)
    logits[0, TOP_OF_RANGE["token"]] = -1000.0
    for top_p in (1.0, 0.999):
        ids = Sampler()(logits, top_of_range_batch(top_p)).values
        assert ids.tolist() != [TOP_OF_RANGE["token"]]


@pytest.mark.parametrize("case", ["peaked", "flat", "ties", "masked", "all_equal"])
def test_the_cpu_threshold_from_a_prefix_equals_a_whole_sort(case: str) -> None:
    """The CPU's top-k/top-p threshold looks at each row's 128 largest keys and sorts a row
    whole only when its end lies beyond them: the same thresholds either way."""
    from engine.sampling.sampler import _prefix_threshold, _sorted_threshold
    from engine.sampling.sampling_math import exp_weights

    g = torch.Generator().manual_seed(len(case))
    rows = [(0, 0.9), (50, 0.95), (0, 1.0), (3, 1.0), (200, 0.5), (1, 0.99), (0, 1e-6)]
    x = torch.randn(len(rows), 3000, generator=g) * (8.0 if case == "peaked" else 0.5)
    if case == "ties":
        x = torch.round(x * 4) / 4
    elif case == "masked":
        x[:, ::3] = float("-inf")
    elif case == "all_equal":
        x = torch.zeros_like(x)
    floats = torch.tensor([[1.0, p, 0.0, 1.0, 0.0, 0.0] for _, p in rows])
    ints = torch.tensor([[1, 0, 0, k, 0] for k, _ in rows])
    batch = SamplingBatch(floats, ints, use_top_k=True, use_top_p=True)
    weights = exp_weights(x - x.max(dim=-1, keepdim=True).values)
    expected = _sorted_threshold(x, weights, batch)
    assert torch.equal(_prefix_threshold(x, weights, batch), expected)
