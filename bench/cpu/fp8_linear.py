"""Would keeping an FP8 checkpoint's weights packed pay on the CPU? A decode step's linear
layers in bfloat16 on weights dequantized at load (what Sluice serves), beside the work any
kernel that keeps them in FP8 must add: widening every e4m3 weight to bfloat16 with its block
scale on every pass (no CPU Sluice runs on multiplies FP8 natively: AMX and AVX-512 take
bfloat16 and int8).

One pass is every linear of a model shape in layer order (bench/cpu/linear.py's list), on
random weights quantized to block-128 e4m3. Per row count, the JSON has the median ms of a
pass through the served path (engine/layers/linear.py on the dequantized weights, packed as
at load), of the widening alone (engine/weights/dequantize.py's fp8_block into bfloat16; the
bare cast `to(bfloat16)` beside it, the cheapest torch offers), and of widen-then-GEMM; the
sides alternate twice in one run.

    python -m bench.cpu.fp8_linear --shape llama-75m --rows 1 16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.checkpoints import SHAPES
from bench.common import emit, log, machine, set_threads
from bench.cpu.linear import weight_shapes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-75m", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--iters", type=int, default=5, help="passes per side per alternation")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def quantize(weight: Any) -> tuple[Any, Any]:
    """Block-128 e4m3 and its float32 scale_inv (amax / 448 per block), partial blocks kept."""
    import torch
    import torch.nn.functional as F

    rows, cols = weight.shape
    pad = F.pad(weight.float(), (0, -cols % 128, 0, -rows % 128))
    blocks = pad.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))  # [R, 128, C, 128]
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def timed(passes: int, run: Callable[[], None]) -> list[float]:
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def passes(
    inputs: dict[int, Any], served: list[Any], fp8: list[tuple[Any, Any]]
) -> dict[str, Callable[[], None]]:
    """Each side's pass over every weight: the served GEMMs, the widening with block scales,
    the bare cast, and widen-then-GEMM."""
    import torch
    import torch.nn.functional as F

    from engine.layers.linear import linear
    from engine.weights.dequantize import fp8_block

    def served_pass() -> None:
        for w in served:
            linear(inputs[w.shape[1]], w, None)

    def widen() -> None:
        for w, s in fp8:
            fp8_block(w, s, (128, 128), torch.bfloat16)

    def cast() -> None:
        for w, _ in fp8:
            w.to(torch.bfloat16)

    def widen_gemm() -> None:
        for w, s in fp8:
            F.linear(inputs[w.shape[1]], fp8_block(w, s, (128, 128), torch.bfloat16))

    return {"served": served_pass, "widen": widen, "cast": cast, "widen_gemm": widen_gemm}


def measure(args: argparse.Namespace, gen: Any) -> list[dict[str, Any]]:
    import torch

    from engine.layers.linear import prepack
    from engine.weights.dequantize import fp8_block

    shapes = weight_shapes(SHAPES[args.shape].config)
    fp8 = [quantize(torch.randn(shape, generator=gen) * 0.02) for shape in shapes]
    served = [fp8_block(w, s, (128, 128), torch.bfloat16) for w, s in fp8]
    for w in served:
        prepack(w)
    results = []
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k in shapes}
        sides = passes(inputs, served, fp8)
        ms: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(2):
            for side, run in sides.items():
                ms[side] += timed(args.iters, run)
        med = {side: statistics.median(t) for side, t in ms.items()}
        results.append({"rows": rows} | {f"{side}_ms": v for side, v in med.items()})
        log(f"{rows} rows: " + ", ".join(f"{side} {v:.2f} ms" for side, v in med.items()))
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    import torch

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # NOTE: not inference_mode: packed copies track the version counter
        results = measure(args, gen)
    shapes = weight_shapes(SHAPES[args.shape].config)
    record = {
        "benchmark": "cpu_fp8_linear",
        "shape": args.shape,
        "weights_mb_bf16": sum(n * k for n, k in shapes) * 2 / 1e6,
        "weights_mb_fp8": sum(n * k for n, k in shapes) / 1e6,
        "results": results,
        "machine": machine() | {"torch_threads": threads},
    }
    table = [
        [r["rows"], *(f"{r[k]:.2f}" for k in ("served_ms", "widen_ms", "cast_ms", "widen_gemm_ms"))]
        for r in results
    ]
    emit(record, ["rows", "served ms", "widen ms", "cast ms", "widen+GEMM ms"], table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
