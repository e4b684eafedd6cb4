"""The segmented LoRA kernel (engine/lora/lora_kernel.py) adds what the torch path adds, in
float32: compiled on CUDA, else on the CPU through Triton's interpreter.

Slots of several ranks below max_rank, merged parts of q/k/v widths, an adapter that skips a
part, resident slots with no tokens in the step, a slot whose rows span two kernel blocks, and
the base model's tokens between them (untouched, bit for bit); and an engine on
layer_kernels=triton, whose mixed batch of two adapters and the base model generates the torch
path's greedy ids and logprobs.

NOTE: `use_triton` (tests/support/triton_interpreter.py) runs at collection: it chooses the
interpreter before anything imports triton.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.lora.lora_weights import LoraStep, ProjectionLora
from tests.support.lora_adapters import make_adapter
from tests.support.tiny_models import prompts
from tests.support.triton_interpreter import use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
use_triton(DEVICE)

QKV = {"q_proj": 32, "k_proj": 16, "v_proj": 16}  # 4 query heads over 2 KV heads of 8
IN, MAX_RANK, SLOTS = 40, 8, 5


def make_lora(parts: dict[str, int], writes: list[tuple[int, int, int, float]]) -> ProjectionLora:
    """A projection with `writes` (slot, part, rank, scaling) of random A and B installed."""
    lora = ProjectionLora(parts, IN, SLOTS, MAX_RANK, torch.device(DEVICE), torch.float32)
    gen = torch.Generator().manual_seed(0)
    widths = list(parts.values())
    for slot, part, rank, scaling in writes:
        a = torch.randn(rank, IN, generator=gen).to(DEVICE)
        b = torch.randn(widths[part], rank, generator=gen).to(DEVICE)
        lora.write(slot, part, a, b, scaling)
    return lora


def run_both(lora: ProjectionLora, token_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """y after the torch path's and the kernel's pass over tokens of `token_slots` (-1: the
    base model), from the same random x and y."""
    gen = torch.Generator().manual_seed(1)
    out = sum(width for _, width in lora.columns)
    x = torch.randn(len(token_slots), IN, generator=gen).to(DEVICE)
    base = torch.randn(len(token_slots), out, generator=gen).to(DEVICE)
    slots = torch.tensor(token_slots)
    groups = [
        (slot, torch.nonzero(slots == slot).flatten().to(DEVICE))
        for slot in sorted(set(token_slots) - {-1})
    ]
    module = torch.nn.Identity()  # any module: the step finds its weights by identity
    results = []
    for triton in (False, True):
        y = base.clone()
        LoraStep(groups, {module: lora}, triton).add(module, x, y)
        results.append(y)
    base_rows = slots == -1
    assert torch.equal(results[1][base_rows.to(DEVICE)], base[base_rows.to(DEVICE)])
    return results[0], results[1]


def test_the_kernel_equals_the_torch_path_on_merged_qkv_parts() -> None:
    lora = make_lora(
        QKV,
        [
            (0, 0, 8, 2.0),  # slot 0: every part at max_rank
            (0, 1, 8, 2.0),
            (0, 2, 8, 2.0),
            (1, 0, 3, 0.5),  # slot 1: rank 3, q and v only (k skipped)
            (1, 2, 3, 0.5),
            (3, 1, 5, 1.25),  # slot 3: rank 5, k only; slots 2 and 4 resident without tokens
        ],
    )
    # Slot 1's 20 rows span two blocks of 16; slot 0 has one row; base tokens in between.
    token_slots = [1, -1, 0] + [1] * 9 + [-1, 3, 3, -1] + [1] * 11 + [3, -1]
    want, got = run_both(lora, token_slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_kernel_equals_the_torch_path_on_a_single_part_projection() -> None:
    lora = make_lora({"o_proj": 72}, [(2, 0, 4, 1.0), (4, 0, 8, 0.25), (0, 0, 1, 3.0)])
    token_slots = [4, 4, -1, 2, 0, 4, -1, 2]  # not grouped: the step's request order
    want, got = run_both(lora, token_slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_cleared_slot_adds_nothing_through_the_kernel() -> None:
    lora = make_lora(QKV, [(1, 0, 4, 1.0), (1, 2, 4, 1.0)])
    lora.clear(1)
    want, got = run_both(lora, [1, 1, -1])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_an_engine_on_the_triton_layer_kernels_generates_the_torch_paths_tokens(
    tiny_llama: Path, tmp_path: Path
) -> None:
    adapters = {
        "a": make_adapter(tiny_llama, tmp_path / "a", r=8),
        "b": make_adapter(tiny_llama, tmp_path / "b", r=4, targets=("q_proj", "down_proj"), seed=1),
    }
    batch = prompts(300, count=3)
    cases = [(p, adapter) for p in batch for adapter in ("a", "", "b")]
    runs = []
    for kernels in ("torch", "triton"):
        config = EngineConfig(
            model=str(tiny_llama),
            device=DEVICE,
            dtype="float32",
            layer_kernels=kernels,
            max_loras=2,
            max_lora_rank=8,
            warmup=False,  # a full step under the interpreter takes minutes
        )
        engine = LLMEngine(config)
        assert engine.lora.triton == (kernels == "triton")
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        params = [
            SamplingParams(temperature=0.0, max_tokens=4, logprobs=True, adapter=adapter)
            for _, adapter in cases
        ]
        runs.append(engine.generate([p for p, _ in cases], params))
        engine.close()
    torch_run, triton_run = runs
    assert [r.token_ids for r in triton_run] == [r.token_ids for r in torch_run]
    for got, want in zip(triton_run, torch_run, strict=True):
        torch.testing.assert_close(
            torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0
        )
