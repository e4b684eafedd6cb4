"""Decode steps of MoE models in CUDA graphs: captured on CUDA, else the graph runner's padded,
capture-safe step run eagerly on the CPU with the Triton layer kernels under the interpreter.

Padded decode batches (padding rows route too, to whatever experts their token 0 picks) give
the eager engine's tokens, logprobs and routed experts, and steps whose requests ask for their
routed experts replay graphs as well. The captured forward must read nothing on the host: on
the CPU a dispatch mode checks that it runs no operator whose result or output shape depends on
tensor data (those that synchronize on CUDA), and that the same check catches the torch MoE
path's host-read expert counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.execution.cuda_graph import GraphOutput
from engine.moe.experts import StackedExperts
from tests.support.tiny_models import make_checkpoint, prompts
from tests.support.triton_interpreter import use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
use_triton(DEVICE)

MAX_SEQS = 8  # buckets 1, 2, 4, 8: few graphs to capture (or compile under the interpreter)
SYNCING_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", mlp_only_layers=[1])


def make_engine(checkpoint: Path, graphs: bool, **overrides: object) -> LLMEngine:
    """An MoE engine on the Triton layer kernels. `graphs`: decode steps through the graph
    runner (captured on CUDA; on the CPU attached uncaptured); else every step eager."""
    config = {
        "model": str(checkpoint),
        "device": DEVICE,
        "dtype": "float32",
        "layer_kernels": "triton",
        "max_num_seqs": MAX_SEQS,
        "num_kv_pages": 256,
        "enforce_eager": not graphs,
        "warmup": False,  # a full step under the interpreter takes minutes
        **overrides,
    }
    engine = LLMEngine(EngineConfig(**config))  # type: ignore[arg-type]
    if graphs and DEVICE == "cpu":
        engine.runner.attach_graphs(capture=False)
    if graphs:
        assert engine.runner.graphs is not None
    return engine


def count_graph_steps(engine: LLMEngine) -> list[int]:
    """A list that grows by each decode step's batch size as it runs through the graph runner."""
    graphs = engine.runner.graphs
    assert graphs is not None
    sizes: list[int] = []

    def counted(*args: Any, run: Any = graphs.run) -> GraphOutput:
        sizes.append(args[2])
        return run(*args)

    graphs.run = counted  # type: ignore[method-assign]
    return sizes


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="captures CUDA graphs")
def test_an_moe_model_is_captured_with_its_grouped_experts(qwen3_moe: Path) -> None:
    engine = make_engine(qwen3_moe, graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.records_routing
    assert sorted(graphs.graphs) == graphs.batch_sizes == [1, 2, 4, 8]
    torch_experts = make_engine(qwen3_moe, graphs=False, layer_kernels="torch", enforce_eager=False)
    assert torch_experts.runner.graphs is None  # its expert counts are read on the host


@pytest.mark.parametrize("routed", [False, True], ids=["plain", "routed_experts"])
def test_padded_graph_steps_give_the_eager_steps_tokens_and_routing(
    qwen3_moe: Path, routed: bool
) -> None:
    # 5 requests finishing at different steps: decode batches of 5..1 at buckets 8, 4, 2, 1;
    # with routed_experts, only every other request asks for them.
    batch = prompts(300, count=6)[1:]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=3 + 2 * k,
            ignore_eos=True,
            logprobs=True,
            routed_experts=routed and k % 2 == 0,
        )
        for k in range(len(batch))
    ]
    want = make_engine(qwen3_moe, graphs=False).generate(batch, params)
    engine = make_engine(qwen3_moe, graphs=True)
    sizes = count_graph_steps(engine)
    got = engine.generate(batch, params)
    assert {5, 4, 3, 2, 1} <= set(sizes)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.routed_experts for r in got] == [r.routed_experts for r in want]
    if routed:
        assert got[0].routed_experts and got[1].routed_experts is None
    for g, w in zip(got, want, strict=True):
        assert g.logprobs is not None and w.logprobs is not None
        torch.testing.assert_close(
            torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4
        )


class HostReads(TorchDispatchMode):
    """Records the operators whose result or output shape depends on tensor data: on CUDA each
    reads the device on the host, which a graph capture refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(tag in func.tags for tag in SYNCING_TAGS) and not gathers(func, args):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def gathers(func: Any, args: Any) -> bool:
    """Indexing by integer tensors: its output shape is the indices', not their values'
    (aten.index is tagged for the boolean masks it also takes)."""
    if func is not torch.ops.aten.index.Tensor:
        return False
    return all(i is None or not (i.dtype == torch.bool or i.dtype == torch.uint8) for i in args[1])


def host_reads(engine: LLMEngine, size: int) -> list[str]:
    """The data-dependent operators of the graph runner's forward at batch `size`."""
    graphs = engine.runner.graphs
    assert graphs is not None
    with torch.inference_mode(), HostReads() as mode:
        logits, routed = graphs.forward(size)
    assert logits.shape[0] == size and routed is not None and routed.shape[0] == size
    return mode.ops


def test_the_captured_forward_reads_nothing_on_the_host(qwen3_moe: Path) -> None:
    # The whole forward as CUDA captures it: Triton attention, norms and grouped experts.
    engine = make_engine(qwen3_moe, graphs=True, attention_backend="triton")
    assert host_reads(engine, 4) == []
    for module in engine.model.modules():  # the torch experts' path: caught by the same check
        if isinstance(module, StackedExperts):
            module.triton = False
    assert "aten.bincount.default" in host_reads(engine, 4)
