"""Loads Hugging Face safetensors checkpoints (single file or sharded, plain or quantized) into
the model by name.

Names are the checkpoint's (`CausalLM.checkpoint_tensors`: engine/models/base.py): each tensor is copied into
its part of the model's parameters, a merged projection's rows included.

A tensor-parallel rank reads only its slice of each tensor (safetensors' `get_slice`), so no
rank ever holds the whole model; of a quantized tensor it reads the whole (one byte, or half
of one, per value), dequantizes it and keeps its slice, one tensor at a time. FP8 checkpoints
are dequantized at load on the CPU; when the layers run Triton (CUDA), their projections stay
in FP8 with their scales and run the FP8 kernel (fp8_layers.py says which; docs/architecture.md
why).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.attention.backend import AttentionBackend
from engine.models.base import CausalLM, model_class
from engine.models.hf_config import ModelConfig
from engine.parallel.tensor_parallel import TensorParallel
from engine.weights.checkpoint_reader import CheckpointReader
from engine.weights.in_format import in_format, keep_in_format


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
    model = model.to(dtype)
    if triton_kernels:  # NOTE: after the dtype cast, which would widen the e4m3 weights
        with CheckpointReader(Path(directory)) as reader:
            keep_in_format(model, reader, dtype)
    model = model.to_empty(device=device)
    model.init_buffers(device)  # computed, not loaded (rotary tables)
    load_weights(model, directory)
    # Inference only: no autograd state, and in-place updates (live_weights) just work.
    return model.requires_grad_(False).eval()


def load_weights(model: CausalLM, directory: Path) -> None:
    """Fill every checkpoint tensor of `model` (this rank's slices) from the files; a quantized
    checkpoint's tensors dequantized into the model's dtype (checkpoint_reader.py), or copied
    with their scales into an in-format projection (fp8_layers.py)."""
    sharding = model.sharding
    params = model.checkpoint_tensors()
    slots = in_format(model).slots
    loaded: set[str] = set()
    with CheckpointReader(Path(directory)) as reader:
        for name in reader.names():
            if name not in params:
                raise ValueError(f"{reader.file(name)}: unexpected tensor {name!r} for this model")
            param = params[name]
            shape = reader.shape(name)
            expected = sharding.full_shape(name, tuple(param.shape))
            if shape != expected:
                raise ValueError(f"{name}: checkpoint shape {shape} != model shape {expected}")
            with torch.no_grad():
                slot = slots.get(name)
                if slot is None:
                    param.copy_(reader.read(name, sharding, param.dtype))
                else:
                    slot.write(slot.share(*reader.read_parts(name), sharding.split(name)))
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {directory} lacks tensors: {', '.join(missing[:8])}")
