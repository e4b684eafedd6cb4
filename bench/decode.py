"""Decode step time at batch 1/8/64/256 and a fixed context, against the bandwidth roofline.

For each batch size, `batch` requests with `--context`-token prompts are prefilled, then the
engine's `step()` is timed while every request decodes one token per step. Reported per batch:
- step time and decode tokens/s (plain `step()` calls, nothing wrapped);
- the bytes a step must read (every weight once, plus each request's live K and V) divided by
  the measured copy bandwidth of the device: the roofline step time, and the measured step's
  fraction of it;
- where a step's time goes, from a second run with the engine's methods wrapped in timers
  from outside (no engine code changed): scheduling, input preparation, the model forward
  (+ LM head), sampling (building the per-row tensors, then the sampler), the device-to-host
  copy, and postprocessing (appending tokens, stop checks, outputs). Host time = step - forward.
  On CUDA each timer synchronizes, so device work is charged to the method that queued it.
  The timers are bench/step/timers.py's.
- the ops a decode step dispatches outside the model forward (and LM head), counted with a
  TorchDispatchMode around `step()` at `--op-rows` rows, greedy and in the RL setting
  (temperature 1, top-p 0.9, top-k 50, logprobs with top-5, repetition penalty 1.1)
  (bench/step/op_count.py); each launch of one of the fused sampler's kernels counts as one op. On
  CUDA each op is a kernel launch or more.
  `--sampler triton` on the CPU runs the fused kernel under Triton's interpreter: op counts
  only, its times mean nothing.

    python -m bench.decode --shape tiny --batches 1 8 64 256 --context 256 --threads 2

With `--count-kernels` it only counts the kernels of one graphed decode step, per layer and
outside the layers, and prints that JSON document (bench/step/kernel_count.py):

    python -m bench.decode --shape qwen2.5-0.5b --count-kernels

`--host-only` times only the host's work per step (bench/step/host_only.py), for this tree and, with
`--baseline-rev REV`, for REV's, alternating `--rounds` times:

    python -m bench.decode --host-only --batches 64 256 --baseline-rev 832212e

With `--stand-in-forward-ms MS` it measures plain against overlapped steps with a forward that
sleeps MS (bench/step/overlap.py).
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.checkpoints import add_model_flags, resolve_model
from bench.common import emit, log, machine, process_cpu_seconds, set_threads
from bench.step.op_count import count_step_ops
from bench.step.timers import Timers, breakdown, instrument


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps first")
    p.add_argument("--rounds", type=int, default=4, help="plain/instrumented alternations")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096, help="prefill chunking")
    p.add_argument("--bandwidth-mib", type=int, help="copy size for the bandwidth probe")
    p.add_argument("--sampler", choices=("auto", "torch", "triton"), default="auto")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument(
        "--overlap-steps", action="store_true", help="host/device overlap (no breakdown)"
    )
    p.add_argument("--op-rows", type=int, default=32, help="rows of the op-count steps")
    p.add_argument(
        "--host-only",
        action="store_true",
        help="host time per step only: stand-in forward and sampler (bench/step/host_only.py)",
    )
    p.add_argument("--baseline-rev", help="--host-only: also time this git revision, alternately")
    p.add_argument(
        "--count-kernels",
        action="store_true",
        help="only count the kernels of a graphed decode step (eager kernels, Triton forced)",
    )
    p.add_argument("--count-layers", type=int, default=2, help="layers the count builds")
    p.add_argument("--count-rows", type=int, default=1, help="sequences of the counted step")
    p.add_argument(
        "--stand-in-forward-ms",
        type=float,
        help="instead: plain against overlapped steps with a forward that sleeps this long "
        "(bench/step/overlap.py)",
    )
    return p.parse_args(argv)


def copy_bandwidth(device: str, mib: int) -> float:
    """Bytes per second a large tensor copy moves (read + write), best of several runs."""
    import torch

    n = mib * 2**20
    src = torch.ones(n // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(8):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n / best


def weight_bytes(model: Any) -> int:
    """Bytes of weights a decode step reads: all of them, except the rows of an untied
    embedding table that the step does not look up."""
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_token(cfg: Any, itemsize: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def new_tokens_per_request(args: argparse.Namespace, batch: int) -> int:
    """Enough that no request finishes before the timed steps end: prefill is chunked, and the
    first requests decode a token per step while the last ones still prefill."""
    prefill_steps = -(-batch * args.context // args.max_num_batched_tokens)
    return prefill_steps + 1 + args.warmup + 2 * args.steps + 2


def start_batch(engine: Any, batch: int, args: argparse.Namespace) -> tuple[list[str], float]:
    """Adds `batch` requests of `--context` random tokens, prefills them and runs the warm-up
    steps: (their ids, the prefill's seconds)."""
    from engine import SamplingParams

    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=new_tokens_per_request(args, batch),
        ignore_eos=True,
        seed=0,
    )
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        prompt = [rng.randrange(vocab) for _ in range(args.context)]
        engine.add_request(request_id, prompt, params)
    prefill_start = time.perf_counter()
    started: set[str] = set()
    while len(started) < batch:  # prefill; each request's first token comes with it
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    prefill_s = time.perf_counter() - prefill_start
    for _ in range(args.warmup):
        engine.step()
    assert len(engine.scheduler.running) == batch and not engine.scheduler.waiting
    return ids, prefill_s


