"""Logprob modes and the sampling support, against a reference built from Hugging Face's own
warpers on the same processed logits: RAW is the raw logits' log-softmax, PROCESSED the
temperature-divided one, SAMPLED the one renormalised over the tokens top-k, top-p and min-p
keep (ties at the k-th logit kept, as HF keeps them), and the support is that kept set."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.protocol.messages import LogprobMode
from engine.sampling.sampler import Sampler, SamplingBatch
from engine.sampling.sampler_choice import FusedOrTorch
from tests.support.tiny_models import load_hf_model

VOCAB = 40
# temperature, top_k, top_p, min_p per row; row 0's 3rd and 4th largest logits tie.
ROWS = [
    (0.7, 3, 1.0, 0.0),
    (1.3, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.2),
    (0.9, 6, 0.9, 0.05),
    (0.0, 0, 1.0, 0.0),  # greedy: the point mass on its argmax
    (1.0, 0, 1.0, 0.0),  # nothing truncated: every token
]


def tied_logits() -> torch.Tensor:
    logits = torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    top = logits[0].topk(4).indices
    logits[0, top[3]] = logits[0, top[2]]  # a tie at the top_k-th place
    return logits


def batch_of(rows: list[tuple[float, int, float, float]], **flags: object) -> SamplingBatch:
    floats = torch.tensor([[t, p, m, 1.0, 0.0, 0.0] for t, _, p, m in rows])
    ints = torch.tensor([[11 + i, 0, 3, k, 0] for i, (_, k, _, _) in enumerate(rows)])
    sampled = [r for r in rows if r[0] > 0]
    batch = SamplingBatch(
        floats,
        ints,
        all_greedy=not sampled,
        use_top_k=any(k > 0 for _, k, _, _ in sampled),
        use_top_p=any(p < 1.0 for _, _, p, _ in sampled),
        use_min_p=any(m > 0.0 for _, _, _, m in sampled),
    )
    return replace(batch, **flags)


def hf_kept(processed: torch.Tensor, row: tuple[float, int, float, float]) -> torch.Tensor:
    """[vocab] bool: what HF's warpers keep of one row's processed logits."""
    temperature, top_k, top_p, min_p = row
    if temperature == 0:
        return torch.arange(VOCAB) == processed.argmax()
    scores = processed[None].clone()
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores[0] > float("-inf")


def processed_of(logits: torch.Tensor) -> torch.Tensor:
    temperatures = torch.tensor([t if t > 0 else 1.0 for t, _, _, _ in ROWS])
    return logits / temperatures[:, None]


def test_sampled_logprobs_and_support_equal_hf_warpers_including_a_tie() -> None:
    logits = tied_logits()
    batch = batch_of(ROWS, sampled_logprobs=True, num_top_logprobs=3, support_width=VOCAB)
    ids, logprobs, top_ids, top_lps = (out := Sampler()(logits, batch)).unpack()
    assert top_ids is not None and top_lps is not None and logprobs is not None
    processed = processed_of(logits)
    values = out.values
    for i, row in enumerate(ROWS):
        kept = hf_kept(processed[i], row)
        expected = torch.log_softmax(processed[i].masked_fill(~kept, float("-inf")), dim=-1)
        assert kept[ids[i]], f"row {i} drew a token its warpers drop"
        torch.testing.assert_close(logprobs[i], expected[ids[i]], atol=1e-5, rtol=0)
        torch.testing.assert_close(top_lps[i], expected[top_ids[i]], atol=1e-5, rtol=0)
        size = int(values[i, 2 + 2 * 3])
        listed = values[i, 3 + 2 * 3 : 3 + 2 * 3 + max(size, 0)].long()
        if i == 5:
            assert size == -1  # nothing truncated: every token
            continue
        assert size == int(kept.sum()) and set(listed.tolist()) == set(
            kept.nonzero()[:, 0].tolist()
        )
        assert processed[i][listed].diff().le(0).all(), "most likely first"
    assert int(values[0, 8]) == 4  # top_k 3 with a tie at the third place keeps 4
    assert logprobs[4] == 0.0  # greedy: drawn from a point mass


def test_modes_side_by_side_give_raw_processed_and_sampled() -> None:
    logits = tied_logits()
    raw_rows = torch.tensor([i % 3 == 0 for i in range(len(ROWS))])
    sampled_rows = torch.tensor([i % 3 == 1 for i in range(len(ROWS))])
    batch = batch_of(
        ROWS,
        logprobs=True,
        raw_logprobs=True,
        sampled_logprobs=True,
        raw_rows=raw_rows,
        sampled_rows=sampled_rows,
    )
    ids, logprobs, _, _ = Sampler()(logits, batch).unpack()
    assert logprobs is not None
    processed = processed_of(logits)
    for i, row in enumerate(ROWS):
        if raw_rows[i]:
            source = logits[i]
        elif sampled_rows[i]:
            source = processed[i].masked_fill(~hf_kept(processed[i], row), float("-inf"))
        else:
            source = processed[i]
        expected = torch.log_softmax(source, dim=-1)[ids[i]]
        torch.testing.assert_close(logprobs[i], expected, atol=1e-5, rtol=0)


def test_asking_for_modes_and_support_changes_no_token() -> None:
    logits = tied_logits()
    plain = Sampler()(logits, batch_of(ROWS)).unpack()[0]
    asked = batch_of(ROWS, sampled_logprobs=True, num_top_logprobs=2, support_width=8)
    assert torch.equal(Sampler()(logits, asked).unpack()[0], plain)


def test_a_batch_asking_for_sampled_logprobs_or_support_runs_the_torch_sampler() -> None:
    calls: list[str] = []

    def fused(logits: torch.Tensor, batch: SamplingBatch):  # type: ignore[no-untyped-def]
        calls.append("fused")
        return Sampler()(logits, batch)

    chosen = FusedOrTorch(fused, Sampler())
    logits = tied_logits()
    chosen(logits, batch_of(ROWS, logprobs=True))
    chosen(logits, batch_of(ROWS, sampled_logprobs=True))
    chosen(logits, batch_of(ROWS, support_width=4))
    assert calls == ["fused"]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32"))


def test_an_engine_returns_sampled_logprobs_and_supports_equal_to_hf(
    engine: LLMEngine, tiny_llama: Path
) -> None:
    hf = load_hf_model(tiny_llama)
    prompt = [0, 17, 42, 99, 123, 7, 88]
    params = SamplingParams(
        temperature=1.2, top_k=8, top_p=0.9, min_p=0.02, seed=3, max_tokens=12, ignore_eos=True,
        logprobs=True, logprob_mode=LogprobMode.SAMPLED, sampling_support=True,
    )  # fmt: skip
    result = engine.generate([prompt], params)[0]
    tokens = result.token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    processed = logits / 1.2
    assert result.sampling_support is not None and result.logprobs is not None
    for i, token in enumerate(tokens):
        kept = hf_kept(processed[i], (1.2, 8, 0.9, 0.02))
        assert set(result.sampling_support[i]) == set(kept.nonzero()[:, 0].tolist())
        expected = torch.log_softmax(processed[i].masked_fill(~kept, float("-inf")), dim=-1)
        assert result.logprobs[i] == pytest.approx(expected[token].item(), abs=1e-4)
    same_tokens = engine.generate([prompt], replace(params, sampling_support=False, logprobs=False))
    assert same_tokens[0].token_ids == tokens


def test_a_greedy_request_is_drawn_from_a_point_mass(engine: LLMEngine) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True,
        logprob_mode=LogprobMode.SAMPLED, sampling_support=True,
    )  # fmt: skip
    result = engine.generate([[0, 5, 9]], params)[0]
    assert result.logprobs == [0.0] * 6
    assert result.sampling_support == [[t] for t in result.token_ids]


@pytest.mark.parametrize(
    ("params", "error"),
    [
        (SamplingParams(top_p=0.9, sampling_support=True), "sampling_support: needs top_k"),
        (SamplingParams(top_k=2000, sampling_support=True), "sampling_support: needs top_k"),
        (
            SamplingParams(raw_logprobs=True, logprob_mode=LogprobMode.SAMPLED),
            "logprob_mode: raw_logprobs means RAW",
        ),
    ],
)
def test_unbounded_supports_and_conflicting_modes_are_refused(
    engine: LLMEngine, params: SamplingParams, error: str
) -> None:
    result = engine.generate([[0, 5, 9]], replace(params, max_tokens=2))[0]
    assert result.finish_reason is FinishReason.ERROR
    assert result.error is not None and error in result.error


@pytest.mark.parametrize("case", ["distinct", "ties", "masked", "zeros", "k_is_vocab"])
def test_top_ids_rank_by_value_then_lowest_id_as_a_stable_sort_does(case: str) -> None:
    from engine.sampling.sampling_math import top_ids

    g = torch.Generator().manual_seed(len(case))
    x = torch.randn(64, 97, generator=g)
    if case == "ties":
        x = torch.round(x * 2) / 2  # a few distinct values: ties everywhere, also at the k-th
    elif case == "masked":
        x[:, ::2] = float("-inf")
        x[:5] = float("-inf")  # rows of nothing but -inf
    elif case == "zeros":
        x = torch.round(x) * 0.0  # +0.0 and -0.0 alike
    k = 97 if case == "k_is_vocab" else 7
    # A stable descending sort keeps equal values in id order: the reference ranking.
    expected = torch.stack([torch.sort(row, descending=True, stable=True).indices for row in x])
    assert torch.equal(top_ids(x, k), expected[:, :k])
