"""The fused Triton sampler picks exactly the torch Sampler's tokens (logprobs to 1e-5):
compiled on CUDA, else on the CPU through Triton's interpreter.

NOTE: `use_triton` (tests/support/triton_interpreter.py) runs at collection: it chooses the
interpreter before anything imports triton.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch

from engine.sampling import sampler_choice
from engine.sampling.sampler import Sampler, SamplingBatch
from tests.support.fixed_bitmask import FixedBitmask
from tests.support.triton_interpreter import use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
use_triton(DEVICE)

VOCAB = 300
PAD = VOCAB
inf = float("inf")


@pytest.fixture(scope="module")
def fused() -> ModuleType:
    import engine.sampling.fused_sampler as module

    return module


def make_batch(rows: list[dict], vocab: int = VOCAB, **flags: object) -> SamplingBatch:
    """One row per dict (temperature, top_k, top_p, min_p, penalties, seed, step, context,
    prompt_len, banned, allowed, bias: {id: value}); the batch flags follow from the rows unless
    given."""
    floats, ints, contexts, bans = [], [], [], []
    for i, r in enumerate(rows):
        rep, freq, pres = r.get("penalties", (1.0, 0.0, 0.0))
        floats.append([r.get("temperature", 1.0), r.get("top_p", 1.0), r.get("min_p", 0.0)])
        floats[-1] += [rep, freq, pres]
        seed = r.get("seed", 1000 + 7 * i)
        ints.append([seed & 0xFFFFFFFF, seed >> 32, r.get("step", 0), r.get("top_k", 0)])
        ints[-1].append(r.get("prompt_len", 0))
        contexts.append(r.get("context", []))
        bans.append(r.get("banned", []))
    sampled = [r for r in rows if r.get("temperature", 1.0) > 0]
    batch = SamplingBatch(
        torch.tensor(floats, device=DEVICE),
        torch.tensor(ints, dtype=torch.int64, device=DEVICE),
        all_greedy=not sampled,
        use_top_k=any(r.get("top_k", 0) > 0 for r in sampled),
        use_top_p=any(r.get("top_p", 1.0) < 1.0 for r in sampled),
        use_min_p=any(r.get("min_p", 0.0) > 0.0 for r in sampled),
        use_penalties=any(r.get("penalties", (1.0, 0.0, 0.0)) != (1.0, 0.0, 0.0) for r in rows),
    )
    if batch.use_penalties:
        batch.context_ids = padded(contexts)
    if any(bans):
        batch.suppress_ids = padded(bans)
    allowed = [r.get("allowed", []) for r in rows]
    if any(allowed):
        batch.allowed_ids = padded(allowed)
        batch.allowed_rows = torch.tensor([bool(a) for a in allowed], device=DEVICE)
    bias = [r.get("bias", {}) for r in rows]
    if any(bias):
        batch.bias_ids = padded([list(b) for b in bias])
        values = [list(b.values()) + [0.0] * (batch.bias_ids.shape[1] - len(b)) for b in bias]
        batch.bias_values = torch.tensor(values, device=DEVICE)
    return replace(batch, **flags)


def padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(1, max(map(len, rows)))
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows], device=DEVICE)


def make_logits(rows: int, seed: int = 0, scale: float = 3.0, step: float = 0.0) -> torch.Tensor:
    """Random logits; `step` > 0 rounds them to multiples of it, so that ties abound."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * scale
    if step:
        logits = torch.round(logits / step) * step
    return logits.to(DEVICE)


def assert_same_sampling(
    fused: ModuleType,
    logits: torch.Tensor,
    batch: SamplingBatch,
    per_row: int = 3,
    survivors: int = 16,
) -> None:
    """`per_row` programs per row: 3 splits 300 tokens into slices of 128, 128 and 44. Rows
    with top-k up to `survivors` (and fewer ties) finish on their gathered survivors, the
    others by the radix passes."""
    expected = Sampler()(logits, batch).unpack()
    programs = per_row * logits.shape[0]
    sampler = fused.FusedSampler(block=64, num_programs=programs, survivors=survivors)
    got = sampler(logits, batch).unpack()
    assert torch.equal(got[0], expected[0]), (got[0], expected[0])
    for g, e in zip(got[1:], expected[1:], strict=True):
        assert (g is None) == (e is None)
    if expected[1] is not None:
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-5)
    if expected[2] is not None:
        assert torch.equal(got[2], expected[2]), (got[2], expected[2])
        torch.testing.assert_close(got[3], expected[3], rtol=0, atol=1e-5)


