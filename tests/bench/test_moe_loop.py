"""bench/throughput/moe_loop.py's per-expert loop (bench.throughput.offline --moe-loop) computes what the engine's
grouped experts compute, and only inside its `with`; the MoE bench shapes are the architectures
the engine serves; bench/run_gpu.sh (with its MoE steps) parses."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from bench.checkpoints import SHAPES
from bench.throughput.moe_loop import per_expert_loop
from engine.models.llama_family import QWEN_PARTS
from engine.moe.config import MoeConfig
from engine.moe.experts import StackedExperts, route

REPO = Path(__file__).resolve().parents[2]


def test_the_per_expert_loop_equals_the_grouped_experts() -> None:
    torch.manual_seed(0)
    experts = StackedExperts(8, 32, 24, QWEN_PARTS)
    x, logits = torch.randn(11, 32), torch.randn(11, 8)
    weights, ids = route(logits, MoeConfig(8, 2, 24, True, False, 0, (0,)))
    with torch.no_grad():
        grouped = experts(x, weights, ids)
        with per_expert_loop():
            looped = experts(x, weights, ids)
        after = experts(x, weights, ids)
    torch.testing.assert_close(looped, grouped, rtol=1e-5, atol=1e-6)
    assert torch.equal(after, grouped)  # the engine's forward is back


def test_the_moe_bench_shapes_are_qwen3_moe_with_top_k_of_their_experts() -> None:
    for name in ("small-moe", "qwen3-30b-a3b-4l"):
        shape = SHAPES[name]
        assert shape.arch == "qwen3_moe"
        assert 1 < shape.config["num_experts_per_tok"] < shape.config["num_experts"]


def test_the_gpu_suite_script_parses() -> None:
    subprocess.run(["bash", "-n", str(REPO / "bench" / "run_gpu.sh")], check=True)
