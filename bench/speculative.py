"""Speculative decoding: each method against none, in one run, on copy-heavy and free prompts.

One engine per method (`off` and each of `--methods`), all alive at once; every cell (task x
mode x batch) runs on each engine in turn, so every ratio is between runs minutes apart at most.
- Tasks, from the demo corpus (engine/demo/demo_corpus.txt, cut into `--passage-words`-word
  passages, shuffled with a fixed seed): `copy`, a passage, a newline and the passage's first
  `--cue-words` words, whose right continuation repeats the passage; `free`, the passage alone.
- Modes: `greedy`, and `sampled` at `--temperature` with a fixed seed per request (the same
  seeds for every method).
- Batches: a cell at batch B runs ceil(`--min-requests` / B) waves of B requests at once, each
  `--max-tokens` tokens (ignore_eos), one wave after another; tokens/s over all its waves.
- Every request of every cell has its own passage (none is reused anywhere in the run): the
  `suffix` method keeps finished outputs and would otherwise be proposed the answer it gave
  the same prompt before.

Reported per (task, mode, batch, method): output tokens/s, the ratio to `off`, the acceptance
rate (accepted / proposed tokens, summed over the final outputs' RequestMetrics), and whether
the token ids equal off's (speculation must never change them; the JSON is printed either
way, with the cells that differ). Per cell, `lookup_rate` measures whether the task copies,
whatever the proposers do: the share of off's output tokens that prompt lookup predicts (the
token after the latest earlier occurrence of the longest n-gram, ngram_max down to ngram_min,
that ends the tokens so far).

`--shape demo` (the default) is the demo model, and `draft` its draft model
(`python -m engine.demo draft`), both trained on first use; another `--shape` builds random
weights, and `draft` then needs `--draft-model DIR` (a checkpoint with the same tokenizer).

    python -m bench.speculative --methods ngram suffix draft --batches 1 8 64 --threads 1
    python -m bench.speculative --shape qwen2.5-0.5b --device cuda --methods ngram suffix \
        --batches 1 64
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.checkpoints import SHAPES, resolve_model
from bench.common import emit, log, machine, set_threads

MODES = ("greedy", "sampled")
TASKS = ("copy", "free")


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
    p.add_argument("--min-requests", type=int, default=8, help="per cell: waves of the batch")
    p.add_argument("--num-speculative-tokens", type=int, help="default: the engine's")
    p.add_argument("--speculative-max-batch", type=int, help="default: the engine's")
    return p.parse_args(argv)


@dataclass(frozen=True)
class Cell:
    """One measurement: `waves` of `batch` requests each, every method on the same prompts."""

    task: str
    mode: str
    batch: int
    prompts: list[list[int]]  # len = waves * batch, each from its own passage

    @property
    def waves(self) -> list[list[list[int]]]:
        return [self.prompts[i : i + self.batch] for i in range(0, len(self.prompts), self.batch)]


def passages(words: int, seed: int = 0) -> list[str]:
    """The demo corpus in `words`-word passages (whole ones, within paragraphs), shuffled."""
    from engine.demo.checkpoint import load_corpus, paragraphs

    out = []
    for paragraph in paragraphs(load_corpus()):
        split = paragraph.split()
        out += [" ".join(split[i : i + words]) for i in range(0, len(split) - words + 1, words)]
    random.Random(seed).shuffle(out)
    return out


def prompt_text(task: str, passage: str, cue_words: int) -> str:
    if task == "copy":  # the right continuation repeats the passage after its cue
        return passage + "\n" + " ".join(passage.split()[:cue_words])
    return passage


def build_cells(args: argparse.Namespace, encode: Any, room: int) -> tuple[list[Cell], list[Any]]:
    """The cells, and the warm-up prompts; every prompt from a passage of its own. Passages
    whose copy prompt leaves fewer than `room` positions of the context are skipped."""
    supply = iter(
        p
        for p in passages(args.passage_words)
        if len(encode(prompt_text("copy", p, args.cue_words))) <= room
    )
    cells = []
    try:
        warmup = [encode(next(supply)) for _ in range(max(args.batches))]
        for task in args.tasks:
            for mode in args.modes:
                for batch in args.batches:
                    count = batch * math.ceil(args.min_requests / batch)
                    texts = [prompt_text(task, next(supply), args.cue_words) for _ in range(count)]
                    cells.append(Cell(task, mode, batch, [encode(t) for t in texts]))
    except StopIteration:
        raise ValueError(
            "the demo corpus has too few passages for these cells: lower --min-requests, "
            "--batches or --passage-words, or run fewer --tasks / --modes at a time"
        ) from None
    return cells, warmup


def lookup_rate(prompt: list[int], output: list[int], shortest: int, longest: int) -> float:
    """The share of `output` that prompt lookup predicts: at each position, the token after
    the latest earlier occurrence of the longest n-gram (`longest` down to `shortest`) that
    ends the tokens so far. Linear: one table per n, filled as the position advances."""
    seq = prompt + output
    last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(shortest, longest + 1)}
    hits = 0
    for t in range(len(seq)):
        keys = {n: tuple(seq[t - n : t]) for n in last if t >= n}
        if t >= len(prompt):
            found = next(
                (last[n][keys[n]] for n in sorted(keys, reverse=True) if keys[n] in last[n]), None
            )
            hits += found is not None and seq[found] == seq[t]
        for n, key in keys.items():  # this occurrence, for later positions: next token at t
            last[n][key] = t
    return hits / len(output) if output else 0.0


def make_engine(
    args: argparse.Namespace,
    method: str,
    model_dir: Path,
    dtype: str,
    draft: Path | None,
    pages: int,
) -> Any:
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


def run_wave(engine: Any, prompts: list[list[int]], params: list[Any], tag: str) -> list[Any]:
    """Add the wave's requests, step until each has ended; per request (token ids, metrics).
    Raises on a request that ended in error: its tokens would skew the rate."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    metrics: dict[str, Any] = {}
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    while len(metrics) < len(ids):
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
    """Time the cell's waves on one engine: the record, and each request's token ids."""
    from engine import SamplingParams

    temperature = args.temperature if cell.mode == "sampled" else 0.0
    done: list[Any] = []
    seconds = 0.0
    for w, wave in enumerate(cell.waves):
        params = [
            SamplingParams(
                temperature=temperature,
                max_tokens=args.max_tokens,
                ignore_eos=True,
                seed=len(done) + i,
            )
            for i in range(len(wave))
        ]
        start = time.perf_counter()
        done += run_wave(engine, wave, params, f"{tag}-w{w}")  # host token ids: synced
        seconds += time.perf_counter() - start
    produced = sum(len(t) for t, _ in done)
    proposed = sum(m.proposed_tokens for _, m in done if m is not None)
    accepted = sum(m.accepted_tokens for _, m in done if m is not None)
    return {
        "seconds": seconds,
        "output_tokens": produced,
        "output_tokens_per_s": produced / seconds,
        "proposed_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "token_ids": [t for t, _ in done],  # compared with off's, not in the JSON
    }