CONTEXT = {"context": [5, 9, 9, 17, 9, 250, 5, 299, 0], "prompt_len": 3}
OPTIONS = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.7},
    "top_k": {"top_k": 7},
    "top_k_all": {"top_k": VOCAB + 5},
    "top_p": {"top_p": 0.6},
    "min_p": {"min_p": 0.05},
    "repetition": {"penalties": (1.3, 0.0, 0.0), **CONTEXT},
    "frequency": {"penalties": (1.0, 0.5, 0.0), **CONTEXT},
    "presence": {"penalties": (1.0, 0.0, -0.8), **CONTEXT},
    "banned": {"banned": [1, 2, 3, 42]},
    "rl": {"top_k": 50, "top_p": 0.9, "penalties": (1.1, 0.0, 0.0), **CONTEXT},
    # The sampling surface: bans are -inf biases (bad ids and words), then top-p and penalties.
    "allowed": {"allowed": [3, 8, 40, 41, 77, 150, 299], "top_p": 0.9},
    "bias": {
        "bias": {7: 4.0, 8: -inf, 100: -3.5, 299: 1.25},
        "penalties": (1.2, 0.0, 0.0),
        **CONTEXT,
    },
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_each_option_picks_the_torch_samplers_tokens(fused: ModuleType, option: str) -> None:
    # Eight steps of one request: every row its own output index, so eight independent draws.
    rows = [{**OPTIONS[option], "step": step} for step in range(8)]
    assert_same_sampling(fused, make_logits(8, seed=len(option)), make_batch(rows))


@pytest.mark.parametrize(
    "logprobs", ["processed", "raw", "mixed"], ids=["processed", "raw", "mixed"]
)
def test_logprobs_and_top_logprobs_match_within_1e_5(fused: ModuleType, logprobs: str) -> None:
    rows = [OPTIONS["rl"], OPTIONS["greedy"], OPTIONS["banned"], OPTIONS["temperature"]]
    raw_rows = torch.tensor([logprobs != "processed", logprobs == "raw", True, False])
    flags = {
        "num_top_logprobs": 5,
        "logprobs": logprobs != "raw",
        "raw_logprobs": logprobs != "processed",
        "raw_rows": raw_rows.to(DEVICE) if logprobs == "mixed" else None,
    }
    assert_same_sampling(fused, make_logits(4, seed=3), make_batch(rows, **flags))


def test_a_mixed_batch_picks_the_torch_samplers_tokens(fused: ModuleType) -> None:
    rows = [
        {**OPTIONS[name], "step": i, "seed": 99 + i}
        for i, name in enumerate(
            ["greedy", "rl", "top_p", "temperature", "min_p", "frequency", "top_k", "banned"]
        )
    ]
    rows[3]["min_p"] = 0.2  # a row with min-p and a row with top-k in the same batch
    flags = {"num_top_logprobs": 3, "logprobs": True}
    assert_same_sampling(fused, make_logits(8, seed=11, scale=2.0), make_batch(rows, **flags))


def test_ties_are_broken_the_same_way(fused: ModuleType) -> None:
    # Logits in steps of 0.5: the k-th value, top-p groups, maxima and top logprobs all tie.
    rows = [
        {"top_k": 5, "step": 0},
        {"top_k": 1, "step": 1},
        {"top_p": 0.3, "step": 2},
        {"top_p": 0.5, "top_k": 9, "step": 3},
        {"min_p": 0.5, "step": 4},
        {"temperature": 0.0},
    ]
    logits = make_logits(len(rows), seed=5, scale=1.0, step=0.5)
    batch = make_batch(rows, num_top_logprobs=6, logprobs=True)
    assert_same_sampling(fused, logits, batch)


def test_many_seeds_of_the_rl_setting_agree(fused: ModuleType) -> None:
    rows = [{**OPTIONS["rl"], "seed": 5000 + i, "step": i % 5} for i in range(8)]
    assert_same_sampling(fused, make_logits(8, seed=7, scale=4.0), make_batch(rows))