def measure_batch(engine: Any, batch: int, args: argparse.Namespace, sync: Any) -> dict[str, Any]:
    """Step times of `batch` decoding requests, plain steps alternating with instrumented ones."""
    ids, prefill_s = start_batch(engine, batch, args)

    # Plain and instrumented steps alternate in rounds, so that a burst of load from another
    # process on a shared machine lands on both alike.
    times: list[float] = []
    timers = Timers(sync)
    untimed: list[str] = []
    cpu = 0.0
    rounds = max(1, min(args.rounds, args.steps))
    for r in range(rounds):
        count = args.steps // rounds + (r < args.steps % rounds)
        cpu -= process_cpu_seconds()
        for _ in range(count):
            start = time.perf_counter()
            engine.step()
            sync()
            times.append(time.perf_counter() - start)
        cpu += process_cpu_seconds()
        if args.overlap_steps:
            continue  # the timers' syncs would serialise what overlaps: plain steps only
        untimed = instrument(engine, timers)
        try:
            for _ in range(count):
                engine.step()
        finally:
            timers.restore()
    contexts = [r.num_tokens for r in engine.scheduler.running]
    engine.abort(ids)
    engine.step()  # flush the abort outputs
    return {
        "batch": batch,
        "context_mean": statistics.fmean(contexts),
        "prefill_seconds": prefill_s,
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_mean": statistics.fmean(times) * 1e3,
        "step_ms_min": min(times) * 1e3,
        "decode_tokens_per_s": batch / statistics.median(times),
        "cpu_cores_busy": cpu / sum(times),  # below the thread count: the machine was contended
        "instrumented_ms": breakdown(timers.steps) if timers.steps else None,
        "untimed_parts": untimed,
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Modes with mains of their own, each module imported only when chosen.
    modes = {
        "host_only": "host_only",
        "count_kernels": "kernel_count",
        "stand_in_forward_ms": "overlap",
    }
    for flag, module in modes.items():
        if getattr(args, flag) not in (None, False):
            return int(importlib.import_module(f"bench.step.{module}").main(args))
    if args.sampler == "triton" and not args.device.startswith("cuda"):
        import os

        # NOTE: must be set before triton is first imported; counts only on the CPU.
        os.environ["TRITON_INTERPRET"] = "1"
    threads = set_threads(args.threads)
    model_dir, dtype = resolve_model(args)
    engine, cfg = build_engine(args, model_dir, dtype)
    probe = probe_machine(args, engine, cfg, dtype)
    log(
        f"decode on {model_dir.name}: weights {probe['weights'] / 2**20:.1f} MiB, KV "
        f"{probe['per_token']} B/token, copy bandwidth {probe['bandwidth'] / 1e9:.1f} GB/s, "
        f"{threads} threads"
    )
    results = measure(args, engine, probe)
    emit_result(summarize(args, dtype, threads, engine, probe, results))
    return 0


def build_engine(args: argparse.Namespace, model_dir: Path, dtype: str) -> tuple[Any, Any]:
    """(LLMEngine, model config) with room for the largest batch at its full context and for
    the op count's rows."""
    from engine import EngineConfig, LLMEngine
    from engine.models.hf_config import load_model_config

    cfg = load_model_config(model_dir)
    page_size = 16
    tokens_per_req = args.context + new_tokens_per_request(args, max(args.batches)) + 2
    op_pages = args.op_rows * -(-(min(args.context, 64) + 24) // page_size)
    pages = max(max(args.batches) * -(-tokens_per_req // page_size), op_pages) + 16
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device=args.device,
            dtype=dtype,
            max_num_seqs=max(*args.batches, args.op_rows),
            max_num_batched_tokens=max(args.max_num_batched_tokens, max(args.batches)),
            page_size=page_size,
            num_kv_pages=pages,
            max_model_len=max(cfg.max_model_len, tokens_per_req),
            sampler=args.sampler,
            compile=args.compile,
            overlap_steps=args.overlap_steps,
        )
    )
    return engine, cfg


def probe_machine(args: argparse.Namespace, engine: Any, cfg: Any, dtype: str) -> dict[str, Any]:
    """What the roofline needs: copy bandwidth, weight bytes and KV bytes per token."""
    import torch

    mib = args.bandwidth_mib or (2048 if args.device.startswith("cuda") else 512)
    return {
        "bandwidth": copy_bandwidth(args.device, mib),
        "weights": weight_bytes(engine.model),
        "per_token": kv_bytes_per_token(cfg, getattr(torch, dtype).itemsize),
    }


def measure(args: argparse.Namespace, engine: Any, probe: dict[str, Any]) -> dict[str, Any]:
    """The op count outside the forward, then each batch's step time against its roofline."""

    def sync() -> None:
        _sync(args.device)

    ops = count_step_ops(engine, args.op_rows, min(args.context, 64))
    log(
        f"ops per decode step outside the forward at {ops['rows']} rows: "
        f"greedy {ops['greedy']}, RL {ops['rl']} ({type(engine.runner.sampler).__name__})"
    )
    results = []
    for batch in args.batches:
        r = measure_batch(engine, batch, args, sync)
        step_bytes = probe["weights"] + probe["per_token"] * r["context_mean"] * batch
        r["bytes_per_step"] = step_bytes
        r["roofline_ms"] = step_bytes / probe["bandwidth"] * 1e3
        r["roofline_fraction"] = r["roofline_ms"] / r["step_ms_median"]
        results.append(r)
        parts = r["instrumented_ms"] or defaultdict(lambda: float("nan"))
        log(f"batch {batch}: {r['step_ms_median']:.2f} ms/step, host {parts['host_fraction']:.0%}")
    return {"ops": ops, "batches": results}


def summarize(
    args: argparse.Namespace,
    dtype: str,
    threads: int,
    engine: Any,
    probe: dict[str, Any],
    measured: dict[str, Any],
) -> dict[str, Any]:
    return {
        "benchmark": "decode",
        "model": args.shape if args.model is None else str(args.model),
        "device": args.device,
        "dtype": dtype,
        "threads": threads,
        "context": args.context,
        "steps": args.steps,
        "temperature": args.temperature,
        "copy_bandwidth_bytes_per_s": probe["bandwidth"],
        "weight_bytes": probe["weights"],
        "kv_bytes_per_token": probe["per_token"],
        "sampler": type(engine.runner.sampler).__name__,
        "compile": args.compile,
        "overlap_steps": args.overlap_steps,
        "ops_per_step_outside_forward": measured["ops"],
        "batches": measured["batches"],
        "machine": machine(),
    }


HEADER = [
    "batch", "step ms", "tok/s", "roofline ms", "of roofline", "timed step", "forward",
    "schedule", "inputs", "sampling", "to host", "post", "host",
]  # fmt: skip


def emit_result(result: dict[str, Any]) -> None:
    """The JSON on stdout; per batch, step time, roofline and the timed parts on stderr."""
    rows = []
    for r in result["batches"]:
        parts = r["instrumented_ms"] or defaultdict(lambda: float("nan"))
        rows.append(
            [r["batch"], r["step_ms_median"], r["decode_tokens_per_s"], r["roofline_ms"]]
            + [r["roofline_fraction"], parts["step"], parts["forward"], parts["schedule"]]
            + [parts["prepare_inputs"], parts["sampling"], parts["to_host"]]
            + [parts["postprocess"], f"{parts['host_fraction']:.0%}"]
        )
    emit(result, HEADER, rows)


if __name__ == "__main__":
    raise SystemExit(main())