def measure(
    args: argparse.Namespace, model_dir: Path, dtype: str, draft: Path | None
) -> dict[str, Any]:
    """Build the cells and an engine per method, warm each up, run every cell on each."""
    from tokenizers import Tokenizer

    from engine import SamplingParams
    from engine.models.hf_config import load_model_config
    from engine.protocol.config import EngineConfig

    defaults = EngineConfig()
    k = args.num_speculative_tokens or defaults.num_speculative_tokens
    context = load_model_config(model_dir).max_model_len
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    room = context - args.max_tokens - k - 1
    cells, warmup = build_cells(args, lambda text: tokenizer.encode(text).ids, room)
    # Room for the largest batch at full context, twice: a draft's KV comes from the same pool.
    pages = 2 * max(args.batches) * math.ceil(context / defaults.page_size) + 16
    methods = ["off", *args.methods]
    engines = {m: make_engine(args, m, model_dir, dtype, draft, pages) for m in methods}
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for method, engine in engines.items():  # first-use costs of the largest batch, off the clock
        run_wave(engine, warmup, [greedy] * len(warmup), f"warmup-{method}")
    result: dict[str, Any] = {"records": [], "cells": [], "differ": []}
    lookup = (defaults.ngram_min, defaults.ngram_max)
    for c, cell in enumerate(cells):
        runs = {m: run_cell(engines[m], cell, args, f"c{c}-{m}") for m in methods}
        compare(cell, runs, lookup, result)
        rates = " ".join(f"{m} {r['output_tokens_per_s']:.0f}" for m, r in runs.items())
        log(f"{cell.task} {cell.mode} batch {cell.batch}: {rates} tok/s")
    result["engine_spec_counts"] = {}
    for method, engine in engines.items():
        stats = engine.stats()
        counts = {"proposed": stats.spec_proposed_tokens, "accepted": stats.spec_accepted_tokens}
        result["engine_spec_counts"][method] = counts  # warm-up included
        engine.close()
    result["num_speculative_tokens"] = k
    result["speculative_max_batch"] = args.speculative_max_batch or defaults.speculative_max_batch
    result["max_model_len"] = context
    return result


