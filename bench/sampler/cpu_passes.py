"""The CPU sampler with its C passes (engine/sampling/cpu_race.c: the exp weights and the
exponential race) against the same Sampler on torch's elementwise ops, in the same run.

Two levels, each side alternating and the same tokens checked:
- one Sampler call on random float32 logits, per batch size and setting (temperature 1 alone;
  RL: top-k 50, top-p 0.9, repetition 1.1 with logprobs and top-5; top-p 0.95 alone): the median
  milliseconds of each side;
- sampled decoding through LLMEngine.generate (temperature 1, `--top-p`, ignore_eos) on a
  bench checkpoint: output tokens/s of each side.

    python -m bench.sampler.cpu_passes --batches 1 64 --vocab 32000 --shape llama-75m --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.checkpoints import add_model_flags, resolve_model
from bench.common import emit, log, machine, set_threads
from bench.sampler.fused import make_batch
from bench.workload import make_workload

SETTINGS = ("temperature", "rl", "top_p")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--vocab", type=int, default=32000, help="Llama 2's by default")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--num-requests", type=int, default=64, help="for the engine level")
    p.add_argument("--max-tokens", type=int, default=32, help="for the engine level")
    p.add_argument("--repeat", type=int, default=2, help="engine level: alternating runs")
    p.add_argument("--top-p", type=float, default=1.0, help="engine level: 1 = off")
    return p.parse_args(argv)


class CPasses:
    """Switches the C passes on and off (cpu_race.usable answers False when off)."""

    def __init__(self) -> None:
        from engine.sampling import cpu_race

        self.module, self.usable = cpu_race, cpu_race.usable

    def use(self, on: bool) -> None:
        self.module.usable = self.usable if on else (lambda logits: False)  # type: ignore[assignment]


def sampler_level(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    import torch

    from engine.sampling.sampler import Sampler

    switch = CPasses().use
    results, rows = [], []
    for size in args.batches:
        logits = torch.randn(size, args.vocab) * 4
        for setting in SETTINGS:
            batch = make_batch(size, args.vocab, 1024, setting != "greedy", "cpu")
            batch.floats[:, 0] = 1.0
            if setting != "rl":  # temperature 1 alone, or top-p 0.95 alone
                batch.use_top_k = batch.use_penalties = batch.logprobs = False
                batch.context_ids, batch.num_top_logprobs = None, 0
                batch.use_top_p = setting == "top_p"
                batch.floats[:, 1] = 0.95
            ms, tokens = {}, {}
            for side in ("torch", "c", "torch", "c"):
                switch(side == "c")
                times = []
                for _ in range(args.iters):
                    start = time.perf_counter()
                    out = Sampler()(logits, batch)
                    times.append(time.perf_counter() - start)
                ms[side] = min(ms.get(side, float("inf")), statistics.median(times) * 1e3)
                tokens[side] = out.unpack()[0]
            switch(True)
            same = torch.equal(tokens["c"], tokens["torch"])
            r = {"batch": size, "setting": setting, "torch_ms": ms["torch"], "c_ms": ms["c"]}
            r |= {"speed_up": ms["torch"] / ms["c"], "same_tokens": same}
            results.append(r)
            rows.append([size, setting, ms["torch"], ms["c"], r["speed_up"], same])
            log(f"batch {size} {setting}: torch {ms['torch']:.2f} ms, c {ms['c']:.2f} ms")
    return results, rows


def engine_level(args: argparse.Namespace) -> dict[str, Any]:
    from engine import EngineConfig, LLMEngine, SamplingParams

    model_dir, dtype = resolve_model(args)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype=dtype))
    prompts = make_workload(engine.info.vocab_size, num_requests=args.num_requests).prompts
    prompts = [p[:64] for p in prompts]
    params = [
        SamplingParams(temperature=1.0, top_p=args.top_p, seed=i, max_tokens=args.max_tokens,
                       ignore_eos=True)
        for i in range(len(prompts))
    ]  # fmt: skip
    switch = CPasses().use
    engine.generate(prompts[:2], params[:2])  # warm-up
    best: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    for run in range(args.repeat):
        for side in ("torch", "c") if run % 2 == 0 else ("c", "torch"):
            switch(side == "c")
            start = time.perf_counter()
            results = engine.generate(prompts, params)
            rate = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
            best[side] = max(best.get(side, 0.0), rate)
            tokens[side] = [r.token_ids for r in results]
            log(f"engine run {run} {side}: {rate:,.0f} tokens/s")
    switch(True)
    return {
        "model": args.model.name if args.model else args.shape,
        "dtype": dtype,
        "torch_tokens_per_s": best["torch"],
        "c_tokens_per_s": best["c"],
        "top_p": args.top_p,
        "c_over_torch": best["c"] / best["torch"],
        "same_tokens": tokens["c"] == tokens["torch"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    results, rows = sampler_level(args)
    engine = engine_level(args)
    result = {
        "benchmark": "cpu_sampler",
        "vocab": args.vocab,
        "threads": threads,
        "sampler": results,
        "engine": engine,
        "machine": machine(),
    }
    rows.append(["engine", engine["model"], engine["torch_tokens_per_s"],
                 engine["c_tokens_per_s"], engine["c_over_torch"], engine["same_tokens"]])  # fmt: skip
    emit(result, ["batch", "setting", "torch", "c", "speed-up", "same tokens"], rows)
    same = all(r["same_tokens"] for r in results) and engine["same_tokens"]
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
