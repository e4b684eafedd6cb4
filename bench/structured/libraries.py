"""Constrained decoding libraries side by side: xgrammar and llguidance on the same vocabulary,
schema and token sequence, in the same run.

For each vocabulary size (Llama 3's 128,256 and Qwen2.5's 151,936 by default) a synthetic
byte-level vocabulary is built (every byte, the demo corpus's 2,000 commonest words with and
without a leading space and capitalised, numbers, JSON punctuation runs, letter pairs, then
random letter strings up to the size), since no real
tokenizer of that size can be downloaded here. A JSON schema is compiled by both libraries, then
a valid JSON document is decoded token by token: at each step both compute the mask of allowed
tokens (timed), the same token is chosen (the longest vocabulary piece that continues the
document and that both masks allow: they must agree on it), and both accept it (timed).
Reports compile milliseconds and per-token mask microseconds (median and mean) of each, and
llguidance / xgrammar ratios. Not in CI: the libraries are not dependencies yet.

    pip install xgrammar==0.2.8 llguidance==1.9.1
    python -m bench.structured.libraries --vocab-sizes 128256 151936 --repeat 3
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import statistics
import string
import time
from pathlib import Path
from typing import Any

from bench.common import emit, log, machine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.com",
    "tags": ["mathematics", "engines", "notes on the analytical engine"],
    "address": {"street": "12 St James's Square", "city": "London"},
    "active": True,
}
CORPUS = Path(__file__).resolve().parents[2] / "engine" / "demo" / "demo_corpus.txt"


def synthetic_vocab(size: int, seed: int = 0) -> list[bytes]:
    """`size` distinct byte strings: every byte first (any text can be tokenised), then the
    pieces a real byte-level BPE vocabulary is made of, then random words up to the size."""
    rng = random.Random(seed)
    vocab: dict[bytes, None] = {bytes([b]): None for b in range(256)}
    counts = collections.Counter(re.findall(r"[A-Za-z]+", CORPUS.read_text()))
    words = [w for w, _ in counts.most_common(2000)] + list(DOCUMENT) + ["London", "engine"]

    def add(piece: str) -> None:
        if len(vocab) < size:
            vocab.setdefault(piece.encode(), None)

    for word in words:
        for form in (word, " " + word, word.capitalize(), " " + word.capitalize()):
            add(form)
    for n in range(1000):
        add(str(n))
        add(" " + str(n))
    for piece in ('{"', '":', '",', '"}', '": "', '", "', '":[', '"]', "},", '":{', ", ", ": "):
        add(piece)
    for a in string.ascii_letters:
        for b in string.ascii_lowercase:
            add(a + b)
            add(" " + a + b)
    letters = string.ascii_lowercase
    while len(vocab) < size:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(3, 9)))
        add(rng.choice(("", " ", " ", "_")) + word)
    return list(vocab)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab-sizes", type=int, nargs="+", default=[128256, 151936])
    p.add_argument("--repeat", type=int, default=3, help="decodes per vocabulary; each's best")
    return p.parse_args(argv)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, vocab: list[bytes], eos: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo(
            vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos]
        )
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, len(vocab))

    def compile(self, schema: str) -> None:
        self.matcher = self.xgr.GrammarMatcher(self.compiler.compile_json_schema(schema))

    def mask(self) -> None:
        self.matcher.fill_next_token_bitmask(self.bitmask)

    def allows(self, token: int) -> bool:
        return bool((int(self.bitmask[0, token // 32]) >> (token % 32)) & 1)

    def accept(self, token: int) -> None:
        assert self.matcher.accept_token(token), token


class Llguidance:
    name = "llguidance"

    def __init__(self, vocab: list[bytes], eos: int) -> None:
        import llguidance
        import llguidance.numpy

        self.llg = llguidance
        self.fill = llguidance.numpy.fill_next_token_bitmask
        single = {piece[0]: i for i, piece in enumerate(vocab) if len(piece) == 1}

        class Vocab:  # what llguidance.TokenizerWrapper reads
            eos_token_id = eos
            bos_token_id = None
            tokens = vocab

            def __call__(self, text: bytes) -> list[int]:
                return [single[b] for b in text]  # valid, if not canonical

        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()))
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, len(vocab))

    def compile(self, schema: str) -> None:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        self.matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not self.matcher.is_error(), self.matcher.get_error()

    def mask(self) -> None:
        self.fill(self.matcher, self.bitmask)

    def allows(self, token: int) -> bool:
        return bool((int(self.bitmask[0, token // 32]) >> (token % 32)) & 1)

    def accept(self, token: int) -> None:
        assert self.matcher.consume_token(token), self.matcher.get_error()


def decode(libs: list[Any], vocab: list[bytes], text: bytes) -> dict[str, dict[str, Any]]:
    """Compile, then walk `text` token by token through every library; timings per library."""
    ids = {piece: i for i, piece in enumerate(vocab)}
    longest = max(len(p) for p in vocab)
    schema = json.dumps(SCHEMA)
    times: dict[str, dict[str, Any]] = {}
    for lib in libs:
        start = time.perf_counter()
        lib.compile(schema)
        times[lib.name] = {"compile_ms": (time.perf_counter() - start) * 1e3, "mask_us": []}
        times[lib.name]["accept_us"] = []
    at = 0
    while at < len(text):
        for lib in libs:
            start = time.perf_counter()
            lib.mask()
            times[lib.name]["mask_us"].append((time.perf_counter() - start) * 1e6)
        token = next(
            ids[text[at : at + n]]
            for n in range(min(longest, len(text) - at), 0, -1)
            if text[at : at + n] in ids and all(lib.allows(ids[text[at : at + n]]) for lib in libs)
        )
        for lib in libs:
            start = time.perf_counter()
            lib.accept(token)
            times[lib.name]["accept_us"].append((time.perf_counter() - start) * 1e6)
        at += len(vocab[token])
    return times


def measure_vocab(size: int, text: bytes, repeat: int) -> dict[str, Any]:
    """Both libraries on a synthetic vocabulary of `size` ids: tokenizer setup, then `repeat`
    alternating decodes of `text`, each library's run with the lowest mean mask time."""
    vocab = synthetic_vocab(size - 1) + [b"<|eos|>"]  # the last id ends a sequence
    eos = len(vocab) - 1
    setup: dict[str, float] = {}
    libs: list[Any] = []
    for cls in (Xgrammar, Llguidance):
        start = time.perf_counter()
        libs.append(cls(vocab, eos))
        setup[cls.name] = (time.perf_counter() - start) * 1e3
    best: dict[str, dict[str, Any]] = {}
    for run in range(repeat):
        times = decode(libs if run % 2 == 0 else libs[::-1], vocab, text)
        for name, t in times.items():
            summary = {
                "compile_ms": t["compile_ms"],
                "mask_us_p50": statistics.median(t["mask_us"]),
                "mask_us_mean": statistics.fmean(t["mask_us"]),
                "accept_us_mean": statistics.fmean(t["accept_us"]),
                "tokens": len(t["mask_us"]),
            }
            if name not in best or summary["mask_us_mean"] < best[name]["mask_us_mean"]:
                best[name] = summary
    ratio = best["llguidance"]["mask_us_mean"] / best["xgrammar"]["mask_us_mean"]
    log(f"vocab {size}: mask mean llguidance / xgrammar {ratio:.2f}")
    return {
        "vocab_size": size,
        "tokenizer_setup_ms": setup,
        "libraries": best,
        "mask_mean_llguidance_over_xgrammar": ratio,
        "compile_llguidance_over_xgrammar": best["llguidance"]["compile_ms"]
        / best["xgrammar"]["compile_ms"],
    }


def emit_result(result: dict[str, Any]) -> None:
    rows = [
        [r["vocab_size"], name, s["compile_ms"], s["mask_us_p50"], s["mask_us_mean"]]
        for r in result["results"]
        for name, s in r["libraries"].items()
    ]
    emit(result, ["vocab", "library", "compile ms", "mask us p50", "mask us mean"], rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = json.dumps(DOCUMENT).encode()
    results = [measure_vocab(size, text, args.repeat) for size in args.vocab_sizes]
    result = {
        "benchmark": "structured_libs",
        "versions": _versions(),
        "document_bytes": len(text),
        "repeat": args.repeat,
        "results": results,
        "machine": machine(),
    }
    emit_result(result)
    return 0


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("xgrammar", "llguidance")}


if __name__ == "__main__":
    raise SystemExit(main())
