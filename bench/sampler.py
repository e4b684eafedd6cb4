"""The sampler alone on random logits: the fused Triton kernel against the torch sampler.

Per batch size and setting (greedy; RL: temperature 1, top-p 0.9, top-k 50, logprobs with
top-5, repetition penalty 1.1 over a 1,024-token context), the median time of one sampler
call, and whether both picked the same tokens (they must: tests/engine/test_fused_sampler.py).

    python -m bench.sampler --device cuda --batches 64 256 --vocab 128256
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.common import emit, log, machine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--vocab", type=int, default=128256, help="Llama 3's by default")
    p.add_argument("--context", type=int, default=1024, help="tokens seen by the penalty")
    p.add_argument("--iters", type=int, default=20)
    return p.parse_args(argv)


def make_batch(rows: int, vocab: int, context: int, rl: bool, device: str) -> Any:
    import torch

    from engine.sampler import SamplingBatch

    g = torch.Generator().manual_seed(rows)
    floats = torch.tensor([1.0 if rl else 0.0, 0.9, 0.0, 1.1 if rl else 1.0, 0.0, 0.0])
    ints = torch.zeros(rows, 5, dtype=torch.int64)
    ints[:, 0] = torch.arange(rows) * 7919 + 1
    ints[:, 2] = 17
    ints[:, 3] = 50
    ints[:, 4] = context // 2
    batch = SamplingBatch(floats.repeat(rows, 1).to(device), ints.to(device), all_greedy=not rl)
    if rl:
        batch.use_top_k = batch.use_top_p = batch.use_penalties = batch.logprobs = True
        batch.num_top_logprobs = 5
        batch.context_ids = torch.randint(vocab, (rows, context), generator=g).to(device)
    return batch


def measure(sampler: Any, logits: Any, batch: Any, iters: int, sync: Any) -> tuple[float, Any]:
    out = sampler(logits, batch)  # warm-up (compiles the kernel)
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        out = sampler(logits, batch)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from engine.sampler import Sampler
    from engine.sampler_choice import make_sampler

    device = torch.device(args.device)
    fused = make_sampler("triton", device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    results, rows = [], []
    for batch_size in args.batches:
        logits = torch.randn(batch_size, args.vocab, device=device) * 4
        for setting in ("greedy", "rl"):
            batch = make_batch(batch_size, args.vocab, args.context, setting == "rl", args.device)
            torch_ms, expected = measure(Sampler(), logits, batch, args.iters, sync)
            fused_ms, got = measure(fused, logits, batch, args.iters, sync)
            same = torch.equal(got.unpack()[0], expected.unpack()[0])
            r = {"batch": batch_size, "setting": setting, "torch_ms": torch_ms}
            r |= {"fused_ms": fused_ms, "same_tokens": same}
            results.append(r)
            rows.append([batch_size, setting, torch_ms, fused_ms, torch_ms / fused_ms, same])
            log(f"batch {batch_size} {setting}: torch {torch_ms:.3f} ms, fused {fused_ms:.3f} ms")
    result = {
        "benchmark": "sampler",
        "device": args.device,
        "vocab": args.vocab,
        "context": args.context,
        "results": results,
        "machine": machine(),
    }
    emit(result, ["batch", "setting", "torch ms", "fused ms", "speed-up", "same tokens"], rows)
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
