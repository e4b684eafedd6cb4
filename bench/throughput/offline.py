"""Offline throughput: the nano-vllm workload through LLMEngine.generate and an HF decode loop.

Both run in this process, on the same checkpoint files, at the same torch thread count; HF
runs the same prompts in padded batches (left padding, `--hf-batch-size` prompts per batch, in
workload order) and is credited only with each request's own output tokens, as a serving
benchmark counts them. Output tokens/s for both and their ratio. The HF side is a decode loop
over the model's forward with its KV cache (bench/hf_reference.py), not `generate`, whose
`min_new_tokens` masks EOS where the engine under ignore_eos may pick it; at `--temperature 0`
the JSON also counts the sequences that are token for token the engine's.

With `--tensor-parallel-size N` the engine also runs with one rank in the same run (each of the
N ranks gets threads / N torch threads, so both use the same cores), and the ratio N ranks / 1
rank is reported. With `--moe-loop` (mixture-of-experts shapes) the engine also runs with the
per-expert loop of bench/throughput/moe_loop.py in place of its grouped experts, in the same run, and the
ratio grouped / loop is reported.

    python -m bench.throughput.offline --shape small-moe --scale 0.05 --threads 2 --moe-loop
    python -m bench.throughput.offline --shape small-gpt-oss --scale 0.05 --threads 2 --temperature 0
    python -m bench.throughput.offline --shape tiny --scale 0.25 --threads 2
    python -m bench.throughput.offline --shape small-gemma3 --scale 0.05 --threads 2 --temperature 0
    python -m bench.throughput.offline --shape tiny --scale 0.25 --threads 2 --tensor-parallel-size 2 --skip-hf
    python -m bench.throughput.offline --shape tiny --scale 0.25 --threads 1 --temperature 0  # + identity
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.checkpoints import add_model_flags, resolve_model
from bench.common import emit, log, machine, process_cpu_seconds, set_threads
from bench.hf_reference import decode_loop, load_model, token_identity
from bench.workload import Workload, make_workload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--scale", type=float, default=1.0, help="shrink count and lengths (CPU)")
    p.add_argument("--num-requests", type=int, help="override the (scaled) request count")
    p.add_argument("--temperature", type=float, default=0.6, help="nano-vllm uses 0.6")
    p.add_argument("--max-num-seqs", type=int, default=128, help="engine: running requests")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="engine: per step")
    p.add_argument(
        "--hf-batch-sizes",
        type=int,
        nargs="+",
        default=[64],
        help="HF: prompts per padded batch; with several, the ratio is against the fastest",
    )
    p.add_argument("--kv-cache-gib", type=float, help="engine KV budget (default: the engine's)")
    p.add_argument("--disable-prefix-cache", action="store_true", help="engine: no prefix cache")
    p.add_argument("--skip-hf", action="store_true", help="engine only (no ratio)")
    p.add_argument("--repeat", type=int, default=1, help="alternate runs; each side's best")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="engine ranks; above 1 the engine also runs with one rank, for the ratio",
    )
    p.add_argument(
        "--moe-loop",
        action="store_true",
        help="MoE: also run the engine with a per-expert loop (bench/throughput/moe_loop.py), for the ratio",
    )
    return p.parse_args(argv)


def run_engine(
    model_dir: Path,
    workload: Workload,
    device: str,
    dtype: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_gib: float | None = None,
    prefix_cache: bool = True,
    tensor_parallel_size: int = 1,
    threads: int | None = None,
) -> tuple[dict[str, Any], list[list[int]]]:
    """Time LLMEngine.generate on the whole workload (after a short warm-up); also each
    request's output ids."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)  # a tensor-parallel run before may have changed it
    per_rank = None if threads is None else max(1, threads // tensor_parallel_size)

    from engine import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(
        model=str(model_dir), device=device, dtype=dtype, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory=None if kv_cache_gib is None else int(kv_cache_gib * 2**30),
        enable_prefix_cache=prefix_cache, tensor_parallel_size=tensor_parallel_size,
        cpu_threads=per_rank if tensor_parallel_size > 1 else None,
    )  # fmt: skip
    start = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - start
    params = [
        SamplingParams(temperature=workload.temperature, max_tokens=n, ignore_eos=True, seed=i)
        for i, n in enumerate(workload.output_lens)
    ]
    engine.generate(workload.prompts[:2], [SamplingParams(max_tokens=8, ignore_eos=True)] * 2)
    _sync(torch, device)
    results, produced, elapsed, cpu = _timed_generate(engine, workload, params, torch, device)
    stats = engine.stats()
    engine.close()
    del engine
    _free(torch, device)
    record = {
        "seconds": elapsed,
        "cpu_cores_busy": cpu / elapsed,  # below the thread count: the machine was contended
        "load_seconds": load_s,
        "output_tokens": produced,
        "output_tokens_per_s": produced / elapsed,
        "total_tokens_per_s": (produced + workload.prompt_tokens) / elapsed,
        "requests_per_s": workload.num_requests / elapsed,
        "preemptions": stats.preemptions,
        "kv_pages": stats.total_pages,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "prefix_cache": prefix_cache,
        "tensor_parallel_size": tensor_parallel_size,
    }
    return record, [r.token_ids for r in results]


def _timed_generate(
    engine: Any, workload: Workload, params: list[Any], torch: Any, device: str
) -> tuple[list[Any], int, float, float]:
    """(results, output tokens, seconds, CPU seconds) of one generate over the workload; raises
    unless every request made its output length."""
    start, cpu = time.perf_counter(), process_cpu_seconds()
    results = engine.generate(workload.prompts, params)
    _sync(torch, device)
    elapsed = time.perf_counter() - start
    cpu = process_cpu_seconds() - cpu
    produced = sum(len(r.token_ids) for r in results)
    errors = [r.error for r in results if r.error]
    if errors or produced != workload.output_tokens:
        raise RuntimeError(f"engine produced {produced} of {workload.output_tokens}: {errors[:3]}")
    return results, produced, elapsed, cpu


def run_hf(
    model_dir: Path, workload: Workload, device: str, dtype: str, batch_size: int
) -> tuple[dict[str, Any], list[list[int]]]:
    """Time the HF decode loop (bench/hf_reference.py) over padded batches of the workload's
    prompts, in workload order; also each request's own output ids."""
    import torch

    model = load_model(model_dir, dtype, device)
    pad = model.config.eos_token_id
    generator = torch.Generator(device=device).manual_seed(workload.seed)
    decode_loop(model, workload.prompts[:2], 8, workload.temperature, pad, generator)  # warm-up
    _sync(torch, device)
    start, cpu = time.perf_counter(), process_cpu_seconds()
    padded_tokens = 0
    tokens: list[list[int]] = []
    for first in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[first : first + batch_size]
        lens = workload.output_lens[first : first + batch_size]
        rows = decode_loop(model, prompts, max(lens), workload.temperature, pad, generator)
        padded_tokens += len(rows) * max(lens)
        tokens += [row[:n] for row, n in zip(rows, lens, strict=True)]
    _sync(torch, device)
    elapsed = time.perf_counter() - start
    cpu = process_cpu_seconds() - cpu
    del model
    _free(torch, device)
    record = {
        "seconds": elapsed,
        "cpu_cores_busy": cpu / elapsed,
        "output_tokens": workload.output_tokens,
        "output_tokens_per_s": workload.output_tokens / elapsed,
        "total_tokens_per_s": (workload.output_tokens + workload.prompt_tokens) / elapsed,
        "requests_per_s": workload.num_requests / elapsed,
        "generated_tokens_with_padding": padded_tokens,
        "batch_size": batch_size,
    }
    return record, tokens


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return max(runs, key=lambda r: float(r["output_tokens_per_s"]))


def _sync(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(torch: Any, device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


@dataclass
class Runs:
    """Every timed run of one invocation, by side; each side's best counts."""

    engine: list[dict[str, Any]] = field(default_factory=list)
    one_rank: list[dict[str, Any]] = field(default_factory=list)  # --tensor-parallel-size > 1
    loop: list[dict[str, Any]] = field(default_factory=list)  # --moe-loop
    hf_by_size: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    engine_tokens: list[list[int]] = field(default_factory=list)  # the last run's
    hf_tokens: dict[int, list[list[int]]] = field(default_factory=dict)


def measure(
    args: argparse.Namespace, model_dir: Path, dtype: str, threads: int, workload: Workload
) -> Runs:
    """Engine and HF runs alternate, `--repeat` times (a shared machine only ever slows a run
    down, so each side's best counts); every run is kept for the JSON."""
    runs = Runs(hf_by_size={size: [] for size in args.hf_batch_sizes})

    def engine_run(tp_size: int, keep_tokens: bool = False) -> dict[str, Any]:
        run, tokens = run_engine(
            model_dir, workload, args.device, dtype, args.max_num_seqs,
            args.max_num_batched_tokens, args.kv_cache_gib,
            prefix_cache=not args.disable_prefix_cache, tensor_parallel_size=tp_size,
            threads=threads,
        )  # fmt: skip
        if keep_tokens:
            runs.engine_tokens = tokens  # all runs agree when greedy
        return run

    for _ in range(args.repeat):
        runs.engine.append(engine_run(args.tensor_parallel_size, keep_tokens=True))
        log(f"engine: {runs.engine[-1]['output_tokens_per_s']:.1f} output tokens/s")
        if args.tensor_parallel_size > 1:  # 1 rank, the baseline of the ratio
            runs.one_rank.append(engine_run(1))
            log(f"engine, 1 rank: {runs.one_rank[-1]['output_tokens_per_s']:.1f} output tokens/s")
        if args.moe_loop:
            from bench.throughput.moe_loop import per_expert_loop

            with per_expert_loop():
                runs.loop.append(engine_run(1))
            rate = runs.loop[-1]["output_tokens_per_s"]
            log(f"engine, per-expert loop: {rate:.1f} output tokens/s")
        for size in [] if args.skip_hf else args.hf_batch_sizes:
            run, runs.hf_tokens[size] = run_hf(model_dir, workload, args.device, dtype, size)
            log(f"hf batch {size}: {run['output_tokens_per_s']:.1f} output tokens/s")
            runs.hf_by_size[size].append(run)
    return runs


def _ratio(num: dict[str, Any] | None, den: dict[str, Any] | None) -> float | None:
    if num is None or den is None:
        return None
    return float(num["output_tokens_per_s"] / den["output_tokens_per_s"])


def summarize(
    args: argparse.Namespace, dtype: str, threads: int, workload: Workload, runs: Runs
) -> dict[str, Any]:
    """The JSON result: each side's best run, the ratios, every run's rate, token identity."""
    engine = _best(runs.engine)
    hf_runs = [_best(r) for r in runs.hf_by_size.values() if r]  # best per batch size
    hf = max(hf_runs, key=lambda r: r["output_tokens_per_s"], default=None)
    one_rank = _best(runs.one_rank) if runs.one_rank else None
    loop = _best(runs.loop) if runs.loop else None
    return {
        "benchmark": "offline",
        "model": args.shape if args.model is None else str(args.model),
        "device": args.device,
        "dtype": dtype,
        "threads": threads,
        "scale": args.scale,
        "workload": workload.describe(),
        "repeat": args.repeat,
        "engine": engine,  # the best of `repeat` runs
        "hf": hf,  # the fastest HF batch size, best of `repeat` runs
        "hf_runs": hf_runs,  # the best run of each batch size
        "all_engine_tokens_per_s": [r["output_tokens_per_s"] for r in runs.engine],
        "all_hf_tokens_per_s": {
            size: [r["output_tokens_per_s"] for r in rs] for size, rs in runs.hf_by_size.items()
        },
        "ratio_engine_over_hf": _ratio(engine, hf),
        "tensor_parallel_size": args.tensor_parallel_size,
        "engine_one_rank": one_rank,  # best of `repeat`; with --tensor-parallel-size > 1
        "ratio_ranks_over_one_rank": _ratio(engine, one_rank),
        "engine_per_expert_loop": loop,  # best of `repeat`; with --moe-loop
        "ratio_grouped_over_loop": _ratio(engine, loop),
        "hf_reference": "decode loop over the forward, KV cached (bench/hf_reference.py)",
        # Greedy only: sampled runs draw from different random streams.
        "token_identity_engine_hf": {
            size: token_identity(runs.engine_tokens, tokens)
            for size, tokens in runs.hf_tokens.items()
        }
        if workload.temperature == 0
        else None,
        "machine": machine(),
    }


def emit_result(result: dict[str, Any]) -> None:
    """The JSON on stdout; a table of each side's best run and the ratios on stderr."""
    tp = result["tensor_parallel_size"]
    sides = [(f"sluice LLMEngine{f', {tp} ranks' if tp > 1 else ''}", result["engine"])]
    sides.append(("sluice LLMEngine, 1 rank", result["engine_one_rank"]))
    sides.append(("sluice LLMEngine, per-expert loop", result["engine_per_expert_loop"]))
    sides += [(f"HF decode loop, batch {r['batch_size']}", r) for r in result["hf_runs"]]
    rows = [
        [label, r["seconds"], r["output_tokens_per_s"], r["requests_per_s"]]
        for label, r in sides
        if r is not None
    ]
    emit(result, ["offline " + result["model"], "seconds", "output tok/s", "req/s"], rows)
    if result["ratio_engine_over_hf"] is not None:
        log(f"ratio engine/HF output tokens/s: {result['ratio_engine_over_hf']:.2f}x")
    for size, identity in (result["token_identity_engine_hf"] or {}).items():
        log(f"token-identical with HF batch {size}: {identity['identical']}/{identity['of']}")
    if result["ratio_grouped_over_loop"] is not None:
        ratio = result["ratio_grouped_over_loop"]
        log(f"ratio grouped experts / per-expert loop output tokens/s: {ratio:.2f}x")
    if result["ratio_ranks_over_one_rank"] is not None:
        ratio = result["ratio_ranks_over_one_rank"]
        log(f"ratio {tp} ranks / 1 rank output tokens/s: {ratio:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.logs import configure_logging

    # The engine's log lines (tensor-parallel workers, say) on stderr: stdout is the JSON.
    configure_logging("info", "console", process="bench")
    threads = set_threads(args.threads)
    model_dir, dtype = resolve_model(args)
    from engine.models.hf_config import load_model_config

    vocab = load_model_config(model_dir).vocab_size
    workload = make_workload(vocab, args.scale, args.num_requests, args.temperature)
    log(f"offline: {workload.describe()} on {model_dir.name}, {threads} threads")
    runs = measure(args, model_dir, dtype, threads, workload)
    emit_result(summarize(args, dtype, threads, workload, runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
