"""Speculative decoding: each method against none, in one run, on copy-heavy and free prompts.

Each round builds one engine per method (`off` and each of `--methods`), all alive at once,
and runs every cell (task x mode x batch) on each engine in turn, so each ratio is between runs
seconds apart; `--repeat` rounds, each with fresh engines (a `suffix` store then holds none of
the last round's outputs) and the methods in turn going first, and each method's fastest round
counts.
- Tasks (bench/speculative_prompts.py), from the demo corpus cut into `--passage-words`-word
  passages: `copy`, a passage, a newline and its first `--cue-words` words, whose right
  continuation repeats the passage; `free`, the passage alone. Every request of a round has a
  passage of its own: `suffix` keeps finished outputs and would otherwise be proposed the
  answer it gave the same prompt before.
- Modes: `greedy`, and `sampled` at `--temperature` with a fixed seed per request (the same
  seeds for every method).
- Batches: a cell at batch B runs ceil(`--min-requests` / B) waves of B requests at once, each
  `--max-tokens` tokens (ignore_eos), one wave after another; tokens/s over all its waves.
  With `--arrival continuous` the same requests run B at a time instead, the next one added
  as soon as one ends (continuous batching, as a server under steady load runs): a request
  whose proposals were kept ends early and frees its place, where a wave waits for its
  slowest request.

Reported per (task, mode, batch, method): output tokens/s and its ratio to `off`; the same per
CPU-second of this process (steadier on a shared machine: every engine runs on this thread);
the acceptance rate (accepted / proposed tokens, summed over the final outputs'
RequestMetrics); and whether the token ids equal off's in every round (speculation must never
change them; the JSON is printed either way, naming the cells that differ). Per cell,
`lookup_rate` says whether the task copies, whatever the proposers do: the share of off's
output tokens that prompt lookup predicts.

`--shape demo` (the default) runs free generation on the demo model and the copy task on the
demo's copy model (`python -m engine.demo copy`: the demo's shape, trained mostly on spans
followed by their repeats, since the demo itself does not copy); `draft` proposes from the
demo's draft model (`python -m engine.demo draft`); each is trained on first use. `--model DIR`
or another `--shape` (random weights) serves both tasks, and `draft` then needs `--draft-model
DIR` (a checkpoint with the same tokenizer). The JSON's `task_models` names each task's.

    python -m bench.speculative --methods ngram suffix draft --batches 1 8 64 --threads 1
    python -m bench.speculative --shape qwen2.5-0.5b --device cuda --methods ngram suffix \
        --batches 1 64
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from bench.checkpoints import SHAPES, resolve_model
from bench.common import emit, log, machine, process_cpu_seconds, set_threads
from bench.speculative_prompts import MODES, TASKS, Cell, build_cells, lookup_rate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="demo", choices=["demo", *sorted(SHAPES)])
    p.add_argument("--model", type=Path, help="a checkpoint directory (overrides --shape)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--methods",
        nargs="+",
        default=["ngram", "suffix", "draft"],
        choices=["ngram", "suffix", "draft"],
        help="each against off",
    )
    p.add_argument("--draft-model", type=Path, help="draft: default the demo's draft model")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--temperature", type=float, default=0.8, help="the sampled mode's")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--passage-words", type=int, default=24)
    p.add_argument("--cue-words", type=int, default=4, help="copy: the passage's words repeated")
    p.add_argument("--min-requests", type=int, default=16, help="per cell: waves of the batch")
    p.add_argument(
        "--arrival",
        default="waves",
        choices=["waves", "continuous"],
        help="a cell's requests in waves of the batch, or the batch kept full",
    )
    p.add_argument("--num-speculative-tokens", type=int, help="default: the engine's")
    p.add_argument("--speculative-max-batch", type=int, help="default: the engine's")
    p.add_argument("--repeat", type=int, default=1, help="rounds, fresh engines; best counts")
    return p.parse_args(argv)


def make_engine(
    args: argparse.Namespace,
    method: str,
    model_dir: Path,
    dtype: str,
    draft: Path | None,
    pages: int,
) -> Any:
    """An engine speculating with `method` ("off": none), its KV pool `pages` pages; the
    engine's defaults elsewhere, but for the speculative settings a flag gives."""
    from engine import EngineConfig, LLMEngine

    tuned = {
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_max_batch": args.speculative_max_batch,
    }
    config = EngineConfig(
        model=str(model_dir),
        device=args.device,
        dtype=dtype,
        max_num_seqs=max(args.batches),
        num_kv_pages=pages,
        speculative_method=method,
        speculative_draft_model=str(draft) if method == "draft" else None,
        **{name: value for name, value in tuned.items() if value is not None},
    )
    return LLMEngine(config)


