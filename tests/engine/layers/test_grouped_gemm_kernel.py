"""The experts' grouped-GEMM kernel (engine/layers/grouped_gemm_kernel.py) equals the torch path
of engine/moe/experts.py (one GEMM per expert) in float32: compiled on CUDA, else on the CPU
through Triton's interpreter (float32 only: the interpreter computes bfloat16 dots wrongly).

Shapes are tiny (the interpreter is slow) but cover what the kernel's indexing must: experts
with no pairs, experts with more pairs than one block, a hidden size that is not a multiple of
the K block, a single token, and spare blocks past the last expert's; and a whole MoE engine on the Triton
layer kernels against its torch path.

NOTE: `use_triton` (tests/support/triton_interpreter.py) runs at collection: it chooses the
interpreter before anything imports triton.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.llama_family import QWEN_PARTS
from engine.moe.config import MoeConfig
from engine.moe.experts import StackedExperts, route
from tests.support.tiny_models import make_checkpoint, prompts
from tests.support.triton_interpreter import use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
use_triton(DEVICE)

from engine.layers.grouped_gemm_kernel import (  # noqa: E402 - after the interpreter choice
    BLOCK_M,
    group_blocks,
    grouped_gemm,
)


def moe_config(experts: int, top_k: int) -> MoeConfig:
    return MoeConfig(experts, top_k, 0, True, False, 0, (0,))


def routed(tokens: int, hidden: int, experts: int, top_k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    weights, ids = route(logits, moe_config(experts, top_k))
    return x, weights, ids


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k"),
    [
        (40, 40, 24, 4, 2),  # about 20 pairs an expert: two blocks each; hidden % BLOCK_K != 0
        (3, 32, 16, 8, 2),  # most experts have no pair
        (1, 24, 40, 6, 1),  # one token
    ],
)
def test_grouped_experts_equal_the_per_expert_torch_path(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int
) -> None:
    torch.manual_seed(0)
    stack = StackedExperts(experts, hidden, inter, QWEN_PARTS).to(DEVICE)
    x, weights, ids = routed(tokens, hidden, experts, top_k)
    with torch.no_grad():
        reference = stack(x, weights, ids)
        stack.triton = True
        grouped = stack(x, weights, ids)
    torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("adds_down_bias", [True, False])  # rank 0, other ranks
def test_gpt_oss_experts_biases_and_clamped_swiglu_equal_the_torch_path(
    adds_down_bias: bool,
) -> None:
    """gpt-oss's experts on the grouped GEMMs: each pair's gate/up bias and (on the rank that
    adds it) down bias gathered by its expert, the clamped SwiGLU on the interleaved columns."""
    torch.manual_seed(0)
    stack = StackedExperts(
        6, 40, 24, None, bias=True, swiglu=(1.702, 0.5), adds_down_bias=adds_down_bias
    ).to(DEVICE)
    with torch.no_grad():
        for bias in (stack.gate_up_proj_bias, stack.down_proj_bias):
            assert bias is not None
            bias.normal_()
    x, weights, ids = routed(20, 40, 6, 2)
    with torch.no_grad():
        reference = stack(x, weights, ids)
        stack.triton = True
        grouped = stack(x, weights, ids)
    torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-5)


def test_each_pair_reads_its_own_row_and_its_experts_weight() -> None:
    """The kernel alone: rows gathered through `rows`, every expert's group (one spanning
    several blocks, one empty) against its weight."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([BLOCK_M + 3, 0, 2, 5])
    pairs, k, n = int(counts.sum()), 20, 36
    a = torch.randn(9, k, generator=gen).to(DEVICE)
    rows = torch.randint(0, 9, (pairs,), generator=gen).to(DEVICE)
    weight = torch.randn(4, n, k, generator=gen).to(DEVICE)
    out = grouped_gemm(a, rows, weight, *group_blocks(counts.to(DEVICE)))
    expert = torch.repeat_interleave(torch.arange(4), counts).to(DEVICE)
    want = torch.einsum("pk,pnk->pn", a[rows], weight[expert])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("arch", "overrides"), [("qwen3_moe", {"mlp_only_layers": [1]}), ("gpt_oss", {})]
)
def test_an_moe_engine_on_the_triton_layer_kernels_generates_the_torch_paths_tokens(
    tmp_path: Path, arch: str, overrides: dict[str, object]
) -> None:
    """layer_kernels=triton reaches the stacked experts: the grouped GEMMs (with the norms,
    activation and rotary kernels; gpt-oss's biases and clamped SwiGLU) give the torch path's
    greedy ids and routed experts."""
    checkpoint = make_checkpoint(tmp_path / arch, arch, **overrides)
    batch = prompts(300, count=3)[1:]
    params = SamplingParams(temperature=0.0, max_tokens=4, routed_experts=True)
    runs = []
    for kernels in ("torch", "triton"):
        config = EngineConfig(
            model=str(checkpoint),
            device=DEVICE,
            dtype="float32",
            layer_kernels=kernels,
            warmup=False,  # a full step under the interpreter takes minutes
        )
        engine = LLMEngine(config)
        experts = [m for m in engine.model.modules() if isinstance(m, StackedExperts)]
        assert experts and all(e.triton == (kernels == "triton") for e in experts)
        runs.append([(r.token_ids, r.routed_experts) for r in engine.generate(batch, params)])
        engine.close()
    assert runs[0] == runs[1]