def test_noise_at_the_top_of_the_hash_range_is_drawn_as_the_torch_sampler_draws_it(
    fused: ModuleType,
) -> None:
    # Seed 1234 at output index 4891 hashes token 222 to the top of the uniform range, which
    # rounds to 1 in float32 unless capped (tests/engine/sampling/test_sampling.py). Equal weights:
    # the token wins the race. A weight of 0: it must not be drawn.
    edge = {"seed": 1234, "step": 4891}
    rows = [edge, {**edge, "top_p": 0.999}, edge, {**edge, "top_p": 0.999}]
    logits = torch.zeros(4, VOCAB)
    logits[2:, 222] = -1000.0
    batch = make_batch(rows)
    assert_same_sampling(fused, logits.to(DEVICE), batch)
    ids = fused.FusedSampler(block=64)(logits.to(DEVICE), batch).values.tolist()
    assert ids[:2] == [222, 222] and 222 not in ids[2:]


def test_the_scratch_is_clean_after_each_call(fused: ModuleType) -> None:
    sampler = fused.FusedSampler(block=64, num_programs=6)
    logits = make_logits(2, seed=1)
    first = make_batch([OPTIONS["rl"], OPTIONS["banned"]], num_top_logprobs=2, logprobs=True)
    sampler(logits, first)
    assert sampler._marks is not None and int(sampler._marks.abs().sum()) == 0
    assert sampler._scratch is not None and int(sampler._scratch.abs().sum()) == 0
    # A batch without those marks must not see the first one's.
    second = make_batch([OPTIONS["presence"], {"temperature": 0.0}])
    expected = Sampler()(logits, second).values
    assert torch.equal(sampler(logits, second).values, expected)


def test_an_engine_with_the_fused_sampler_generates_the_torch_engines_tokens(
    fused: ModuleType, tiny_llama: Path
) -> None:
    from engine import EngineConfig, LLMEngine, SamplingParams

    rl = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, repetition_penalty=1.1, logprobs=True,
        top_logprobs=5, max_tokens=6, ignore_eos=True, seed=3, min_tokens=2,
    )  # fmt: skip
    params = [rl, replace(rl, temperature=0.0, seed=4), replace(rl, raw_logprobs=True, seed=5)]
    prompts = [[0, 17, 42, 99], [5, 6, 7], [1, 2, 3, 4, 5, 6]]
    # A sampling surface, in a batch of its own: beside raw logprobs (the third row) a step
    # runs the torch Sampler.
    surface = {"logit_bias": {5: 2.0, 9: -1.0}, "bad_token_ids": (7,), "bad_word_ids": ((3, 4),)}
    alone = replace(rl, seed=6, allowed_token_ids=tuple(range(2, 60)), **surface)
    results = {}
    for name in ("torch", "triton"):
        # No warm-up: a full step under the interpreter takes minutes.
        config = EngineConfig(model=str(tiny_llama), device=DEVICE, sampler=name, warmup=False)
        engine = LLMEngine(config)
        chosen = engine.runner.sampler
        assert isinstance(chosen, sampler_choice.FusedOrTorch) == (name == "triton")
        if isinstance(chosen, sampler_choice.FusedOrTorch):
            assert isinstance(chosen.fused, fused.FusedSampler)
            if DEVICE == "cpu":
                # Top-k 50 rows finish on their gathered survivors, sorted in 64 slots, not in
                # the default 1,024: under the interpreter that sort was 80% of this test.
                chosen.fused.survivors = 64
        results[name] = engine.generate(prompts, params) + engine.generate([[9, 8, 7]], alone)
    for got, expected in zip(results["triton"], results["torch"], strict=True):
        assert got.token_ids == expected.token_ids
        assert got.logprobs is not None and expected.logprobs is not None
        assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
        assert [ids for ids, _ in got.top_logprobs] == [ids for ids, _ in expected.top_logprobs]