def run_requests(
    engine: Any, prompts: list[list[int]], params: list[Any], batch: int, tag: str
) -> list[Any]:
    """Run the requests `batch` at a time, the next added as one ends (a batch of all: a wave),
    stepping until each has ended; per request (token ids, metrics). Raises on a request that
    ended in error: its tokens would skew the rate."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    metrics: dict[str, Any] = {}
    added = 0
    while len(metrics) < len(ids):
        while added < len(ids) and added - len(metrics) < batch:
            engine.add_request(ids[added], prompts[added], params[added])
            added += 1
        for out in engine.step():
            if out.request_id not in tokens:
                continue
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                if out.error:
                    raise RuntimeError(f"{tag}: {out.finish_reason}: {out.error}")
                metrics[out.request_id] = out.metrics
    return [(tokens[rid], metrics[rid]) for rid in ids]


def run_cell(engine: Any, cell: Cell, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """Time the cell's requests on one engine (in waves, or the batch kept full): the record,
    and each request's token ids."""
    from engine import SamplingParams

    temperature = args.temperature if cell.mode == "sampled" else 0.0
    params = [
        SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=i)
        for i in range(len(cell.prompts))
    ]
    done: list[Any] = []
    start, cpu = time.perf_counter(), process_cpu_seconds()
    if args.arrival == "continuous":
        done = run_requests(engine, cell.prompts, params, cell.batch, tag)
    else:
        for w, wave in enumerate(cell.waves):
            wave_params = params[len(done) : len(done) + len(wave)]
            done += run_requests(engine, wave, wave_params, len(wave), f"{tag}-w{w}")
    seconds, cpu_seconds = time.perf_counter() - start, process_cpu_seconds() - cpu
    produced = sum(len(t) for t, _ in done)
    proposed = sum(m.proposed_tokens for _, m in done if m is not None)
    accepted = sum(m.accepted_tokens for _, m in done if m is not None)
    return {
        "seconds": seconds,
        "output_tokens": produced,
        "output_tokens_per_s": produced / seconds,
        # This process's CPU time: on a shared machine, steadier than the wall clock (on a GPU
        # it counts the host's share only).
        "cpu_seconds": cpu_seconds,
        "output_tokens_per_cpu_s": produced / cpu_seconds,
        "proposed_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "token_ids": [t for t, _ in done],  # compared with off's, not in the JSON
    }


