"""The CPU sampler's C passes (engine/sampling/cpu_race.c) against the torch arithmetic they
replace, bit for bit: the exp weights, the race's tokens, the greedy argmax, and a whole
Sampler call with and without them."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import cpu_race
from engine.sampling.sampler import Sampler, SamplingBatch
from engine.sampling.sampling_math import exp_weights, exponential_noise

VOCAB = 3001  # not a multiple of any vector width


@pytest.fixture(autouse=True)
def built() -> None:
    assert cpu_race._lib() is not None, "cpu_race.c did not build (is a C compiler installed?)"


def logits(rows: int, seed: int, scale: float = 4.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, VOCAB, generator=gen) * scale
    x[:, ::97] = float("-inf")  # banned tokens
    x[0, :50] = -200.0  # below e^-80 of the max: weight 0
    x[1, 7] = x[1].max() + 100.0  # one token far above the rest
    return x


@pytest.mark.parametrize("scale", [0.01, 1.0, 8.0, 60.0])
def test_exp_weights_equal_the_torch_polynomial_bit_for_bit(scale: float) -> None:
    x = logits(16, seed=int(scale * 10), scale=scale)
    row_max = x.max(dim=-1, keepdim=True).values
    expected = exp_weights(x - row_max)
    got = cpu_race.exp_weights(x, row_max[:, 0])
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("vocab", [1, 5, 16, 33, VOCAB])
def test_the_argmax_is_torchs_lowest_id_among_equal_maxima(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 3, (40, vocab), generator=gen).float()  # many ties
    x[0] = float("-inf")  # all equal: id 0
    x[1, -1] = 100.0  # in the tail past the vector lanes
    x[2, 0] = 100.0
    x[3, vocab // 2] = float("nan")  # NaN is the largest (torch: the first NaN)
    x[4, vocab - 1] = float("nan")
    x[4, vocab // 3] = float("nan")
    x[5, :] = float("nan")
    x[6] = torch.randn(vocab, generator=gen)  # no ties
    assert torch.equal(cpu_race.argmax(x), x.argmax(dim=-1))


def test_the_noise_equals_the_torch_noise_bit_for_bit() -> None:
    batch = batch_of(32, seed=1)
    seeds, counters = batch.ints[:, :2], batch.column("counter")
    expected = exponential_noise(seeds, counters, VOCAB)
    got = cpu_race.noise_table(seeds, counters, VOCAB)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def batch_of(rows: int, seed: int, **options: float) -> SamplingBatch:
    gen = torch.Generator().manual_seed(seed)
    floats = torch.tensor([[options.get("temperature", 1.0), options.get("top_p", 1.0),
                            options.get("min_p", 0.0), 1.0, 0.0, 0.0]] * rows)  # fmt: skip
    seeds = torch.randint(0, 2**62, (rows,), generator=gen)
    ints = torch.stack(
        [
            seeds & 0xFFFFFFFF,
            seeds >> 32,
            torch.randint(0, 5000, (rows,), generator=gen),  # the output index
            torch.full((rows,), int(options.get("top_k", 0))),
            torch.zeros(rows, dtype=torch.int64),
        ],
        dim=1,
    )
    return SamplingBatch(
        floats,
        ints,
        use_top_k=options.get("top_k", 0) > 0,
        use_top_p=options.get("top_p", 1.0) < 1.0,
        use_min_p=options.get("min_p", 0.0) > 0.0,
        logprobs=True,
        num_top_logprobs=3,
    )


OPTIONS = [
    {},
    {"temperature": 0.7},
    {"top_k": 5},
    {"top_k": 40, "top_p": 0.8},
    {"top_p": 0.3},
    {"min_p": 0.2, "temperature": 1.3},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_the_race_picks_the_torch_tokens(options: dict[str, float]) -> None:
    batch = batch_of(64, seed=len(options), **options)
    x = logits(64, seed=5) / batch.column("temperature")[:, None]
    weights = exp_weights(x - x.max(dim=-1, keepdim=True).values)
    kept = Sampler._kept(x, weights, batch)
    expected = Sampler._race(x, weights, kept, batch)
    sampled = torch.ones(64, dtype=torch.bool)
    sampled[3] = False  # a greedy row: skipped, its token is the caller's argmax
    got = cpu_race.race(weights, kept, batch.ints[:, :2], batch.column("counter"), sampled)
    assert torch.equal(got[sampled], expected[sampled])


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_a_sampler_call_is_the_same_with_and_without_the_c_passes(
    options: dict[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = batch_of(32, seed=10 + len(options), **options)
    x = logits(32, seed=11)
    with_c = Sampler()(x, batch).values
    monkeypatch.setattr(cpu_race, "usable", lambda logits: False)
    without = Sampler()(x, batch).values
    assert torch.equal(with_c, without)
