"""A row whose every token's logit is -inf has no token: the samplers (torch, its C passes on
the CPU, and the fused Triton kernels) give it NO_TOKEN, never an id, and leave the other rows'
tokens as they would be without it. Every way a row can lose its last token, greedy and
sampled: allowed ids all biased to -inf, allowed ids all banned (min_tokens, bad ids), a grammar
that allows nothing, a grammar whose only token the allowed ids exclude."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from test_fused_sampler import DEVICE, VOCAB, make_batch, make_logits

from engine.sampling import cpu_race
from engine.sampling.sampler import NO_TOKEN, Sampler, SamplingBatch
from tests.support.fixed_bitmask import FixedBitmask

inf = float("inf")
ALLOWED = [3, 8, 40]
SAMPLED = {"temperature": 0.7, "top_k": 7, "top_p": 0.8, "min_p": 0.01}
GREEDY = {"temperature": 0.0}
ROWS = [  # (row, its grammar: None = unconstrained, else the one token it allows or -1: none)
    (GREEDY, None),
    ({"allowed": ALLOWED, "bias": {t: -inf for t in ALLOWED}, **GREEDY}, None),
    ({"temperature": 0.8, "top_k": 5, "top_p": 0.9}, None),
    ({"allowed": ALLOWED, "bias": {t: -inf for t in ALLOWED}, **SAMPLED}, None),
    ({"allowed": ALLOWED, "banned": ALLOWED, **GREEDY}, None),
    ({"allowed": ALLOWED, "bias": {3: -inf, 8: -inf}, "min_p": 0.1}, None),  # only 40 is left
    ({"allowed": ALLOWED, "banned": ALLOWED, **SAMPLED}, None),
    (GREEDY, -1),
    (SAMPLED, -1),
    ({"allowed": ALLOWED, **SAMPLED}, 5),  # the grammar's only token is not allowed
    (SAMPLED, 5),
]
IMPOSSIBLE = [1, 3, 4, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def fused() -> ModuleType:
    import engine.sampling.fused_sampler as module

    return module


def make(indices: list[int], **flags: object) -> SamplingBatch:
    """A batch of ROWS[i] for i in `indices`, each seeded by its index in ROWS."""
    rows = [ROWS[i] for i in indices]
    batch = make_batch([{"seed": 500 + i, **ROWS[i][0]} for i in indices], **flags)
    bits = torch.full((len(rows), (VOCAB + 31) // 32), -1, dtype=torch.int32)
    for i, (_, only) in enumerate(rows):
        if only is not None:
            bits[i] = 0
            if only >= 0:
                bits[i, only // 32] = 1 << (only % 32)
    batch.grammar = FixedBitmask(bits.to(DEVICE))
    return batch


def ids_of(sampler, logits: torch.Tensor, batch: SamplingBatch) -> list[int]:  # type: ignore[no-untyped-def]
    return sampler(logits, batch).unpack()[0].tolist()


@pytest.mark.parametrize("logprobs", [False, True], ids=["ids", "logprobs"])
def test_rows_with_no_possible_token_get_no_token_from_every_sampler(
    fused: ModuleType, monkeypatch: pytest.MonkeyPatch, logprobs: bool
) -> None:
    flags = {"logprobs": True, "num_top_logprobs": 2} if logprobs else {}
    logits = make_logits(len(ROWS), seed=11)
    every = list(range(len(ROWS)))
    torch_ids = ids_of(Sampler(), logits, make(every, **flags))
    assert [row for row, t in enumerate(torch_ids) if t == NO_TOKEN] == IMPOSSIBLE
    assert torch_ids[5] == 40 and torch_ids[10] == 5
    # The other rows draw what they draw beside any row (a row's noise is its own).
    possible = [i for i in range(len(ROWS)) if i not in IMPOSSIBLE]
    alone = ids_of(Sampler(), logits[possible], make(possible, **flags))
    assert [torch_ids[i] for i in possible] == alone
    sampler = fused.FusedSampler(block=64, num_programs=3 * len(ROWS), survivors=16)
    assert ids_of(sampler, logits, make(every, **flags)) == torch_ids
    if DEVICE == "cpu":
        assert cpu_race.usable(logits)  # the C passes ran above; now the torch code alone
        monkeypatch.setattr(cpu_race, "usable", lambda logits: False)
        assert ids_of(Sampler(), logits, make(every, **flags)) == torch_ids