def measure(
    args: argparse.Namespace, models: dict[str, Path], dtype: str, draft: Path | None
) -> dict[str, Any]:
    """Build the cells (`models`: each task's checkpoint; they share one tokenizer); per
    model, each round a fresh engine per method (a suffix store holds none of the last round's
    outputs), warmed up, then each of that model's cells on each engine in turn."""
    from tokenizers import Tokenizer

    from engine.models.hf_config import load_model_config
    from engine.protocol.config import EngineConfig

    defaults = EngineConfig()
    k = args.num_speculative_tokens or defaults.num_speculative_tokens
    used = [models[task] for task in args.tasks]
    context = min(load_model_config(d).max_model_len for d in used)
    tokenizer = Tokenizer.from_file(str(used[0] / "tokenizer.json"))
    room = context - args.max_tokens - k - 1
    cells, warmup = build_cells(args, lambda text: tokenizer.encode(text).ids, room)
    # Room for the largest batch of the longest requests, twice: a draft's KV comes from the
    # same pool. (Not the full context: 32k positions x 64 requests is tens of GB per engine.)
    longest = max(len(p) for c in cells for p in c.prompts) + args.max_tokens + k + 1
    pages = 2 * max(args.batches) * math.ceil(longest / defaults.page_size) + 16
    methods = ["off", *args.methods]
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for model_dir in dict.fromkeys(used):  # each model once, in the tasks' order
        mine = [(c, cell) for c, cell in enumerate(cells) if models[cell.task] == model_dir]
        for r in range(args.repeat):
            order = methods[r % len(methods) :] + methods[: r % len(methods)]  # who goes first
            engines = {m: make_engine(args, m, model_dir, dtype, draft, pages) for m in order}
            label = f"{model_dir.name}, round {r + 1}"
            try:
                counts[model_dir.name] = run_round(args, engines, mine, warmup, runs, label)
            finally:
                for engine in engines.values():
                    engine.close()
    result: dict[str, Any] = {"records": [], "cells": [], "differ": []}
    for c, cell in enumerate(cells):
        lookup = (defaults.ngram_min, defaults.ngram_max)  # ngram's defaults
        model = models[cell.task].name
        compare(cell, model, {m: runs[(c, m)] for m in methods}, lookup, result)
    # By model directory: the last round's engines, warm-up included.
    result["engine_spec_counts"] = counts
    result["num_speculative_tokens"] = k
    result["speculative_max_batch"] = args.speculative_max_batch or defaults.speculative_max_batch
    result["max_model_len"] = context
    return result


def run_round(
    args: argparse.Namespace,
    engines: dict[str, Any],
    cells: list[tuple[int, Cell]],
    warmup: list[list[int]],
    runs: dict[tuple[int, str], list[dict[str, Any]]],
    label: str,
) -> dict[str, dict[str, int]]:
    """Warm each engine up, then run every cell (by its index in the run) on each in turn,
    appending to `runs` by (cell index, method); the engines' own proposed/accepted counts
    after it."""
    from engine import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for method, engine in engines.items():  # first-use costs, off the clock
        run_requests(engine, warmup, [greedy] * len(warmup), len(warmup), f"warmup-{method}")
    for c, cell in cells:
        for m, engine in engines.items():
            runs.setdefault((c, m), []).append(run_cell(engine, cell, args, f"c{c}-{m}"))
        rates = " ".join(f"{m} {runs[(c, m)][-1]['output_tokens_per_s']:.0f}" for m in engines)
        log(f"{label}, {cell.task} {cell.mode} batch {cell.batch}: {rates} tok/s")
    stats = {m: engine.stats() for m, engine in engines.items()}
    return {
        m: {"proposed": s.spec_proposed_tokens, "accepted": s.spec_accepted_tokens}
        for m, s in stats.items()
    }


