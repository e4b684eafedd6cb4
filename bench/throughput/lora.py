"""What LoRA adapters cost: one batch spread over 1, 4 and 8 adapters beside the base model
alone, in the same run.

Sides, each the same prompts and output lengths (greedy, ignore_eos) through
LLMEngine.generate: `base` (an engine with max_loras 0: no adapter weights at all), `unused`
(an engine with 8 adapters loaded and resident, every request on the base model: what loaded
adapters cost the base model's requests), and `adapters_1`, `adapters_4`, `adapters_8` (the
requests dealt round-robin over that many adapters on the same engine). Adapters are random
rank-`--rank` PEFT adapters of every q/k/v/o and gate/up/down projection, written by peft
itself. `--repeat` runs alternate the sides' order; each side's best counts. Reports each
side's output tokens/s and its ratio to `base`.

    python -m bench.throughput.lora --shape tiny --batch 32 --max-tokens 64 --repeat 2 --threads 1
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.checkpoints import add_model_flags, resolve_model
from bench.common import emit, log, machine, set_threads

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPREADS = (1, 4, 8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--batch", type=int, default=32, help="requests, all in one batch")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--rank", type=int, default=16, help="every adapter's rank (and max rank)")
    p.add_argument("--repeat", type=int, default=2, help="alternating runs; each side's best")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_adapters(checkpoint: Path, directory: Path, count: int, rank: int) -> list[Path]:
    """`count` random rank-`rank` adapters of `checkpoint`, saved by peft as a trainer would.
    peft starts B at zero (an adapter that changes nothing), so A and B are drawn here."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint), config)
    paths = []
    for i in range(count):
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
        model.save_pretrained(directory / f"a{i}")
        paths.append(directory / f"a{i}")
    return paths


def build_sides(args: argparse.Namespace, model_dir: Path, dtype: str) -> tuple[list[Any], int]:
    """(side name, engine, sampling params) per side: the base model alone, the LoRA engine with
    no adapter in use, then the batch spread over each of SPREADS adapters; and the vocab."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    def engine(max_loras: int) -> LLMEngine:
        config = EngineConfig(
            model=str(model_dir), device=args.device, dtype=dtype, max_num_seqs=args.batch,
            max_loras=max_loras, max_lora_rank=args.rank,
        )  # fmt: skip
        return LLMEngine(config)

    base, lora = engine(0), engine(max(SPREADS))
    with tempfile.TemporaryDirectory(prefix="sluice-lora-bench-") as tmp:
        start = time.perf_counter()
        for i, path in enumerate(make_adapters(model_dir, Path(tmp), max(SPREADS), args.rank)):
            lora.load_adapter(f"a{i}", path)
        log(f"{max(SPREADS)} rank-{args.rank} adapters in {time.perf_counter() - start:.1f} s")
    assert len(lora.lora.resident) == max(SPREADS)

    def params(adapters: int) -> list[SamplingParams]:
        return [
            SamplingParams(
                temperature=0.0,
                max_tokens=args.max_tokens,
                ignore_eos=True,
                adapter=f"a{i % adapters}" if adapters else "",
            )
            for i in range(args.batch)
        ]

    sides: list[tuple[str, Any, list[SamplingParams]]] = [("base", base, params(0))]
    sides.append(("unused", lora, params(0)))
    sides += [(f"adapters_{n}", lora, params(n)) for n in SPREADS]
    return sides, base.info.vocab_size


def measure(args: argparse.Namespace, sides: list[Any], vocab: int) -> list[dict[str, float]]:
    """Each run's tokens/s per side; sides alternate their order from run to run."""
    rng = random.Random(args.seed)
    prompts = [
        [rng.randint(0, vocab - 1) for _ in range(args.prompt_len)] for _ in range(args.batch)
    ]
    for _, eng, ps in sides:  # warm-up: every side's code once
        eng.generate(prompts[:2], ps[:2])
    output_tokens = args.batch * args.max_tokens
    runs: list[dict[str, float]] = []
    for run in range(args.repeat):
        rates: dict[str, float] = {}
        for name, eng, ps in sides if run % 2 == 0 else sides[::-1]:
            start = time.perf_counter()
            results = eng.generate(prompts, ps)
            seconds = time.perf_counter() - start
            if errors := [r.error for r in results if r.error]:
                raise RuntimeError(f"{name}: {errors[:3]}")
            if sum(len(r.token_ids) for r in results) != output_tokens:
                raise RuntimeError(f"{name}: not every request made {args.max_tokens} tokens")
            rates[name] = output_tokens / seconds
            log(f"run {run} {name}: {rates[name]:,.0f} tokens/s")
        runs.append(rates)
    return runs


def summarize(
    args: argparse.Namespace, dtype: str, threads: int, names: list[str], runs: list[Any]
) -> dict[str, Any]:
    """Each side's best run, and its ratio over the base model's best."""
    best = {name: max(r[name] for r in runs) for name in names}
    return {
        "benchmark": "lora",
        "model": args.model.name if args.model else args.shape,
        "device": args.device,
        "dtype": dtype,
        "threads": threads,
        "workload": {
            k: getattr(args, k) for k in ("batch", "prompt_len", "max_tokens", "rank", "repeat")
        },
        "output_tokens": args.batch * args.max_tokens,
        "output_tokens_per_s": best,
        "over_base": {name: best[name] / best["base"] for name in names},
        "runs": runs,
        "machine": machine(),
    }


def emit_result(result: dict[str, Any]) -> None:
    best = result["output_tokens_per_s"]
    rows = [[name, rate, result["over_base"][name]] for name, rate in best.items()]
    emit(result, ["side", "best tokens/s", "over base"], rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    model_dir, dtype = resolve_model(args)
    sides, vocab = build_sides(args, model_dir, dtype)
    runs = measure(args, sides, vocab)
    emit_result(summarize(args, dtype, threads, [name for name, _, _ in sides], runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