def compare(
    cell: Cell, runs: dict[str, dict[str, Any]], lookup: tuple[int, int], result: dict[str, Any]
) -> None:
    """Add the cell's records (ratios to off, same ids as off's) and its lookup rate."""
    off = runs["off"]
    outputs = zip(cell.prompts, off["token_ids"], strict=True)
    rate = sum(lookup_rate(p, t, *lookup) for p, t in outputs) / len(cell.prompts)
    where = {"task": cell.task, "mode": cell.mode, "batch": cell.batch}
    result["cells"].append(
        {
            **where,
            "requests": len(cell.prompts),
            "waves": len(cell.waves),
            "mean_prompt_tokens": sum(map(len, cell.prompts)) / len(cell.prompts),
            "lookup_rate": rate,
        }
    )
    for method, run in runs.items():
        same = run["token_ids"] == off["token_ids"]
        if not same:
            result["differ"].append(f"{cell.task}/{cell.mode}/batch {cell.batch}/{method}")
        record = {k: v for k, v in run.items() if k != "token_ids"}
        ratio = run["output_tokens_per_s"] / off["output_tokens_per_s"]
        result["records"].append(
            {**where, "method": method, **record, "ratio_to_off": ratio, "same_tokens_as_off": same}
        )


def resolve(args: argparse.Namespace) -> tuple[Path, str, Path | None]:
    """(target checkpoint, dtype, draft checkpoint or None)."""
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    draft = args.draft_model
    if args.model is None and args.shape == "demo":
        from engine.demo.checkpoint import ensure_demo_checkpoint

        if "draft" in args.methods and draft is None:
            draft = ensure_demo_checkpoint(size="draft")
        return ensure_demo_checkpoint(), dtype, draft
    if "draft" in args.methods and draft is None:
        raise SystemExit("--methods draft: --draft-model DIR is required beside --shape/--model")
    return resolve_model(args)[0], dtype, draft


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.logs import configure_logging

    configure_logging("info", "console", process="bench")  # stderr: stdout is the JSON
    threads = set_threads(args.threads)
    model_dir, dtype, draft = resolve(args)
    log(f"speculative: off and {' '.join(args.methods)} on {model_dir.name}, {threads} threads")
    measured = measure(args, model_dir, dtype, draft)
    differ = measured.pop("differ")
    result = {
        "benchmark": "speculative",
        "model": str(args.model) if args.model else args.shape,
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
        **measured,
        "identical_tokens": not differ,  # every method's ids equal off's, in every cell
        "cells_with_other_tokens": differ,
        "machine": machine(),
    }
    header = ["task", "mode", "batch", "method", "tok/s", "x off", "accepted", "same ids"]
    keys = ["task", "mode", "batch", "method", "output_tokens_per_s", "ratio_to_off"]
    keys += ["acceptance_rate", "same_tokens_as_off"]
    rows = [[math.nan if r[k] is None else r[k] for k in keys] for r in result["records"]]
    emit(result, header, rows)
    log(f"token ids equal off's everywhere: {not differ}")
    if differ:
        log("token ids differ from off's in: " + ", ".join(differ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
