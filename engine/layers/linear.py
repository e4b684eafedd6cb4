"""`linear`: F.linear, except for inference on the CPU, which runs oneDNN's GEMM on packed weights
(and, for bfloat16 decode steps on CPUs with AMX, cpu_gemm.py's kernel).

On the CPU, F.linear in float32 calls MKL's sgemm; oneDNN's linear (`mkldnn._linear_pointwise`,
the op Inductor's CPU freezing emits) is 1.1-2.1x faster at the Llama projection shapes
(largest on the LM head, [32000, 768] at 16 rows). It runs faster still on a weight reordered
once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`): 10-25% on the decode
shapes in float32; in bfloat16, where F.linear already runs oneDNN on the plain layout, the
offline llama-75m run gained 22-25%. Small weights (`ONEDNN_MIN_WEIGHT`) keep F.linear,
whose call costs less. The packed copy is a cache kept on the weight tensor, so weights cost
twice their memory on the CPU; it is rebuilt when the weight's version counter moves (any
in-place write, also through a view: weight updates write that way). oneDNN sums in another
order than MKL: results differ in the last bits, and the float32 HF equivalence test (greedy
tokens) checks they still choose the same tokens. The op has no backward, so with autograd
recording (training) F.linear runs.

oneDNN runs bfloat16 natively only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on
others (AVX2) it refuses to pack a bfloat16 weight, and F.linear in bfloat16 crawls (17 GFLOP/s
against float32's 120-150 at the llama-75m shapes on a 2-core AVX2 VM). There the packed copy
is the weight widened to float32 (exact), the input is widened, and the float32 result is
rounded to bfloat16 once: what a bfloat16 GEMM with float32 accumulation computes, at float32
speed, for a float32 copy twice the bfloat16 weight's size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers import cpu_gemm

_ONEDNN = torch.backends.mkldnn.is_available()
# Whether oneDNN computes in bfloat16 on this CPU; else bfloat16 linears run in float32.
NATIVE_BF16 = _ONEDNN and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
# oneDNN's call costs 25-70 us before any arithmetic, F.linear's about 9: below this many
# weight elements F.linear wins at every row count (1.1-6x on the `tiny` shapes, [128..512,
# 128]); from llama-75m's smallest projection ([768, 768]) up oneDNN wins at most row counts.
ONEDNN_MIN_WEIGHT = 1 << 18


def _cpu_weight(weight: torch.Tensor, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype` and `layout`: "plain", "onednn" (oneDNN's blocked layout, chosen
    for 64 rows; any row count runs on it) or "amx" (cpu_gemm.pack). Cached on the weight, one
    copy per layout a call has asked for, until its version counter moves."""
    copies: tuple[int, dict[str, torch.Tensor]] | None = getattr(weight, "_cpu_copy", None)
    if copies is None or copies[0] != weight._version:
        copies = (weight._version, {})
        weight._cpu_copy = copies  # type: ignore[attr-defined]
    if layout not in copies[1]:
        copy = weight.to(dtype)
        if layout == "onednn":
            copy = torch.ops.mkldnn._reorder_linear_weight(copy, 64)
        elif layout == "amx":
            copy = cpu_gemm.pack(copy)
        copies[1][layout] = copy
    return copies[1][layout]


def prepack(weight: torch.Tensor) -> None:
    """Make now the CPU copies of `weight` that `linear` would make at its first call needing
    each (oneDNN's, and cpu_gemm's where AMX runs the dtype), so that their cost (seconds for a
    large model in float32) is paid at load, not by the first requests. Nothing off the CPU,
    nor for weights that `linear` leaves to F.linear."""
    if not (_ONEDNN and weight.device.type == "cpu" and weight.numel() >= ONEDNN_MIN_WEIGHT):
        return
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return
    with torch.no_grad():
        if cpu_gemm.runs(weight.dtype):
            _cpu_weight(weight, "amx", weight.dtype)
        widen = weight.dtype == torch.bfloat16 and not NATIVE_BF16
        _cpu_weight(weight, "onednn", torch.float32 if widen else weight.dtype)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_float32: bool = False
) -> torch.Tensor:
    """F.linear(x, weight, bias); `out_float32`: as float32 (its values rounded to x's dtype, as
    `.float()` of the result gives them: the logits), which the AMX path writes directly."""
    out = _linear(x, weight, bias, out_float32)
    return out.float() if out_float32 else out


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_float32: bool
) -> torch.Tensor:
    cpu_inference = x.device.type == "cpu" and not torch.is_grad_enabled()
    if not (_ONEDNN and cpu_inference and x.dtype in (torch.float32, torch.bfloat16)):
        return F.linear(x, weight, bias)
    packed = weight.numel() >= ONEDNN_MIN_WEIGHT
    if packed and cpu_gemm.usable(x, weight, bias):
        w = _cpu_weight(weight, "amx", x.dtype)
        return cpu_gemm.linear(x, w, weight.shape[0], bias, out_float32)
    widen = x.dtype == torch.bfloat16 and not NATIVE_BF16  # see the module's docstring
    if not packed and not widen:
        return F.linear(x, weight, bias)
    if widen:
        x, bias = x.float(), None if bias is None else bias.float()
    w = _cpu_weight(weight, "onednn" if packed else "plain", x.dtype)
    if packed:
        out = torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    else:
        out = F.linear(x, w, bias)
    return out.to(torch.bfloat16) if widen else out
