"""A decode step's linear layers on the CPU in bfloat16: the AMX kernel (engine/layers/cpu_gemm.c)
beside oneDNN's GEMM on its packed weights, alternating in the same run.

One pass is every linear of a model shape in layer order (q/k/v, o, gate/up and down per layer,
then the LM head), on that shape's weights (random, so the pass reads them from memory as a
step does), at each row count, the AMX kernel at every count (the engine runs it up to
cpu_gemm.MAX_ROWS); the JSON has each side's median milliseconds per pass, the weights' GB/s
and the ratio oneDNN / AMX. Needs a CPU with AMX-BF16.

    python -m bench.cpu.linear --shape llama-75m --rows 1 8 16 32 64 96 128 256 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.checkpoints import SHAPES
from bench.common import emit, log, machine, set_threads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-75m", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 96, 128, 256])
    p.add_argument("--iters", type=int, default=10, help="passes per side and round")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    return p.parse_args(argv)


def weight_shapes(config: dict[str, Any]) -> list[tuple[int, int]]:
    """[out, in] of every linear of the model, in the order a step runs them."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    per_layer = [
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * inter, hidden),
        (hidden, inter),
    ]
    return per_layer * config["num_hidden_layers"] + [(config["vocab_size"], hidden)]


def measure(
    args: argparse.Namespace, weights: list[Any], max_rows: int, gen: Any
) -> list[dict[str, Any]]:
    """Per row count, the median ms of a pass over every weight through oneDNN and through the
    AMX kernel, the two sides alternating twice; inputs drawn from `gen`."""
    import torch

    import engine.layers.linear as linear_module
    from engine.layers import cpu_gemm

    megabytes = sum(w.numel() for w in weights) * 2 / 1e6
    results = []
    for rows in args.rows:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen) for w in weights}
        inputs = {k: x.bfloat16() for k, x in inputs.items()}
        ms: dict[str, list[float]] = {"onednn": [], "amx": []}
        for side in ("onednn", "amx", "onednn", "amx"):
            cpu_gemm.MAX_ROWS = 1 << 30 if side == "amx" else 0  # each side at every count
            for _ in range(args.iters):
                start = time.perf_counter()
                for w in weights:
                    linear_module.linear(inputs[w.shape[1]], w, None)
                ms[side].append((time.perf_counter() - start) * 1e3)
        cpu_gemm.MAX_ROWS = max_rows
        med = {side: statistics.median(times) for side, times in ms.items()}
        results.append(
            {
                "rows": rows,
                "onednn_ms": med["onednn"],
                "amx_ms": med["amx"],
                "onednn_gb_s": megabytes / med["onednn"],
                "amx_gb_s": megabytes / med["amx"],
                "ratio_onednn_over_amx": med["onednn"] / med["amx"],
                "engine_runs_amx": rows <= max_rows,
            }
        )
        log(f"{rows} rows: oneDNN {med['onednn']:.2f} ms, AMX {med['amx']:.2f} ms")
    return results


def emit_result(record: dict[str, Any]) -> None:
    table = [
        [
            r["rows"],
            f"{r['onednn_ms']:.2f}",
            f"{r['amx_ms']:.2f}",
            f"{r['ratio_onednn_over_amx']:.2f}",
        ]
        for r in record["results"]
    ]
    emit(record, ["rows", "oneDNN ms", "AMX ms", "oneDNN / AMX"], table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    import torch

    from engine.layers import cpu_gemm

    if cpu_gemm._lib() is None:
        raise SystemExit("this CPU (or its kernel build) has no AMX-BF16")
    shapes = weight_shapes(SHAPES[args.shape].config)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen).bfloat16() * 0.02 for shape in shapes]
    max_rows = cpu_gemm.MAX_ROWS
    with torch.inference_mode():
        results = measure(args, weights, max_rows, gen)
    record = {
        "benchmark": "cpu_linear",
        "shape": args.shape,
        "weights_mb": sum(w.numel() for w in weights) * 2 / 1e6,
        "max_rows": max_rows,
        "results": results,
        "machine": machine() | {"torch_threads": threads},
    }
    emit_result(record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
