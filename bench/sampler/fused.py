"""The sampler alone on random logits: the fused Triton kernel against the torch sampler.

Per batch size and setting (greedy; RL: temperature 1, top-p 0.9, top-k 50, logprobs with
top-5, repetition penalty 1.1 over a 1,024-token context), the median time of one sampler
call, the fused sampler's kernel launches per call and programs per row, and whether both
picked the same tokens (they must: tests/engine/sampling/test_fused_sampler.py).

    python -m bench.sampler.fused --device cuda --batches 1 64 256 --vocab 128256 --dtype bfloat16

`--variants` also times the fused kernel on the RL setting with one option left out at a time,
and with other block / num_warps / programs choices: where its time goes, and what tuning
would buy. `--dtype` is the logits' (the model's dtype; the samplers compute in float32).
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
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--variants", action="store_true", help="the fused RL step, taken apart")
    return p.parse_args(argv)


def make_batch(rows: int, vocab: int, context: int, rl: bool, device: str) -> Any:
    import torch

    from engine.sampling.sampler import SamplingBatch

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


# RL without one option (a SamplingBatch field set to its off value), then kernel shapes.
LEFT_OUT = {
    "no top-p": {"use_top_p": False},
    "no top-k": {"use_top_k": False},
    "no penalty": {"use_penalties": False, "context_ids": None},
    "no logprobs": {"logprobs": False, "num_top_logprobs": 0},
}
SHAPES = [  # (block, num_warps, programs per SM); FusedSampler's default first
    (1024, 8, 2),
    (1024, 4, 2),
    (2048, 8, 2),
    (512, 4, 2),
    (512, 4, 4),
    (1024, 8, 1),
]


def variants(rows: int, logits: Any, args: argparse.Namespace, sync: Any) -> list[dict[str, Any]]:
    """The fused sampler's time on the RL setting with one option left out, and per shape."""
    import dataclasses

    import torch

    from engine.sampling.fused_sampler import FusedSampler

    out = []
    rl = make_batch(rows, args.vocab, args.context, True, args.device)
    for name, change in LEFT_OUT.items():
        ms, _ = measure(FusedSampler(), logits, dataclasses.replace(rl, **change), args.iters, sync)
        out.append({"batch": rows, "variant": name, "fused_ms": ms})
    _, expected = measure(FusedSampler(), logits, rl, 1, sync)
    sms = 2  # the interpreter's
    if logits.device.type == "cuda":
        sms = torch.cuda.get_device_properties(logits.device).multi_processor_count
    for block, warps, per_sm in SHAPES:
        sampler = FusedSampler(block=block, num_programs=per_sm * sms, num_warps=warps)
        ms, got = measure(sampler, logits, rl, args.iters, sync)
        same = bool((got.unpack()[0] == expected.unpack()[0]).all())
        name = f"block {block}, warps {warps}, {per_sm} programs per SM"
        out.append({"batch": rows, "variant": name, "fused_ms": ms, "same_tokens": same})
    for r in out:
        log(f"batch {rows} RL, {r['variant']}: fused {r['fused_ms']:.3f} ms")
    return out


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


def launches_per_call(sampler: Any, logits: Any, batch: Any) -> int:
    """The kernel launches of one fused sampler call (FusedSampler.launch counts them)."""
    launches = []
    launch = sampler.launch

    def counted(kernel: Any, *args: Any, **kwargs: Any) -> None:
        launches.append(kernel)
        launch(kernel, *args, **kwargs)

    sampler.launch = counted
    try:
        sampler(logits, batch)
    finally:
        del sampler.launch
    return len(launches)


def measure_batches(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(per batch size and setting: both samplers' times, launches and whether they picked the
    same tokens; with `--variants`, the fused sampler taken apart)."""
    import torch

    from engine.sampling.sampler import Sampler
    from engine.sampling.sampler_choice import make_sampler

    device = torch.device(args.device)
    # make_sampler checks the device (CUDA, or the CPU under the interpreter); its wrapper would
    # hand some batches to the torch sampler, and this times the kernels themselves.
    fused = make_sampler("triton", device).fused

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    results: list[dict[str, Any]] = []
    taken_apart: list[dict[str, Any]] = []
    for batch_size in args.batches:
        logits = (torch.randn(batch_size, args.vocab, device=device) * 4).to(
            getattr(torch, args.dtype)
        )
        splits = fused.splits(batch_size, args.vocab, device)[0]
        for setting in ("greedy", "rl"):
            batch = make_batch(batch_size, args.vocab, args.context, setting == "rl", args.device)
            torch_ms, expected = measure(Sampler(), logits, batch, args.iters, sync)
            fused_ms, got = measure(fused, logits, batch, args.iters, sync)
            same = torch.equal(got.unpack()[0], expected.unpack()[0])
            launches = launches_per_call(fused, logits, batch)
            r = {"batch": batch_size, "setting": setting, "torch_ms": torch_ms}
            r |= {"fused_ms": fused_ms, "same_tokens": same, "launches": launches}
            r |= {"programs_per_row": splits}
            results.append(r)
            log(
                f"batch {batch_size} {setting}: torch {torch_ms:.3f} ms, fused {fused_ms:.3f} ms"
                f" ({launches} launches per call, {splits} programs per row)"
            )
        if args.variants:
            taken_apart += variants(batch_size, logits, args, sync)
    return results, taken_apart


def emit_result(result: dict[str, Any]) -> None:
    rows = [
        [r["batch"], r["setting"], r["torch_ms"], r["fused_ms"], r["torch_ms"] / r["fused_ms"]]
        + [r["launches"], r["programs_per_row"], r["same_tokens"]]
        for r in result["results"]
    ]
    columns = ["batch", "setting", "torch ms", "fused ms", "speed-up", "launches", "programs/row"]
    emit(result, [*columns, "same tokens"], rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results, taken_apart = measure_batches(args)
    result = {
        "benchmark": "sampler",
        "device": args.device,
        "vocab": args.vocab,
        "context": args.context,
        "dtype": args.dtype,
        "results": results,
        "variants": taken_apart,
        "machine": machine(),
    }
    emit_result(result)
    checked = results + [r for r in taken_apart if "same_tokens" in r]
    return 0 if all(r["same_tokens"] for r in checked) else 1


if __name__ == "__main__":
    raise SystemExit(main())
