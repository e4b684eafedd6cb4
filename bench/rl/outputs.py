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
from bench.workload import make_workload


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    model_dir, dtype = resolve_model(args)
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.protocol.messages import LogprobMode

    # No prefix cache: every side computes every prompt (scoring would skip no page anyway).
    config = EngineConfig(
        model=str(model_dir), device=args.device, dtype=dtype, enable_prefix_cache=False
    )
    engine = LLMEngine(config)
    workload = make_workload(engine.info.vocab_size, args.scale, args.num_requests)
    prompts, prompt_tokens = workload.prompts, workload.prompt_tokens
    k = args.top_logprobs
    prefill = [SamplingParams(temperature=0.0, max_tokens=1)] * len(prompts)
    scored = [SamplingParams(max_tokens=0, prompt_logprobs=True, top_logprobs=k)] * len(prompts)
    processed = [
        SamplingParams(
            temperature=1.0, top_k=args.top_k, top_p=args.top_p, seed=i, max_tokens=n,
            ignore_eos=True, logprobs=True, top_logprobs=k,
        )
        for i, n in enumerate(workload.output_lens)
    ]  # fmt: skip
    sampled = [
        replace(p, logprob_mode=LogprobMode.SAMPLED, sampling_support=True) for p in processed
    ]
    engine.generate(prompts[:2], prefill[:2])  # warm-up
    best: dict[str, float] = {}
    runs: list[dict[str, Any]] = []
    tokens: dict[str, list[list[int]]] = {}
    sides = [("prefill", prefill), ("scoring", scored), ("processed", processed)]
    sides.append(("sampled", sampled))
    for run in range(args.repeat):
        order = sides if run % 2 == 0 else [sides[1], sides[0], sides[3], sides[2]]
        rates: dict[str, float] = {}
        for name, params in order:
            start = time.perf_counter()
            results = engine.generate(prompts, params)
            seconds = time.perf_counter() - start
            errors = [r.error for r in results if r.error]
            if errors:
                raise RuntimeError(f"{name}: {errors[:3]}")
            count = prompt_tokens if name in ("prefill", "scoring") else workload.output_tokens
            rates[name] = count / seconds
            best[name] = max(best.get(name, 0.0), rates[name])
            tokens[name] = [r.token_ids for r in results]
            log(f"run {run} {name}: {rates[name]:,.0f} tokens/s")
        runs.append(rates)
    if tokens["sampled"] != tokens["processed"]:
        raise RuntimeError("SAMPLED mode drew other tokens than PROCESSED")
    result = {
        "benchmark": "rl_outputs",
        "model": args.model.name if args.model else args.shape,
        "dtype": dtype,
        "threads": threads,
        "workload": {
            "num_requests": workload.num_requests,
            "prompt_tokens": prompt_tokens,
            "output_tokens": workload.output_tokens,
            "top_logprobs": k,
            "top_k": args.top_k,
            "top_p": args.top_p,
        },
        "runs": runs,
        "scoring_over_prefill": best["scoring"] / best["prefill"],
        "sampled_over_processed": best["sampled"] / best["processed"],
        "machine": machine(),
    }
    rows = [[name, best[name]] for name, _ in sides]
    emit(result, ["side", "best tokens/s"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
