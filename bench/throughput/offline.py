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
    python -m bench.throughput.offline --shape tiny --scale 0.25 --threads 2
    python -m bench.throughput.offline --shape tiny --scale 0.25 --threads 2 --tensor-parallel-size 2 --skip-hf
    python -m bench.throughput.offline --shape tiny --scale 0.25 --threads 1 --temperature 0  # + identity
"""

from __future__ import annotations

import argparse
import gc
import time
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
        model=str(model_dir),
        device=device,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory=None if kv_cache_gib is None else int(kv_cache_gib * 2**30),
        enable_prefix_cache=prefix_cache,
        tensor_parallel_size=tensor_parallel_size,
        cpu_threads=per_rank if tensor_parallel_size > 1 else None,
    )
    start = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - start
    params = [
        SamplingParams(temperature=workload.temperature, max_tokens=n, ignore_eos=True, seed=i)
        for i, n in enumerate(workload.output_lens)
    ]
    engine.generate(workload.prompts[:2], [SamplingParams(max_tokens=8, ignore_eos=True)] * 2)
    _sync(torch, device)
    start, cpu = time.perf_counter(), process_cpu_seconds()
    results = engine.generate(workload.prompts, params)
    _sync(torch, device)
    elapsed = time.perf_counter() - start
    cpu = process_cpu_seconds() - cpu
    produced = sum(len(r.token_ids) for r in results)
    errors = [r.error for r in results if r.error]
    if errors or produced != workload.output_tokens:
        raise RuntimeError(f"engine produced {produced} of {workload.output_tokens}: {errors[:3]}")
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
    # Engine and HF runs alternate; each side's best run counts (a shared machine only ever
    # slows a run down). Every run is in the JSON.
    engine_runs: list[dict[str, Any]] = []
    one_rank_runs: list[dict[str, Any]] = []  # with --tensor-parallel-size > 1
    loop_runs: list[dict[str, Any]] = []  # with --moe-loop
    hf_by_size: dict[int, list[dict[str, Any]]] = {size: [] for size in args.hf_batch_sizes}
    engine_tokens: list[list[int]] = []  # the last run's (all runs agree when greedy)
    hf_tokens: dict[int, list[list[int]]] = {}
    # With --tensor-parallel-size N > 1, each repeat also runs 1 rank: the baseline of the ratio.
    sizes = [(args.tensor_parallel_size, engine_runs)]
    if args.tensor_parallel_size > 1:
        sizes.append((1, one_rank_runs))
    for _ in range(args.repeat):
        for tp_size, runs in sizes:
            run, tokens = run_engine(
                model_dir,
                workload,
                args.device,
                dtype,
                args.max_num_seqs,
                args.max_num_batched_tokens,
                args.kv_cache_gib,
                prefix_cache=not args.disable_prefix_cache,
                tensor_parallel_size=tp_size,
                threads=threads,
            )
            label = "engine" if runs is engine_runs else "engine, 1 rank"
            log(f"{label}: {run['output_tokens_per_s']:.1f} output tokens/s")
            runs.append(run)
            if runs is engine_runs:
                engine_tokens = tokens
        if args.moe_loop:
            from bench.throughput.moe_loop import per_expert_loop

            with per_expert_loop():
                run, _ = run_engine(
                    model_dir, workload, args.device, dtype, args.max_num_seqs,
                    args.max_num_batched_tokens, args.kv_cache_gib,
                    prefix_cache=not args.disable_prefix_cache, threads=threads,
                )  # fmt: skip
            log(f"engine, per-expert loop: {run['output_tokens_per_s']:.1f} output tokens/s")
            loop_runs.append(run)
        for size in [] if args.skip_hf else args.hf_batch_sizes:
            run, hf_tokens[size] = run_hf(model_dir, workload, args.device, dtype, size)
            log(f"hf batch {size}: {run['output_tokens_per_s']:.1f} output tokens/s")
            hf_by_size[size].append(run)
    engine = _best(engine_runs)
    hf_runs = [_best(runs) for runs in hf_by_size.values() if runs]  # best per batch size
    hf = max(hf_runs, key=lambda r: r["output_tokens_per_s"], default=None)
    ratio = engine["output_tokens_per_s"] / hf["output_tokens_per_s"] if hf else None
    one_rank = _best(one_rank_runs) if one_rank_runs else None
    tp_ratio = None
    if one_rank is not None:
        tp_ratio = engine["output_tokens_per_s"] / one_rank["output_tokens_per_s"]
    loop = _best(loop_runs) if loop_runs else None
    loop_ratio = engine["output_tokens_per_s"] / loop["output_tokens_per_s"] if loop else None
    result = {
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
        "all_engine_tokens_per_s": [r["output_tokens_per_s"] for r in engine_runs],
        "all_hf_tokens_per_s": {
            size: [r["output_tokens_per_s"] for r in runs] for size, runs in hf_by_size.items()
        },
        "ratio_engine_over_hf": ratio,
        "tensor_parallel_size": args.tensor_parallel_size,
        "engine_one_rank": one_rank,  # best of `repeat`; with --tensor-parallel-size > 1
        "ratio_ranks_over_one_rank": tp_ratio,
        "engine_per_expert_loop": loop,  # best of `repeat`; with --moe-loop
        "ratio_grouped_over_loop": loop_ratio,
        "hf_reference": "decode loop over the forward, KV cached (bench/hf_reference.py)",
        # Greedy only: sampled runs draw from different random streams.
        "token_identity_engine_hf": {
            size: token_identity(engine_tokens, tokens) for size, tokens in hf_tokens.items()
        }
        if workload.temperature == 0
        else None,
        "machine": machine(),
    }
    ranks = f", {args.tensor_parallel_size} ranks" if args.tensor_parallel_size > 1 else ""
    rows: list[list[Any]] = [
        [
            f"sluice LLMEngine{ranks}",
            engine["seconds"],
            engine["output_tokens_per_s"],
            engine["requests_per_s"],
        ]
    ]
    if one_rank is not None:
        rows.append(
            [
                "sluice LLMEngine, 1 rank",
                one_rank["seconds"],
                one_rank["output_tokens_per_s"],
                one_rank["requests_per_s"],
            ]
        )
    if loop is not None:
        rows.append(
            [
                "sluice LLMEngine, per-expert loop",
                loop["seconds"],
                loop["output_tokens_per_s"],
                loop["requests_per_s"],
            ]
        )
    rows += [
        [
            f"HF decode loop, batch {r['batch_size']}",
            r["seconds"],
            r["output_tokens_per_s"],
            r["requests_per_s"],
        ]
        for r in hf_runs
    ]
    header = ["offline " + result["model"], "seconds", "output tok/s", "req/s"]
    emit(result, header, rows)
    if ratio is not None:
        log(f"ratio engine/HF output tokens/s: {ratio:.2f}x")
    for size, identity in (result["token_identity_engine_hf"] or {}).items():
        log(f"token-identical with HF batch {size}: {identity['identical']}/{identity['of']}")
    if loop_ratio is not None:
        log(f"ratio grouped experts / per-expert loop output tokens/s: {loop_ratio:.2f}x")
    if tp_ratio is not None:
        log(f"ratio {args.tensor_parallel_size} ranks / 1 rank output tokens/s: {tp_ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
