"""What the RL outputs cost: prompt scoring beside plain prefill, and SAMPLED logprobs with the
sampling support beside PROCESSED logprobs, on one engine, alternating, in the same run.

- scoring: every workload prompt with max_tokens 0 and prompt logprobs (`--top-logprobs`
  candidates per position) against the same prompts with max_tokens 1 and no scores; prompt
  tokens/s of each, and their ratio.
- rollouts: the workload's outputs sampled with top-k and top-p, logprobs in PROCESSED mode
  against the same requests in SAMPLED mode with the support; output tokens/s of each, and
  their ratio (the same seeds: the same tokens, checked).

    python -m bench.rl.outputs --shape tiny --scale 0.25 --threads 2
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

from bench.checkpoints import add_model_flags, resolve_model
from bench.common import emit, log, machine, set_threads
from bench.workload import Workload, make_workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--scale", type=float, default=0.25, help="shrink count and lengths (CPU)")
    p.add_argument("--num-requests", type=int, help="override the (scaled) request count")
    p.add_argument("--top-logprobs", type=int, default=5, help="per position and token")
    p.add_argument("--top-k", type=int, default=50, help="rollouts: top-k (bounds the support)")
    p.add_argument("--top-p", type=float, default=0.95, help="rollouts: top-p")
    p.add_argument("--repeat", type=int, default=2, help="alternating runs; each side's best")
    return p.parse_args(argv)


SIDES = ("prefill", "scoring", "processed", "sampled")


def build_sides(args: argparse.Namespace, engine: Any, workload: Workload) -> dict[str, Any]:
    """Each side's sampling params, one per workload prompt."""
    from engine import SamplingParams
    from engine.protocol.messages import LogprobMode

    n_prompts, k = len(workload.prompts), args.top_logprobs
    processed = [
        SamplingParams(
            temperature=1.0, top_k=args.top_k, top_p=args.top_p, seed=i, max_tokens=n,
            ignore_eos=True, logprobs=True, top_logprobs=k,
        )
        for i, n in enumerate(workload.output_lens)
    ]  # fmt: skip
    return {
        "prefill": [SamplingParams(temperature=0.0, max_tokens=1)] * n_prompts,
        "scoring": [SamplingParams(max_tokens=0, prompt_logprobs=True, top_logprobs=k)] * n_prompts,
        "processed": processed,
        "sampled": [
            replace(p, logprob_mode=LogprobMode.SAMPLED, sampling_support=True) for p in processed
        ],
    }


def measure(
    args: argparse.Namespace, engine: Any, workload: Workload, sides: dict[str, Any]
) -> list[dict[str, float]]:
    """Each run's tokens/s per side (prompt tokens for prefill and scoring, output tokens for
    the rollouts); pairs swap order every other run. Raises if SAMPLED drew other tokens."""
    prompts = workload.prompts
    engine.generate(prompts[:2], sides["prefill"][:2])  # warm-up
    runs: list[dict[str, float]] = []
    tokens: dict[str, list[list[int]]] = {}
    for run in range(args.repeat):
        order = SIDES if run % 2 == 0 else ("scoring", "prefill", "sampled", "processed")
        rates: dict[str, float] = {}
        for name in order:
            start = time.perf_counter()
            results = engine.generate(prompts, sides[name])
            seconds = time.perf_counter() - start
            errors = [r.error for r in results if r.error]
            if errors:
                raise RuntimeError(f"{name}: {errors[:3]}")
            scored = name in ("prefill", "scoring")
            rates[name] = (workload.prompt_tokens if scored else workload.output_tokens) / seconds
            tokens[name] = [r.token_ids for r in results]
            log(f"run {run} {name}: {rates[name]:,.0f} tokens/s")
        runs.append(rates)
    if tokens["sampled"] != tokens["processed"]:
        raise RuntimeError("SAMPLED mode drew other tokens than PROCESSED")
    return runs


def best_rates(runs: list[dict[str, float]]) -> dict[str, float]:
    return {name: max(r[name] for r in runs) for name in SIDES}


def summarize(
    args: argparse.Namespace, dtype: str, threads: int, workload: Workload, runs: list[Any]
) -> dict[str, Any]:
    best = best_rates(runs)
    return {
        "benchmark": "rl_outputs",
        "model": args.model.name if args.model else args.shape,
        "dtype": dtype,
        "threads": threads,
        "workload": {
            "num_requests": workload.num_requests,
            "prompt_tokens": workload.prompt_tokens,
            "output_tokens": workload.output_tokens,
            "top_logprobs": args.top_logprobs,
            "top_k": args.top_k,
            "top_p": args.top_p,
        },
        "runs": runs,
        "scoring_over_prefill": best["scoring"] / best["prefill"],
        "sampled_over_processed": best["sampled"] / best["processed"],
        "machine": machine(),
    }


def emit_result(result: dict[str, Any]) -> None:
    emit(result, ["side", "best tokens/s"], [list(r) for r in best_rates(result["runs"]).items()])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    model_dir, dtype = resolve_model(args)
    from engine import EngineConfig, LLMEngine

    # No prefix cache: every side computes every prompt (scoring would skip no page anyway).
    config = EngineConfig(
        model=str(model_dir), device=args.device, dtype=dtype, enable_prefix_cache=False
    )
    engine = LLMEngine(config)
    workload = make_workload(engine.info.vocab_size, args.scale, args.num_requests)
    runs = measure(args, engine, workload, build_sides(args, engine, workload))
    emit_result(summarize(args, dtype, threads, workload, runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
