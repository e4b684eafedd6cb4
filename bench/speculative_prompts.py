"""The prompts of bench/speculative.py: the demo corpus cut into passages, as copy-heavy and
free prompts, one passage per request of a whole run; and prompt lookup's hit rate, which says
whether a model's outputs on them copy (whatever a proposer does).
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

MODES = ("greedy", "sampled")
TASKS = ("copy", "free")


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


def build_cells(
    args: argparse.Namespace, encode: Callable[[str], list[int]], room: int
) -> tuple[list[Cell], list[list[int]]]:
    """The cells, and the warm-up prompts; every prompt from a passage of its own. A passage
    whose copy prompt is longer than `room` tokens (the context less the output and the
    proposals) is skipped."""
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