def compare(
    cell: Cell,
    model: str,
    runs: dict[str, list[dict[str, Any]]],
    lookup: tuple[int, int],
    result: dict[str, Any],
) -> None:
    """Add the cell's records and its lookup rate (on `model`, the target's directory name). A
    method's record is its fastest round (by the wall clock; its CPU fields the round fastest
    per CPU-second), each ratio against off's fastest by the same measure; its ids must equal
    off's in every round."""
    offs = runs["off"]
    outputs = zip(cell.prompts, offs[0]["token_ids"], strict=True)
    rate = sum(lookup_rate(p, t, *lookup) for p, t in outputs) / len(cell.prompts)
    where = {"task": cell.task, "mode": cell.mode, "batch": cell.batch}
    result["cells"].append(
        {
            **where,
            "model": model,
            "requests": len(cell.prompts),
            "waves": len(cell.waves),
            "mean_prompt_tokens": sum(map(len, cell.prompts)) / len(cell.prompts),
            "lookup_rate": rate,
        }
    )
    off, off_cpu = _best(offs, "output_tokens_per_s"), _best(offs, "output_tokens_per_cpu_s")
    for method, rounds in runs.items():
        same = all(m["token_ids"] == o["token_ids"] for m, o in zip(rounds, offs, strict=True))
        if not same:
            result["differ"].append(f"{cell.task}/{cell.mode}/batch {cell.batch}/{method}")
        best = _best(rounds, "output_tokens_per_s")
        record = {k: v for k, v in best.items() if k != "token_ids"}
        record["ratio_to_off"] = best["output_tokens_per_s"] / off["output_tokens_per_s"]
        best_cpu = _best(rounds, "output_tokens_per_cpu_s")  # its CPU fields: that round's
        record.update({k: best_cpu[k] for k in ("cpu_seconds", "output_tokens_per_cpu_s")})
        ratio = best_cpu["output_tokens_per_cpu_s"] / off_cpu["output_tokens_per_cpu_s"]
        record["cpu_ratio_to_off"] = ratio
        record["all_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in rounds]
        result["records"].append({**where, "method": method, **record, "same_tokens_as_off": same})


def _best(rounds: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return max(rounds, key=lambda run: float(run[key]))


def resolve(args: argparse.Namespace) -> tuple[dict[str, Path], str, Path | None]:
    """(each task's target checkpoint, dtype, draft checkpoint or None). `--shape demo` serves
    the copy task from the demo's copy model (the demo recipe, trained on copy units too: the
    demo itself does not copy, so prompt lookup would have nothing to find) and free generation
    from the demo; `--model` or another shape serves both."""
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    draft = args.draft_model
    if args.model is None and args.shape == "demo":
        from engine.demo.checkpoint import ensure_demo_checkpoint

        if "draft" in args.methods and draft is None:
            draft = ensure_demo_checkpoint(size="draft")
        sizes = {task: "copy" if task == "copy" else "demo" for task in TASKS}
        built = {size: ensure_demo_checkpoint(size=size) for size in sorted(set(sizes.values()))}
        return {task: built[size] for task, size in sizes.items()}, dtype, draft
    if "draft" in args.methods and draft is None:
        raise SystemExit("--methods draft: --draft-model DIR is required beside --shape/--model")
    target = resolve_model(args)[0]
    return dict.fromkeys(TASKS, target), dtype, draft


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.logs import configure_logging

    configure_logging("info", "console", process="bench")  # stderr: stdout is the JSON
    threads = set_threads(args.threads)
    models, dtype, draft = resolve(args)
    names = ", ".join(f"{task} on {models[task].name}" for task in args.tasks)
    log(f"speculative: off and {' '.join(args.methods)}; {names}; {threads} threads")
    measured = measure(args, models, dtype, draft)
    differ = measured.pop("differ")
    result = {
        "benchmark": "speculative",
        "model": str(args.model) if args.model else args.shape,
        "task_models": {task: str(models[task]) for task in args.tasks},  # each task's target
        "draft_model": str(draft) if draft else None,
        "device": args.device,
        "dtype": dtype,
        "threads": threads,
        "methods": ["off", *args.methods],
        "batches": args.batches,
        "tasks": args.tasks,
        "modes": args.modes,
        "temperature_sampled": args.temperature,
        "max_tokens": args.max_tokens,
        "passage_words": args.passage_words,
        "cue_words": args.cue_words,
        "min_requests": args.min_requests,
        "arrival": args.arrival,
        "repeat": args.repeat,
        **measured,
        "identical_tokens": not differ,  # every method's ids equal off's, in every cell
        "cells_with_other_tokens": differ,
        "machine": machine(),
    }
    header = ["task", "mode", "batch", "method", "tok/s", "x off", "x off per CPU-s"]
    header += ["accepted", "same ids"]
    keys = ["task", "mode", "batch", "method", "output_tokens_per_s", "ratio_to_off"]
    keys += ["cpu_ratio_to_off", "acceptance_rate", "same_tokens_as_off"]
    rows = [[math.nan if r[k] is None else r[k] for k in keys] for r in result["records"]]
    emit(result, header, rows)
    log(f"token ids equal off's everywhere: {not differ}")
    if differ:
        log("token ids differ from off's in: " + ", ".join(differ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
