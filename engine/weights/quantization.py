"""Quantization: a checkpoint's `quantization_config`, what Sluice can compute of it, and which
of its tensors make up one model tensor, keyed on their names.

Three formats load (engine/weights/dequantize.py has their arithmetic):
- `quant_method: fp8` with `weight_block_size` (Qwen3-FP8, DeepSeek-V3): `X.weight` (e4m3)
  and `X.weight_scale_inv` are the model's `X.weight`;
- `quant_method: compressed-tensors`, FP8 weights with per-channel (or per-tensor) static
  scales, activations dynamic or not quantized: `X.weight` and `X.weight_scale`;
- `quant_method: mxfp4` (gpt-oss's experts): `X_blocks` and `X_scales` are the model's `X`, in
  transformers' layout ([experts, in, out]).
Tensors without their companions (the modules a config leaves out: `modules_to_not_convert`,
`ignore`) load as they are. Anything else in a config is refused by name, before any tensor is
read: activations quantized with static scales (their numbers are not what a dequantized
weight computes), zero points, other bit widths and strategies, sparsity, KV-cache schemes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine.models.hf_config import UnsupportedModelError
from engine.weights import dequantize

METHODS = ("fp8", "compressed-tensors", "mxfp4")
CT_FORMATS = ("float-quantized", "naive-quantized")
FP8_DTYPES = ("F8_E4M3",)  # safetensors' name of float8_e4m3fn
# What a quantized tensor's data may be stored as (in-process tensors: torch's names).
DATA_DTYPES = {
    "fp8": ("F8_E4M3", "F8_E5M2"),
    "compressed-tensors": ("F8_E4M3",),
    "mxfp4": ("U8",),
}
TORCH_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.uint8: "U8"}
# Per format: the companion tensor's suffix -> the suffix of the tensor it scales.
COMPANIONS = {
    "fp8": {".weight_scale_inv": ".weight"},
    "compressed-tensors": {".weight_scale": ".weight"},
    "mxfp4": {"_scales": "_blocks"},
}
# Tensors of a quantized checkpoint that Sluice would have to compute with to honour them.
REFUSED_SUFFIXES = {
    "fp8": (".activation_scale", ".input_scale"),
    "compressed-tensors": (".input_scale", ".output_scale", ".weight_zero_point", "_g_idx"),
    "mxfp4": (),
}


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization, as far as loading needs it."""

    method: str
    block: tuple[int, int] = (128, 128)  # fp8's [block_n, block_k]

    def group(self, dtypes: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
        """The model tensors in a checkpoint whose tensors have `dtypes` (name -> safetensors
        dtype): each model name -> the checkpoint names it is read from (a plain tensor: its
        own; a quantized one: its data, then its scales). ValueError names a tensor the format
        does not allow or a part without its companion."""
        companions = COMPANIONS[self.method]
        groups: dict[str, tuple[str, ...]] = {}
        paired: set[str] = set()
        for name in dtypes:
            if name.endswith(REFUSED_SUFFIXES[self.method]):
                raise ValueError(
                    f"{name}: static activation scales and zero points are not supported"
                )
            for suffix, data_suffix in companions.items():
                if name.endswith(suffix):
                    data = name.removesuffix(suffix) + data_suffix
                    if data not in dtypes:
                        raise ValueError(f"{name} has no {data} to scale")
                    if dtypes[data] not in DATA_DTYPES[self.method]:
                        raise ValueError(f"{data}: dtype {dtypes[data]} is not {self.method} data")
                    groups[self._target(data)] = (data, name)
                    paired.add(data)
                    break
        for name, dtype in dtypes.items():
            if name in paired or any(name.endswith(s) for s in companions):
                continue
            if dtype in FP8_DTYPES or name.endswith("_blocks"):
                raise ValueError(f"{name}: quantized data without its scales")
            groups[name] = (name,)
        return groups

    def shape(self, data_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The model tensor's shape from its data's."""
        if self.method == "mxfp4":  # [experts, out, groups, 16] -> [experts, in, out]
            experts, out, groups, width = data_shape
            return (experts, groups * width * 2, out)
        return data_shape

    def combine(self, data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The model tensor, whole, in `dtype`."""
        if self.method == "fp8":
            return dequantize.fp8_block(data, scales, self.block, dtype)
        if self.method == "compressed-tensors":
            return dequantize.fp8_channel(data, scales, dtype)
        return dequantize.mxfp4(data, scales, dtype)

    def _target(self, data: str) -> str:
        return data.removesuffix("_blocks") if self.method == "mxfp4" else data


def dequantize_update(
    tensors: Mapping[str, torch.Tensor],
    quantization: Quantization | None,
    dtype: torch.dtype,
    keep: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """An in-process update's tensors by the model's names: a quantized tensor given with its
    scales (named as the served checkpoint names them) dequantized into the served `dtype`,
    unless the model holds it in format (`keep`: its data and scales pass as given), any
    other as given (its name, shape and dtype are checked after, as any update's).
    ValueError names what cannot be read."""
    if quantization is None:
        return dict(tensors)
    kinds = {n: TORCH_DTYPES.get(t.dtype, str(t.dtype)) for n, t in tensors.items()}
    update: dict[str, torch.Tensor] = {}
    for name, parts in quantization.group(kinds).items():
        if len(parts) == 1 or name in keep:
            update |= {part: tensors[part] for part in parts}
            continue
        data, scales = (tensors[p].detach().cpu() for p in parts)
        update[name] = quantization.combine(data, scales, dtype)
    return update


def read_quantization(config: Mapping[str, Any]) -> Quantization | None:
    """config.json's `quantization_config` (None: none); UnsupportedModelError names the key
    Sluice cannot honour."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in METHODS:
        raise UnsupportedModelError(
            f"quantization_config.quant_method {method!r} is not supported; supported: {METHODS}"
        )
    if method == "fp8":
        return _fp8(q)
    if method == "compressed-tensors":
        _check_compressed_tensors(q)
    return Quantization(method)


def _fp8(q: Mapping[str, Any]) -> Quantization:
    scheme = str(q.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise UnsupportedModelError(
            f"quantization_config.activation_scheme {scheme!r} is not supported (only 'dynamic': "
            "static activation scales are not computed)"
        )
    block = q.get("weight_block_size", [128, 128])  # transformers' default when absent
    if not (isinstance(block, list | tuple) and len(block) == 2 and min(block) > 0):
        raise UnsupportedModelError(
            f"quantization_config.weight_block_size {block!r} is not supported (two block sizes, "
            "e.g. [128, 128]; per-tensor scales are not)"
        )
    if q.get("expert_dtype", "fp8") != "fp8":
        raise UnsupportedModelError(
            f"quantization_config.expert_dtype {q['expert_dtype']!r} is not supported (only 'fp8')"
        )
    if q.get("scale_fmt", "float") not in ("float", "ue8m0"):
        raise UnsupportedModelError(
            f"quantization_config.scale_fmt {q['scale_fmt']!r} is not supported"
        )
    return Quantization("fp8", (int(block[0]), int(block[1])))


def _check_compressed_tensors(q: Mapping[str, Any]) -> None:
    """FP8 weights with static per-channel or per-tensor scales, symmetric; activations
    dynamic or none; nothing else."""
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if q.get(key):
            raise UnsupportedModelError(f"quantization_config.{key} is not supported")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":  # "frozen" or earlier: the weights are not stored as FP8
        raise UnsupportedModelError(
            f"quantization_config.quantization_status {status!r} is not supported (only "
            "'compressed')"
        )
    groups = q.get("config_groups") or {}
    if not groups:
        raise UnsupportedModelError("quantization_config.config_groups is empty")
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        fmt = group.get("format") or q.get("format")
        if fmt not in CT_FORMATS:
            raise UnsupportedModelError(
                f"{where}.format {fmt!r} is not supported; supported: {CT_FORMATS}"
            )
        w = group.get("weights") or {}
        if not (w.get("type") == "float" and w.get("num_bits") == 8):
            raise UnsupportedModelError(
                f"{where}.weights: {w.get('type')!r} {w.get('num_bits')}-bit is not supported "
                "(only FP8: type 'float', num_bits 8)"
            )
        if w.get("strategy") not in ("channel", "tensor"):
            raise UnsupportedModelError(
                f"{where}.weights.strategy {w.get('strategy')!r} is not supported "
                "(only 'channel' or 'tensor')"
            )
        if not w.get("symmetric", True) or w.get("dynamic"):
            raise UnsupportedModelError(
                f"{where}.weights: only static symmetric weight scales are supported"
            )
        act = group.get("input_activations")
        if act is not None and not act.get("dynamic"):
            raise UnsupportedModelError(
                f"{where}.input_activations: static activation scales are not supported "
                "(dynamic or none)"
            )
        if group.get("output_activations") is not None:
            raise UnsupportedModelError(f"{where}.output_activations is not supported")
