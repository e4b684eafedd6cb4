"""Stop-string matching cost per token, at the admission limits and beyond.

Feeds detokenized pieces (4 characters, about one token) to `StopStringMatcher` and reports the
mean time per piece. Cases:
- typical: 4 short stop strings over English-like text (nothing is held back);
- held: the stop strings at the limits (count x length) and a text that keeps a long partial
  match held back (one stop string is "a" * (length - 1) + "b", the text is "aaaa..."), the
  worst case of the old suffix scan;
- no-match: the same stop strings over random letters.
The automaton's construction (once per set of stop strings) is reported apart.

    python -m bench.text.stop_strings --count 32 --length 256
"""

from __future__ import annotations

import argparse
import random
import string
import time
from typing import Any

from bench.common import emit, machine
from service.text.stop_strings import StopAutomaton, StopStringMatcher

PIECE_CHARS = 4
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "then", "sleeps")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=32, help="stop strings")
    p.add_argument("--length", type=int, default=256, help="characters per stop string")
    p.add_argument("--pieces", type=int, default=2000, help="pieces fed per case")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def random_text(rng: random.Random, chars: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(chars))


def cases(args: argparse.Namespace) -> dict[str, tuple[list[str], str]]:
    rng = random.Random(args.seed)
    english = " ".join(rng.choice(WORDS) for _ in range(args.pieces * PIECE_CHARS // 4))
    limit = [random_text(rng, args.length) for _ in range(args.count - 1)]
    limit.append("a" * (args.length - 1) + "b")
    return {
        "typical": (["</s>", "\n\nUser:", "###", "<|end|>"], english),
        "held": (limit, "a" * (args.pieces * PIECE_CHARS)),
        "no-match": (limit, random_text(rng, args.pieces * PIECE_CHARS)),
    }


def measure(stops: list[str], text: str, pieces: int) -> dict[str, Any]:
    started = time.perf_counter()
    StopAutomaton(set(stops))
    built = time.perf_counter() - started
    matcher = StopStringMatcher(stops)
    chunks = [text[i : i + PIECE_CHARS] for i in range(0, PIECE_CHARS * pieces, PIECE_CHARS)]
    started = time.perf_counter()
    for chunk in chunks:
        result = matcher.feed(chunk)
        assert isinstance(result, str), "the benchmark's texts never contain a stop string"
    seconds = time.perf_counter() - started
    return {
        "stops": len(stops),
        "max_length": max(len(s) for s in stops),
        "pieces": len(chunks),
        "us_per_piece": round(seconds / len(chunks) * 1e6, 2),
        "build_ms": round(built * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = {
        name: measure(stops, text, args.pieces) for name, (stops, text) in cases(args).items()
    }
    rows = [
        [name, r["stops"], r["max_length"], r["us_per_piece"], r["build_ms"]]
        for name, r in results.items()
    ]
    emit(
        {"machine": machine(), "piece_chars": PIECE_CHARS, "cases": results},
        ["case", "stops", "max length", "us/piece", "build ms"],
        rows,
    )


if __name__ == "__main__":
    main()
