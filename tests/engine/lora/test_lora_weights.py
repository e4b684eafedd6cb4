"""A projection's stacked adapters add each adapter's delta to its own tokens' rows and part
columns only, at the adapter's own rank (the padding never enters the arithmetic)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.lora.lora_weights import LoraStep, ProjectionLora
from engine.protocol.config import EngineConfig

PARTS = {"q_proj": 8, "k_proj": 4, "v_proj": 4}  # a merged q/k/v of 16 columns


def make_lora(slots: int = 3, max_rank: int = 8) -> ProjectionLora:
    return ProjectionLora(PARTS, 12, slots, max_rank, torch.device("cpu"), torch.float32)


def test_each_adapter_adds_to_its_tokens_and_its_parts_only() -> None:
    gen = torch.Generator().manual_seed(0)
    lora = make_lora()
    a_q, b_q = torch.randn(2, 12, generator=gen), torch.randn(8, 2, generator=gen)  # rank 2
    a_v, b_v = torch.randn(8, 12, generator=gen), torch.randn(4, 8, generator=gen)  # rank 8
    lora.write(1, 0, a_q, b_q, 0.5)
    lora.write(2, 2, a_v, b_v, 2.0)
    x, base = torch.randn(5, 12, generator=gen), torch.randn(5, 16, generator=gen)
    rows = {1: torch.tensor([0, 3]), 2: torch.tensor([4])}  # tokens 1 and 2: the base model
    y = base.clone()
    projection = torch.nn.Identity()  # any module: the step finds its weights by identity
    LoraStep(list(rows.items()), {projection: lora}).add(projection, x, y)

    expected = base.clone()
    expected[rows[1], :8] += F.linear(F.linear(x[rows[1]], a_q), b_q) * 0.5
    expected[rows[2], 12:] += F.linear(F.linear(x[rows[2]], a_v), b_v) * 2.0
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=0)
    assert torch.equal(y[1:3], base[1:3])  # the base model's tokens: untouched, bit for bit


def test_a_cleared_slot_adds_nothing() -> None:
    lora = make_lora()
    lora.write(0, 1, torch.ones(3, 12), torch.ones(4, 3), 1.0)
    lora.clear(0)
    y = torch.zeros(2, 16)
    lora.add(torch.ones(2, 12), y, 0, torch.tensor([0, 1]))
    assert lora.active[0] == [] and not y.any() and not lora.a.any()


def test_lora_with_tensor_parallelism_is_accepted_in_the_config() -> None:
    config = EngineConfig(max_loras=2, tensor_parallel_size=2)
    assert (config.max_loras, config.tensor_parallel_size) == (2, 2)
