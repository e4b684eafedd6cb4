"""MergedLinear: one GEMM for q/k/v and one for gate/up, initialised like separate layers."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.attention.torch_ref import TorchRefAttention
from engine.layers.merged_linear import MergedLinear
from engine.models.hf_config import load_model_config
from engine.weights.loading import build_model
from tests.support.tiny_models import make_checkpoint

# float32 inference on the CPU runs oneDNN's linear (engine/layers/linear.py)
GEMMS = ("aten.mm", "aten.addmm", "mkldnn._linear_pointwise")


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def test_a_layer_runs_one_gemm_per_merged_projection(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "qwen2", "qwen2")  # q/k/v bias: addmm, not mm
    cfg = load_model_config(checkpoint)
    attention = TorchRefAttention(scale=cfg.head_dim**-0.5)
    model = build_model(cfg, checkpoint, attention, torch.device("cpu"), torch.float32)
    with torch.no_grad(), OpCounter() as ops:
        model.dense_forward(torch.arange(3, 11).view(1, -1))
    gemms = sum(ops.counts[name] for name in GEMMS)
    assert gemms == 4 * cfg.num_layers + 1  # qkv, o, gate_up, down per layer; the LM head


def test_parts_initialise_as_separate_linear_layers_would() -> None:
    torch.manual_seed(0)
    merged = MergedLinear(16, {"q_proj": 8, "k_proj": 4, "v_proj": 4}, bias=True)
    torch.manual_seed(0)
    separate = {name: torch.nn.Linear(16, size) for name, size in merged.parts.items()}
    tensors = merged.checkpoint_tensors()
    for name, linear in separate.items():
        assert torch.equal(tensors[f"{name}.weight"], linear.weight.detach()), name
        assert torch.equal(tensors[f"{name}.bias"], linear.bias.detach()), name


def test_checkpoint_tensors_are_views_of_the_merged_rows() -> None:
    merged = MergedLinear(4, {"gate_proj": 3, "up_proj": 3}, bias=False)
    merged.checkpoint_tensors()["up_proj.weight"].fill_(7.0)
    assert torch.all(merged.weight[3:] == 7.0) and not torch.any(merged.weight[:3] == 7.0)
