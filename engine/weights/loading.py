"""Loads Hugging Face safetensors checkpoints (single file or sharded) into the model by name.

Names are the checkpoint's (`CausalLM.checkpoint_tensors`: engine/models/base.py): each tensor is copied into
its part of the model's parameters, a merged projection's rows included.

A tensor-parallel rank reads only its slice of each tensor (safetensors' `get_slice`), so no
rank ever holds the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention.backend import AttentionBackend
from engine.models.base import CausalLM, model_class
from engine.models.hf_config import ModelConfig
from engine.parallel.tensor_parallel import TensorParallel

# Present in some checkpoints, recomputed by us (rotary tables), never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{directory}: no model.safetensors or model.safetensors.index.json "
        "(only safetensors checkpoints are supported)"
    )


def build_model(
    cfg: ModelConfig,
    directory: Path,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel | None = None,
    triton_kernels: bool = False,
) -> CausalLM:
    """Construct the model (this rank's shard) of `cfg.architecture` (the registry's class)
    without initialising it, then fill every parameter from the files. `triton_kernels`: see
    CausalLM."""
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, backend, tp, triton_kernels)
    model = model.to(dtype).to_empty(device=device)
    model.init_buffers(device)  # computed, not loaded (rotary tables)
    load_weights(model, directory)
    # Inference only: no autograd state, and in-place updates (live_weights) just work.
    return model.requires_grad_(False).eval()


def load_weights(model: CausalLM, directory: Path) -> None:
    """Fill every checkpoint tensor of `model` (this rank's slices) from the files."""
    sharding = model.sharding
    params = model.checkpoint_tensors()
    loaded: set[str] = set()
    for path in checkpoint_files(directory):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name not in params:
                    raise ValueError(f"{path.name}: unexpected tensor {name!r} for this model")
                part = f.get_slice(name)
                param = params[name]
                shape = tuple(part.get_shape())
                expected = sharding.full_shape(name, tuple(param.shape))
                if shape != expected:
                    raise ValueError(f"{name}: checkpoint shape {shape} != model shape {expected}")
                with torch.no_grad():
                    param.copy_(sharding.take(name, part))
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {directory} lacks tensors: {', '.join(missing[:8])}")
