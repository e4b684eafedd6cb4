"""What structured output costs: a batch of constrained requests beside the same requests
unconstrained, on one engine, alternating, in the same run.

The constrained side samples the workload's prompts under a constraint (a JSON schema by
default); the free side then samples the same prompts with the same seeds for exactly the
lengths the constrained outputs came to (ignore_eos), so both decode the same number of tokens
from the same prompts. Reports output tokens/s of each and their ratio (the target at batch 32
is at least 0.8), the grammar's compile time, and the mask time per constrained step (the
xgrammar work a step does, on the host, while its forward runs) beside the step time.

    python -m bench.structured.batch --shape tiny --batch 32 --repeat 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from bench.checkpoints import add_model_flags, resolve_model
from bench.common import emit, log, machine, set_threads
from bench.structured.libraries import SCHEMA
from bench.workload import make_workload

CONSTRAINTS = {
    "json_schema": json.dumps(SCHEMA),
    "regex": r"[A-Z][a-z]+( [a-z]+){3,12}\.",
    "choice": "",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--constraint", default="json_schema", choices=sorted(CONSTRAINTS))
    p.add_argument("--batch", type=int, default=32, help="requests, all in one batch")
    p.add_argument("--max-tokens", type=int, default=128, help="per request")
    p.add_argument("--repeat", type=int, default=2, help="alternating runs; each side's best")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    model_dir, dtype = resolve_model(args)
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.protocol.messages import Constraint
    from engine.structured import grammar_mask

    config = EngineConfig(
        model=str(model_dir), device=args.device, dtype=dtype, max_num_seqs=args.batch
    )
    engine = LLMEngine(config)
    prompts = make_workload(engine.info.vocab_size, num_requests=args.batch, scale=0.25).prompts
    kind = args.constraint
    choices = ("yes", "no", "not sure") if kind == "choice" else ()
    constraint = Constraint(kind, CONSTRAINTS[kind], choices)
    start = time.perf_counter()
    engine.structured.grammars.compile(constraint).result()
    compile_ms = (time.perf_counter() - start) * 1e3
    masks = _MaskTimer(grammar_mask.GrammarMask)
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured=constraint)
        for i in range(len(prompts))
    ]
    engine.generate(prompts[:2], constrained[:2])  # warm-up
    lengths = [len(r.token_ids) for r in engine.generate(prompts, constrained)]
    free = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
        for i, n in enumerate(lengths)
    ]
    best: dict[str, float] = {}
    runs: list[dict[str, Any]] = []
    mask_ms = step_ms = 0.0
    for run in range(args.repeat):
        sides = [("constrained", constrained), ("free", free)]
        rates: dict[str, float] = {}
        for name, params in sides if run % 2 == 0 else sides[::-1]:
            masks.reset()
            start = time.perf_counter()
            results = engine.generate(prompts, params)
            seconds = time.perf_counter() - start
            if errors := [r.error for r in results if r.error]:
                raise RuntimeError(f"{name}: {errors[:3]}")
            if [len(r.token_ids) for r in results] != lengths:
                raise RuntimeError(f"{name}: the output lengths differ from the first run's")
            rates[name] = sum(lengths) / seconds
            if name == "constrained" and rates[name] > best.get(name, 0.0):
                mask_ms, step_ms = masks.per_step_ms(), seconds / max(masks.count, 1) * 1e3
            best[name] = max(best.get(name, 0.0), rates[name])
            log(f"run {run} {name}: {rates[name]:,.0f} tokens/s")
        runs.append(rates)
    result = {
        "benchmark": "structured",
        "model": args.model.name if args.model else args.shape,
        "dtype": dtype,
        "threads": threads,
        "constraint": kind,
        "batch": args.batch,
        "output_tokens": sum(lengths),
        "compile_ms": compile_ms,
        "mask_ms_per_step": mask_ms,
        "step_ms": step_ms,
        "runs": runs,
        "constrained_over_free": best["constrained"] / best["free"],
        "machine": machine(),
    }
    rows = [[name, best[name]] for name in ("constrained", "free")]
    emit(result, ["side", "best tokens/s"], rows)
    return 0


class _MaskTimer:
    """Wraps GrammarMask.fill: the time of each mask actually computed (not the no-op calls)."""

    def __init__(self, cls: Any) -> None:
        self.seconds, self.count = 0.0, 0
        fill = cls.fill

        def timed(mask: Any) -> None:
            if mask._bitmask is not None:
                return
            start = time.perf_counter()
            fill(mask)
            self.seconds += time.perf_counter() - start
            self.count += 1

        cls.fill = timed

    def reset(self) -> None:
        self.seconds, self.count = 0.0, 0

    def per_step_ms(self) -> float:
        return self.seconds / max(self.count, 1) * 1e3


if __name__ == "__main__":
    raise SystemExit(main())
