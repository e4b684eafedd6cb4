"""Prefix-cache workload: groups of requests sharing a long prefix, cache on vs off.

Each group has its own random prefix (a system prompt, say); requests arrive in waves, one
per group per wave, each its group's prefix plus a short random suffix. The first wave misses;
later waves hit the prefix pages. Both engines run the same waves in this process; reported:
prompt tokens found in the cache (hit ratio), time to first token (arrival to first token, as
the engine measures it) mean and p50, and the TTFT ratio off/on.

    python -m bench.throughput.prefix --shape tiny --groups 8 --waves 4 --prefix-len 512 --threads 1
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from bench.checkpoints import add_model_flags, resolve_model
from bench.common import emit, log, machine, percentile, set_threads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--groups", type=int, default=8, help="distinct shared prefixes")
    p.add_argument("--waves", type=int, default=4, help="requests per group, one wave each")
    p.add_argument("--prefix-len", type=int, default=512, help="shared prefix tokens")
    p.add_argument("--suffix-len", type=int, default=32, help="max private suffix tokens")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_waves(args: argparse.Namespace, vocab_size: int) -> list[list[list[int]]]:
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(2, vocab_size) for _ in range(args.prefix_len)] for _ in range(args.groups)
    ]
    return [
        [
            prefix + [rng.randrange(2, vocab_size) for _ in range(rng.randint(1, args.suffix_len))]
            for prefix in prefixes
        ]
        for _ in range(args.waves)
    ]


def run(args: argparse.Namespace, model: str, dtype: str, cache: bool) -> dict[str, Any]:
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=model,
            device=args.device,
            dtype=dtype,
            page_size=args.page_size,
            enable_prefix_cache=cache,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    ttfts: list[float] = []
    outputs: list[list[int]] = []
    for w, wave in enumerate(make_waves(args, engine.info.vocab_size)):
        for i, prompt in enumerate(wave):
            engine.add_request(f"w{w}-{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_work():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.metrics is not None:
                    ttfts.append(out.metrics.time_to_first_token)
        outputs += [tokens[f"w{w}-{i}"] for i in range(len(wave))]
    stats = engine.stats()
    return {
        "prefix_cache": cache,
        "hit_ratio": stats.prefix_hit_ratio,
        "prompt_tokens_computed": stats.prompt_tokens_computed,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "outputs": outputs,
    }


def emit_result(result: dict[str, Any]) -> None:
    keys = ["hit_ratio", "prompt_tokens_computed", "ttft_mean_s", "ttft_p50_s"]
    rows = [[side, *(result[f"cache_{side}"][k] for k in keys)] for side in ("on", "off")]
    emit(result, ["cache", "hit ratio", "prefill tokens", "ttft mean s", "ttft p50 s"], rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    model, dtype = resolve_model(args)
    log(f"prefix workload: {args.groups} groups x {args.waves} waves, prefix {args.prefix_len}")
    on = run(args, str(model), dtype, cache=True)
    off = run(args, str(model), dtype, cache=False)
    same = on.pop("outputs") == off.pop("outputs")
    result = {
        "benchmark": "prefix",
        "machine": machine(),
        "model": args.shape if args.model is None else str(args.model),
        "device": args.device,
        "dtype": dtype,
        "threads": threads,
        "workload": {k: getattr(args, k) for k in ("groups", "waves", "prefix_len", "suffix_len")},
        "cache_on": on,
        "cache_off": off,
        "identical_outputs": same,
        "ttft_mean_ratio_off_over_on": off["ttft_mean_s"] / on["ttft_mean_s"],
    }
    emit_result(result)
    return 0 if same else 1  # a cache that changes outputs is a bug, not a speed-up


if __name__ == "__main__":
    raise SystemExit(main())
