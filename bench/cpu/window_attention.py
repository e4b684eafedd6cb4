"""Decode attention on the CPU for a sliding-window layer beside a full-attention one: the C kernel
(engine/attention/cpu_attention.c) over the same long contexts, the two sides alternating.

A row of a sliding layer reads only its last `window` keys, so at a context of 4,096 and a
window of 128 it reads 32x fewer K and V bytes than a full layer. One pass is `--layers` decode
calls, each on its own layer's cache (a step reads every layer's pages once, so a pass reads
layers x rows x context tokens for a full layer); the JSON has each side's median
milliseconds per pass, the K/V bytes it read and their GB/s, and the ratio full / window.

    python -m bench.cpu.window_attention --context 4096 --window 128 --rows 8 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.common import emit, log, machine, set_threads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=4096, help="context length of every row")
    p.add_argument("--window", type=int, default=128, help="the sliding layer's window")
    p.add_argument("--rows", type=int, default=8, help="decode rows (sequences) per call")
    p.add_argument("--layers", type=int, default=4, help="layers per pass, each its own cache")
    # gpt-oss-20b's attention: 64 query heads over 8 KV heads of 64
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--sinks", action="store_true", help="give both sides gpt-oss's sinks")
    p.add_argument("--iters", type=int, default=10, help="passes per side and round")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    return p.parse_args(argv)


def make_layers(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each layer's K and V pool with every row's pages scattered through it, and the tables."""
    import torch

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    pages_per_row = -(-args.context // args.page_size)
    num_pages = args.rows * pages_per_row
    shape = (num_pages, args.page_size, args.kv_heads, args.head_dim)
    layers = []
    for _ in range(args.layers):
        order = torch.randperm(num_pages, generator=gen).to(torch.int32)
        layers.append(
            {
                "k": torch.randn(shape, generator=gen).to(dtype),
                "v": torch.randn(shape, generator=gen).to(dtype),
                "tables": order.view(args.rows, pages_per_row).contiguous(),
                "q": torch.randn(args.rows, args.heads, args.head_dim, generator=gen).to(dtype),
            }
        )
    return layers


def measure(args: argparse.Namespace, layers: list[dict[str, Any]]) -> dict[str, Any]:
    """Median ms per pass of each side, the sides alternating twice."""
    import torch

    from engine.attention import cpu_kernels

    lib = cpu_kernels.load()
    if lib is None:
        raise SystemExit("the CPU attention kernel did not build (is a C compiler installed?)")
    lens = torch.full((args.rows,), args.context, dtype=torch.int32)
    sinks = torch.randn(args.heads) if args.sinks else None
    scale = args.head_dim**-0.5
    windows = {"full": None, "window": args.window}
    ms: dict[str, list[float]] = {side: [] for side in windows}
    for side in ("full", "window", "full", "window"):
        for _ in range(args.iters):
            start = time.perf_counter()
            for layer in layers:
                cpu_kernels.decode_attention(
                    lib, layer["q"], layer["k"], layer["v"], layer["tables"], lens, scale,
                    windows[side], None, sinks,
                )  # fmt: skip
            ms[side].append((time.perf_counter() - start) * 1e3)
    esize = torch.finfo(getattr(torch, args.dtype)).bits // 8
    token_bytes = 2 * args.kv_heads * args.head_dim * esize  # K and V
    results: dict[str, Any] = {}
    for side, window in windows.items():
        keys = min(args.context, window or args.context)
        megabytes = args.layers * args.rows * keys * token_bytes / 1e6
        med = statistics.median(ms[side])
        results[side] = {"ms": med, "kv_mb_read": megabytes, "gb_s": megabytes / med}
        log(f"{side}: {med:.3f} ms per pass, {megabytes:.1f} MB of K/V, {megabytes / med:.1f} GB/s")
    results["ratio_full_over_window"] = results["full"]["ms"] / results["window"]["ms"]
    results["bytes_ratio"] = results["full"]["kv_mb_read"] / results["window"]["kv_mb_read"]
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    import torch

    with torch.inference_mode():
        results = measure(args, make_layers(args))
    record = {
        "benchmark": "cpu_window_attention",
        "config": {k: v for k, v in vars(args).items() if k not in ("iters", "threads")},
        "results": results,
        "machine": machine() | {"torch_threads": threads},
    }
    rows = [
        [side, f"{results[side]['ms']:.3f}", results[side]["kv_mb_read"], results[side]["gb_s"]]
        for side in ("full", "window")
    ]
    emit(record, ["side", "ms per pass", "K/V MB read", "GB/s"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
