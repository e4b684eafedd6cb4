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

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

# The projections an adapter may target, by the checkpoint's module names.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_ENDINGS = {".lora_A.weight": 0, ".lora_B.weight": 1}
# adapter_config.json keys whose non-default values change the arithmetic: refused.
_UNSUPPORTED = ("use_dora", "lora_bias", "fan_in_fan_out", "rank_pattern", "alpha_pattern")


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
    config = _read_config(path)
    rank, scaling = _rank_and_scaling(config, max_rank)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ValueError(f"adapter {path}: no {WEIGHTS_FILE}")
    from safetensors.torch import load_file

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
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"adapter {path}: no {CONFIG_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"adapter {path}: {CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"adapter {path}: {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type: {config['peft_type']!r} is not LORA")
    for key in _UNSUPPORTED:
        if config.get(key):
            raise ValueError(f"{key}: {config[key]!r} is not supported")
    if config.get("modules_to_save"):
        raise ValueError(f"modules_to_save: {config['modules_to_save']!r} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"bias: {config['bias']!r} is not supported (only 'none')")
    return config


def _rank_and_scaling(config: dict[str, object], max_rank: int) -> tuple[int, float]:
    """peft's LoraLayer.update_layer: scaling = alpha / r, or alpha / sqrt(r) (rsLoRA)."""
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)  # peft's LoraConfig defaults
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"r: {r!r} is not a positive integer")
    if r > max_rank:
        raise ValueError(f"r: rank {r} is above max_lora_rank={max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"lora_alpha: {alpha!r} is not a number")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, scaling


def _module_of(key: str) -> tuple[str, int]:
    """A tensor's module name (without peft's prefix) and 0 for lora_A, 1 for lora_B."""
    for ending, which in _ENDINGS.items():
        if key.startswith(_PREFIX) and key.endswith(ending):
            return key[len(_PREFIX) : -len(ending)], which
    raise ValueError(f"tensor {key}: not a LoRA A or B weight of a projection")
