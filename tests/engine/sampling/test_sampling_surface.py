"""The sampling surface (logit_bias, allowed_token_ids, bad_token_ids, bad words) against a
reference loop that applies the same rule to the Hugging Face model's logits."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.overlap_runs import make_engine
from tests.support.tiny_models import load_hf_model

PROMPT = [0, 17, 42, 99, 123, 7, 88]
STEPS = 16


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def hf(tiny_llama: Path):  # type: ignore[no-untyped-def]
    return load_hf_model(tiny_llama)


def reference(hf, params: SamplingParams, steps: int = STEPS) -> tuple[list[int], list[float]]:  # type: ignore[no-untyped-def]
    """Greedy tokens and processed logprobs: the surface on the HF logits, then repetition."""
    tokens = list(PROMPT)
    logprobs = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, -1].float()
        output = tokens[len(PROMPT) :]
        if params.allowed_token_ids:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[list(params.allowed_token_ids)] = True
            logits = logits.masked_fill(~keep, float("-inf"))
        logits[list(params.bad_token_ids)] = float("-inf")
        for word in params.bad_word_ids:
            if tuple(output[len(output) - len(word) + 1 :]) == word[:-1] or len(word) == 1:
                logits[word[-1]] = float("-inf")
        for token, bias in params.logit_bias.items():
            logits[token] += bias
        rep = params.repetition_penalty
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[tokens] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        token = int(logits.argmax())
        logprobs.append(float(logits.log_softmax(-1)[token]))
        tokens.append(token)
    return tokens[len(PROMPT) :], logprobs


def greedy(**surface: object) -> SamplingParams:
    common = {"temperature": 0.0, "max_tokens": STEPS, "ignore_eos": True, "logprobs": True}
    return SamplingParams(**common, **surface)  # type: ignore[arg-type]


def assert_matches_reference(engine: LLMEngine, hf, params: SamplingParams) -> list[int]:  # type: ignore[no-untyped-def]
    result = engine.generate([PROMPT], params)[0]
    tokens, logprobs = reference(hf, params)
    assert result.token_ids == tokens
    torch.testing.assert_close(
        torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0
    )
    return result.token_ids


@pytest.fixture(scope="module")
def plain(engine: LLMEngine) -> list[int]:
    return engine.generate([PROMPT], greedy())[0].token_ids


def test_allowed_token_ids_pick_the_argmax_over_the_allowed_set(engine, hf, plain) -> None:  # type: ignore[no-untyped-def]
    allowed = tuple(sorted(set(range(40, 60)) | {plain[1]}))
    tokens = assert_matches_reference(engine, hf, greedy(allowed_token_ids=allowed))
    assert set(tokens) <= set(allowed) and tokens != plain


def test_bad_token_ids_never_appear(engine, hf, plain) -> None:  # type: ignore[no-untyped-def]
    banned = tuple(plain[:3])
    tokens = assert_matches_reference(engine, hf, greedy(bad_token_ids=banned))
    assert not set(tokens) & set(banned)


def test_a_bad_word_of_two_tokens_never_appears_and_its_last_token_still_may(
    engine,
    hf,
    plain,  # type: ignore[no-untyped-def]
) -> None:
    word = (plain[2], plain[3])
    words = (word, (plain[6], plain[7], plain[8]))
    tokens = assert_matches_reference(engine, hf, greedy(bad_word_ids=words))
    pairs = list(itertools.pairwise(tokens))
    assert word not in pairs and tokens != plain
    triples = list(zip(tokens, tokens[1:], tokens[2:], strict=False))
    assert words[1] not in triples


def test_a_logit_bias_of_100_makes_greedy_pick_the_token(engine, hf, plain) -> None:  # type: ignore[no-untyped-def]
    token = next(t for t in range(5, 100) if t not in plain)
    tokens = assert_matches_reference(engine, hf, greedy(logit_bias={token: 100.0}))
    assert tokens == [token] * STEPS


def test_logit_bias_applies_before_repetition_penalty(engine, hf, plain) -> None:  # type: ignore[no-untyped-def]
    # (logit + bias) / penalty differs from logit / penalty + bias: the logprobs tell the order.
    bias = {plain[0]: 1.5, plain[1]: -2.0, 33: 0.75, PROMPT[2]: 2.5}
    assert_matches_reference(engine, hf, greedy(logit_bias=bias, repetition_penalty=1.4))


def test_raw_logprobs_ignore_the_surface(engine, hf, plain) -> None:  # type: ignore[no-untyped-def]
    params = greedy(logit_bias={plain[0]: -50.0}, bad_token_ids=(plain[1],), raw_logprobs=True)
    result = engine.generate([PROMPT], params)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + result.token_ids])).logits[0].float()
    raw = logits[len(PROMPT) - 1 : -1].log_softmax(-1)
    expected = raw.gather(-1, torch.tensor(result.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)
    assert result.token_ids[0] != plain[0]


def test_sampled_tokens_stay_inside_the_allowed_set_and_out_of_the_banned(engine) -> None:  # type: ignore[no-untyped-def]
    allowed = tuple(range(30, 50))
    params = SamplingParams(
        temperature=1.5, seed=7, max_tokens=24, ignore_eos=True,
        allowed_token_ids=allowed, bad_token_ids=(31, 32), logit_bias={40: 3.0},
    )  # fmt: skip
    others = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    results = engine.generate([PROMPT, PROMPT], [params, others])  # type: ignore[arg-type]
    assert set(results[0].token_ids) <= set(allowed) - {31, 32}
    assert not set(results[1].token_ids) <= set(allowed)


def test_overlapped_steps_ban_bad_words_like_the_plain_loop(tiny_llama: Path, plain) -> None:  # type: ignore[no-untyped-def]
    params = greedy(bad_word_ids=((plain[2], plain[3]),))
    runs = [
        make_engine(tiny_llama, overlap).generate([PROMPT], params)[0] for overlap in (False, True)
    ]
    assert runs[0].token_ids == runs[1].token_ids


@pytest.mark.parametrize(
    ("surface", "field"),
    [
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {500: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": (1, 500)}, "allowed_token_ids"),
        ({"allowed_token_ids": tuple(range(1025))}, "allowed_token_ids"),
        ({"bad_token_ids": (-1,)}, "bad_token_ids"),
        ({"bad_word_ids": ((),)}, "bad_word_ids"),
        ({"bad_word_ids": ((1, 2, 500),)}, "bad_word_ids"),
        ({"bad_word_ids": ((1,),) * 129}, "bad_word_ids"),
        ({"bad_word_ids": (tuple(range(65)),)}, "bad_word_ids"),
        (
            {"allowed_token_ids": (3, 4), "bad_token_ids": (3,), "bad_word_ids": ((4,),)},
            "allowed_token_ids",
        ),
    ],
)
def test_out_of_bounds_surfaces_name_their_field(surface: dict, field: str) -> None:
    assert [f for f, _ in SamplingParams(**surface).errors(vocab_size=320)] == [field]