def test_the_kernels_exp_and_log_equal_the_references_bit_for_bit() -> None:
    from engine.sampling.fused_math import math_kernel
    from engine.sampling.sampling_math import U_MAX, exp_weights, neg_log

    g = torch.Generator().manual_seed(0)
    edges = [0.0, -0.0, -1e-30, -1e-7, -79.999, -80.0, -80.001, -1e4, float("-inf")]
    d = torch.cat([torch.tensor(edges), -torch.rand(4087, generator=g) * 90]).to(DEVICE)
    k = torch.cat([torch.tensor([0, 1, 2**23, 2**24 - 1]), torch.randint(2**24, (4092,))])
    u = ((k.float() + 0.5) * 2.0**-24).clamp(max=U_MAX).to(DEVICE)  # as the samplers draw it
    w, e = torch.empty_like(d), torch.empty_like(u)
    kernel = math_kernel()
    kernel[(d.numel() // 1024,)](d, u, w, e, d.numel(), BLOCK=1024, enable_fp_fusion=False)
    assert torch.equal(w.view(torch.int32), exp_weights(d).view(torch.int32))
    assert torch.equal(e.view(torch.int32), neg_log(u).view(torch.int32))


def test_rows_split_into_slices_that_do_not_divide_the_vocabulary(fused: ModuleType) -> None:
    sampler = fused.FusedSampler(block=64, num_programs=8)
    cpu = torch.device("cpu")
    assert sampler.splits(1, VOCAB, cpu) == (5, 64)  # 4 slices of 64, one of 44
    assert sampler.splits(2, VOCAB, cpu) == (3, 128)  # 128, 128 and 44
    assert sampler.splits(4, VOCAB, cpu) == (2, 192)  # 192 and 108
    assert sampler.splits(64, VOCAB, cpu) == (1, 320)  # many rows: one program each


@pytest.mark.parametrize("per_row", [1, 2, 5, 8])
def test_every_split_count_picks_the_torch_samplers_tokens(fused: ModuleType, per_row: int) -> None:
    rows = [
        {**OPTIONS["rl"], "step": 0},
        {"top_p": 0.8, "step": 1},
        {"top_k": 3, "top_p": 0.95, "step": 2},
        {**OPTIONS["banned"], "min_p": 0.1},
    ]
    flags = {"num_top_logprobs": 5, "logprobs": True}
    batch = make_batch(rows, **flags)
    assert_same_sampling(fused, make_logits(4, seed=21), batch, per_row=per_row)


def test_a_single_row_spread_over_the_whole_grid_matches(fused: ModuleType) -> None:
    for i, option in enumerate(["rl", "top_p", "temperature", "greedy"]):
        rows = [{**OPTIONS[option], "step": i}]
        batch = make_batch(rows, num_top_logprobs=2, logprobs=True)
        assert_same_sampling(fused, make_logits(1, seed=30 + i), batch, per_row=5)


def test_many_rows_of_mixed_options_match(fused: ModuleType) -> None:
    names = sorted(OPTIONS)
    rows = [{**OPTIONS[names[i % len(names)]], "step": i, "seed": 7 * i} for i in range(24)]
    assert_same_sampling(fused, make_logits(24, seed=40, scale=2.0), make_batch(rows), per_row=2)


@pytest.mark.parametrize("survivors", [1, 16], ids=["radix", "gathered"])
def test_ties_at_the_top_k_boundary_keep_the_whole_group(fused: ModuleType, survivors: int) -> None:
    # Ten tokens share the largest logit, spread over every slice: top-k 4 keeps all ten,
    # top-k 12 keeps them and all three at 1.0 (the 12th is one of them).
    logits = torch.zeros(4, VOCAB)
    tied = [3, 70, 129, 130, 190, 255, 256, 280, 298, 299]
    logits[:, tied] = 5.0
    logits[:, [10, 150, 290]] = 1.0
    rows = [
        {"top_k": 4, "step": 0},
        {"top_k": 12, "step": 1},
        {"top_k": 10, "top_p": 0.3, "step": 2},
        {"top_k": 11, "top_p": 0.99, "step": 3},
    ]
    batch = make_batch(rows, num_top_logprobs=4, logprobs=True)
    assert_same_sampling(fused, logits.to(DEVICE), batch, survivors=survivors)
    # Row 0's eight draws are all among the ten (the reference's rule, checked against it).
    eight = make_batch([{**rows[0], "step": step} for step in range(8)])
    sampler = fused.FusedSampler(block=64, num_programs=24, survivors=survivors)
    ids = sampler(logits[:1].repeat(8, 1).to(DEVICE), eight).values
    assert set(ids.tolist()) <= set(tied) and len(set(ids.tolist())) > 1


@pytest.mark.parametrize("top_k", [0, 1, 9, 60])
def test_top_p_with_and_without_top_k_matches(fused: ModuleType, top_k: int) -> None:
    rows = [{"top_k": top_k, "top_p": p, "step": i} for i, p in enumerate([0.05, 0.5, 0.9, 1.0])]
    assert_same_sampling(fused, make_logits(4, seed=50 + top_k, scale=1.5), make_batch(rows))


def test_raw_logprobs_beside_a_surface_run_the_torch_sampler(fused: ModuleType) -> None:
    batch = make_batch([OPTIONS["bias"], OPTIONS["temperature"]], raw_logprobs=True)
    logits = make_logits(2, seed=70)
    with pytest.raises(AssertionError, match="raw logprobs"):
        fused.FusedSampler()(logits, batch)
    chosen = sampler_choice.FusedOrTorch(fused.FusedSampler(), Sampler())
    got, expected = chosen(logits, batch).unpack(), Sampler()(logits, batch).unpack()
    assert torch.equal(got[0], expected[0])
    raw = logits.log_softmax(-1).gather(-1, got[0][:, None]).squeeze(-1)
    torch.testing.assert_close(got[1], raw, rtol=0, atol=1e-6)  # the model's own logits


def test_a_grammar_mask_picks_the_torch_samplers_tokens(fused: ModuleType) -> None:
    rows = [OPTIONS["rl"], OPTIONS["top_p"], OPTIONS["greedy"], OPTIONS["allowed"]]
    batch = make_batch(rows, num_top_logprobs=3, logprobs=True)
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**31), 2**31 - 1, (4, (VOCAB + 31) // 32), generator=gen)
    bits = bits.to(torch.int32)
    bits[1] = -1  # an unconstrained row
    bits[3, :] = 0
    bits[3, 0] = 1 << 8  # allows only token 8, which the row's allowed ids hold too
    batch.grammar = FixedBitmask(bits)
    assert_same_sampling(fused, make_logits(4, seed=80), batch)
    assert Sampler()(make_logits(4, seed=80), batch).unpack()[0][3] == 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_in_the_models_dtype_match(fused: ModuleType, dtype: torch.dtype) -> None:
    rows = [OPTIONS["rl"], OPTIONS["top_p"], OPTIONS["greedy"], OPTIONS["frequency"]]
    rows += [OPTIONS["allowed"], OPTIONS["bias"]]  # the surface upcasts: the same float32 logits
    batch = make_batch(rows, num_top_logprobs=3, logprobs=True)
    assert_same_sampling(fused, make_logits(6, seed=60).to(dtype), batch)


def test_launches_per_call_follow_the_options(fused: ModuleType) -> None:
    launches = []
    sampler = fused.FusedSampler(block=64)
    launch = sampler.launch
    sampler.launch = lambda kernel, *a, **k: (launches.append(kernel), launch(kernel, *a, **k))
    logits = make_logits(2, seed=1)
    sampler(logits, make_batch([OPTIONS["greedy"]] * 2))
    assert len(launches) == 2  # the stats pass, the merge
    launches.clear()
    sampler(logits, make_batch([OPTIONS["rl"]] * 2, num_top_logprobs=5, logprobs=True))
    # Stats, 3 top-k digits, the gathering, 4 top-p digits, the survivors' race, the race, the merge.
    assert len(launches) == 12


@pytest.mark.parametrize(
    ("option", "survivors"),
    [({"top_k": 5}, 16), ({"top_p": 0.03}, 16), ({"top_k": 40, "top_p": 0.05}, 16)]
    + [({"top_k": 5}, 1), ({"top_k": 40, "top_p": 0.05}, 64)],
)
def test_a_threshold_off_by_one_token_would_show(
    fused: ModuleType, option: dict, survivors: int
) -> None:
    # Nearly flat logits: every kept token wins about as often as any other, so keeping one
    # token too many or too few changes some of the 32 draws. All in [1, 2) and close: they
    # share the first radix digits and crowd the bins of the third, which the walk must split.
    rows = [{**option, "step": step} for step in range(32)]
    logits = (1.5 + make_logits(1, seed=70, scale=3e-4)).repeat(32, 1)
    assert_same_sampling(fused, logits, make_batch(rows), per_row=2, survivors=survivors)
