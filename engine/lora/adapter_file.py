"""A PEFT LoRA adapter directory, read and checked against the base model's projections.

The directory is what peft's `save_pretrained` writes: `adapter_config.json` and
`adapter_model.safetensors`, whose tensors are named
`base_model.model.<module>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]). A
projection's output gains `lora_B(lora_A(x)) * scaling`, with peft 0.21's scaling:
`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`. What peft can save but this
engine does not compute (DoRA, LoRA biases, per-module ranks or alphas, modules saved whole,
embedding or LM-head targets) is refused by name, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.protocol.validation.adapter_config import (
    CONFIG_FILE,
    check_config,
    parse_config,
    read_config_bytes,
)

# The projections an adapter may target, by the checkpoint's module names (a model has either
# q/k/v or the fused qkv_proj, gate/up or the fused gate_up_proj: Phi-3).
TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")
TARGETS += ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_ENDINGS = {".lora_A.weight": 0, ".lora_B.weight": 1}


@dataclass(frozen=True)
class AdapterFile:
    """A checked adapter: its rank, its scaling, and each targeted projection's weights by
    the checkpoint's module name (`model.layers.0.self_attn.q_proj`) -> (A [r, in], B [out, r])."""

    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(
    path: str | Path, shapes: Mapping[str, tuple[int, int]], max_rank: int
) -> AdapterFile:
    """Read the adapter at `path`; `shapes` maps every projection it may target to its
    (out, in). Raises ValueError saying what does not fit."""
    path = Path(path)
    rank, scaling = check_config(_read_config(path), max_rank)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ValueError(f"adapter {path}: no {WEIGHTS_FILE}")
    from safetensors import safe_open
    from safetensors.torch import load_file

    # NOTE: counted from the header before any tensor is read: the engine reads an adapter in
    # its loop, and a file of 100,000 tiny tensors would stall every request meanwhile.
    with safe_open(str(weights_path), "pt") as header:
        count, limit = len(header.keys()), 2 * len(shapes)
    if count > limit:
        raise ValueError(
            f"tensor count: {WEIGHTS_FILE} holds {count} tensors, more than the {limit} "
            f"(lora_A and lora_B of each of the model's {len(shapes)} projections) an adapter "
            "of this model can have"
        )
    pairs: dict[str, list[torch.Tensor | None]] = {}
    for key, tensor in load_file(str(weights_path)).items():
        module, which = _module_of(key)
        target = module.rpartition(".")[2]
        if target not in TARGETS:
            raise ValueError(f"target module {target!r}: not supported (only {', '.join(TARGETS)})")
        if module not in shapes:
            raise ValueError(f"target module {module}: the base model has no such module")
        pairs.setdefault(module, [None, None])[which] = tensor
    if not pairs:
        raise ValueError(f"adapter {path}: {WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, (a, b) in pairs.items():
        if a is None or b is None:
            raise ValueError(f"target module {module}: lora_A and lora_B must both be present")
        out, inp = shapes[module]
        if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
            raise ValueError(
                f"target module {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                f"do not fit a rank-{rank} adapter of a [{out}, {inp}] projection "
                f"(expected ({rank}, {inp}) and ({out}, {rank}))"
            )
        weights[module] = (a, b)
    return AdapterFile(rank, scaling, weights)


def _read_config(path: Path) -> dict[str, object]:
    try:
        text = read_config_bytes(path)
    except FileNotFoundError:
        raise ValueError(f"adapter {path}: no {CONFIG_FILE}") from None
    return parse_config(text)


def _module_of(key: str) -> tuple[str, int]:
    """A tensor's module name (without peft's prefix) and 0 for lora_A, 1 for lora_B."""
    for ending, which in _ENDINGS.items():
        if key.startswith(_PREFIX) and key.endswith(ending):
            return key[len(_PREFIX) : -len(ending)], which
    raise ValueError(f"tensor {key}: not a LoRA A or B weight of a projection")
