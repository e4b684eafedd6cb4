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
from dataclasses import dataclass, field
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


@dataclass
class Measured:
    """What the runs measured; mask and step times are the best constrained run's."""

    compile_ms: float
    lengths: list[int]  # each request's output length, as the constrained side made them
    runs: list[dict[str, float]] = field(default_factory=list)
    mask_ms: float = 0.0
    step_ms: float = 0.0


def build_sides(
    args: argparse.Namespace, engine: Any, prompts: list[list[int]]
) -> tuple[dict[str, Any], float, list[int]]:
    """(params per side, the constraint's compile ms, output lengths): the constrained side
    samples under the constraint; the free side makes the same lengths under ignore_eos."""
    from engine import SamplingParams
    from engine.protocol.messages import Constraint

    kind = args.constraint
    choices = ("yes", "no", "not sure") if kind == "choice" else ()
    constraint = Constraint(kind, CONSTRAINTS[kind], choices)
    start = time.perf_counter()
    engine.structured.grammars.compile(constraint).result()
    compile_ms = (time.perf_counter() - start) * 1e3
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
    return {"constrained": constrained, "free": free}, compile_ms, lengths


def measure(
    args: argparse.Namespace, engine: Any, prompts: list[list[int]], sides: dict[str, Any],
    measured: Measured,
) -> None:  # fmt: skip
    """Each run's tokens/s per side, alternating their order; into `measured`."""
    from engine.structured import grammar_mask

    masks = _MaskTimer(grammar_mask.GrammarMask)
    best: dict[str, float] = {}
    for run in range(args.repeat):
        rates: dict[str, float] = {}
        for name in ("constrained", "free") if run % 2 == 0 else ("free", "constrained"):
            masks.reset()
            start = time.perf_counter()
            results = engine.generate(prompts, sides[name])
            seconds = time.perf_counter() - start
            if errors := [r.error for r in results if r.error]:
                raise RuntimeError(f"{name}: {errors[:3]}")
            if [len(r.token_ids) for r in results] != measured.lengths:
                raise RuntimeError(f"{name}: the output lengths differ from the first run's")
            rates[name] = sum(measured.lengths) / seconds
            if name == "constrained" and rates[name] > best.get(name, 0.0):
                measured.mask_ms = masks.per_step_ms()
                measured.step_ms = seconds / max(masks.count, 1) * 1e3
            best[name] = max(best.get(name, 0.0), rates[name])
            log(f"run {run} {name}: {rates[name]:,.0f} tokens/s")
        measured.runs.append(rates)


def best_rates(runs: list[dict[str, float]]) -> dict[str, float]:
    return {name: max(r[name] for r in runs) for name in ("constrained", "free")}


def summarize(
    args: argparse.Namespace, dtype: str, threads: int, measured: Measured
) -> dict[str, Any]:
    best = best_rates(measured.runs)
    return {
        "benchmark": "structured",
        "model": args.model.name if args.model else args.shape,
        "dtype": dtype,
        "threads": threads,
        "constraint": args.constraint,
        "batch": args.batch,
        "output_tokens": sum(measured.lengths),
        "compile_ms": measured.compile_ms,
        "mask_ms_per_step": measured.mask_ms,
        "step_ms": measured.step_ms,
        "runs": measured.runs,
        "constrained_over_free": best["constrained"] / best["free"],
        "machine": machine(),
    }


def emit_result(result: dict[str, Any]) -> None:
    emit(result, ["side", "best tokens/s"], [list(r) for r in best_rates(result["runs"]).items()])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    model_dir, dtype = resolve_model(args)
    from engine import EngineConfig, LLMEngine

    config = EngineConfig(
        model=str(model_dir), device=args.device, dtype=dtype, max_num_seqs=args.batch
    )
    engine = LLMEngine(config)
    prompts = make_workload(engine.info.vocab_size, num_requests=args.batch, scale=0.25).prompts
    sides, compile_ms, lengths = build_sides(args, engine, prompts)
    measured = Measured(compile_ms, lengths)
    measure(args, engine, prompts, sides, measured)
    emit_result(summarize(args, dtype, threads, measured))
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
