"""Overlapped steps against plain ones, with the model forward replaced by a stand-in.

`python -m bench.decode --stand-in-forward-ms MS --batches B` runs this. `B` requests decode;
the model's forward is a stand-in that sleeps MS milliseconds (releasing the GIL, as a device
would leave the host free) and the LM head returns zero logits, so a step's device time is
known exactly and everything else is the engine's host work. Three timings, each the median
decode step over `--steps` steps after `--warmup`, the best of `--rounds` rounds that alternate
the three (a loaded machine slows some rounds down):
- host_ms_per_step: plain steps with a 0 ms stand-in (schedule, inputs, sampling, outputs);
- step_ms_plain: plain steps with the MS stand-in: about host + MS;
- step_ms_overlapped: the overlapped loop (EngineConfig.overlap_steps), same stand-in: about
  max(host, MS) when the host work of step N+1 hides behind the device time of step N.
One JSON document on stdout.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench.checkpoints import resolve_model
from bench.common import emit, log, machine, set_threads


def stand_in(engine: Any, forward_ms: float) -> None:
    """Replace the engine's forward by a sleep of `forward_ms` and its LM head by zeros."""
    import torch

    model = engine.runner.model
    hidden = model.config.hidden_size
    vocab = model.config.vocab_size

    def forward(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        time.sleep(forward_ms / 1e3)  # releases the GIL: the host thread runs meanwhile
        return torch.zeros(input_ids.shape[0], hidden, device=input_ids.device)

    def compute_logits(states: torch.Tensor) -> torch.Tensor:
        return torch.zeros(states.shape[0], vocab, device=states.device)

    model.forward = forward
    model.compute_logits = compute_logits


def median_step_ms(
    model_dir: Any, dtype: str, args: argparse.Namespace, batch: int, overlap: bool, ms: float
) -> float:
    from engine import EngineConfig, LLMEngine, SamplingParams

    steps = args.warmup + args.steps
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device=args.device,
            dtype=dtype,
            max_num_seqs=batch,
            max_num_batched_tokens=max(2048, batch * (args.context + 1)),
            overlap_steps=overlap,
        )
    )
    stand_in(engine, ms)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [0] + [2 + (i + j) % 200 for j in range(args.context)], params)
    engine.step()  # every prompt in one step
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.close()
    return statistics.median(times[args.warmup :]) * 1e3


def measure(args: argparse.Namespace, model_dir: Path, dtype: str) -> list[dict[str, Any]]:
    """Per batch, the best of `--rounds` median step times: host only (a 0 ms stand-in), plain
    and overlapped with the stand-in's `--stand-in-forward-ms`."""
    ms = args.stand_in_forward_ms
    results = []
    for batch in args.batches:
        runs: dict[str, list[float]] = {"host": [], "plain": [], "overlapped": []}
        for _ in range(args.rounds):
            runs["host"].append(median_step_ms(model_dir, dtype, args, batch, False, 0.0))
            runs["plain"].append(median_step_ms(model_dir, dtype, args, batch, False, ms))
            runs["overlapped"].append(median_step_ms(model_dir, dtype, args, batch, True, ms))
        host, plain, overlapped = (min(runs[k]) for k in ("host", "plain", "overlapped"))
        results.append(
            {
                "batch": batch,
                "stand_in_forward_ms": ms,
                "host_ms_per_step": host,
                "step_ms_plain": plain,
                "step_ms_overlapped": overlapped,
                "ideal_ms_plain": host + ms,
                "ideal_ms_overlapped": max(host, ms),
            }
        )
        log(f"batch {batch}: host {host:.2f} ms, plain {plain:.2f}, overlapped {overlapped:.2f}")
    return results


def emit_result(result: dict[str, Any]) -> None:
    rows = [
        [r["batch"], r["stand_in_forward_ms"], r["host_ms_per_step"], r["step_ms_plain"]]
        + [r["step_ms_overlapped"], r["ideal_ms_overlapped"]]
        for r in result["batches"]
    ]
    emit(result, ["batch", "device ms", "host ms", "plain", "overlapped", "max(h, d)"], rows)


def main(args: argparse.Namespace) -> int:
    if args.device != "cpu":
        log("the stand-in forward sleeps on the host: this measures the CPU loop only")
    threads = set_threads(args.threads)
    model_dir, dtype = resolve_model(args)
    results = measure(args, model_dir, dtype)
    result = {
        "benchmark": "decode_overlap",
        "model": args.shape if args.model is None else str(args.model),
        "device": args.device,
        "threads": threads,
        "context": args.context,
        "steps": args.steps,
        "rounds": args.rounds,
        "batches": results,
        "machine": machine(),
    }
    emit_result(result)
    return 0
