"""Incremental detokenization cost per token: the per-id tables against tokenizers' DecodeStream.

Trains a byte-level BPE (GPT-2 / Llama 3 / Qwen style) and a Llama 2 style byte-fallback BPE
on the Python standard library's sources (no downloads), encodes held-out text (English and
code; and a multilingual mix of CJK, Cyrillic, Greek, accents and emoji that the training text
barely has, so most of its tokens are parts of characters: the decoders' slow paths), and times
`Detokenizer.step` over the same ids with the tables (the fast path) and with DecodeStream (the
fallback), in one run. Also times building and checking the tables when a tokenizer loads, on
the trained vocabularies and on a synthetic byte-level vocabulary of --load-vocab tokens.

    python -m bench.text.detokenize
"""

from __future__ import annotations

import argparse
import functools
import random
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.checkpoints import tiny_models
from bench.common import emit, machine
from service.text.fast_decode import byte_level_alphabet, load_tables
from service.text.tokenizer import Tokenizer

MULTILINGUAL = (
    "日本語のテキストを少し書きます。中文文本也在这里。Русский текст, Ελληνικά γράμματα, "
    "café naïve façade jalapeño über smörgåsbord. Emoji: 😀 🚀 🌍 ✨ 👍🏽 ← → ∑ ∞ ≈ €100. "
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000, help="tokens of the trained BPEs")
    p.add_argument("--corpus-mb", type=float, default=6.0, help="standard library text to train on")
    p.add_argument("--tokens", type=int, default=20000, help="ids streamed per timing")
    p.add_argument("--repeat", type=int, default=5, help="timings per case (the best is kept)")
    p.add_argument("--load-vocab", type=int, default=151643, help="synthetic vocabulary size")
    return p.parse_args(argv)


def stdlib_text(megabytes: float) -> str:
    """Python sources of the standard library, in a fixed order, about `megabytes` long."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts or size > megabytes * 1e6:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
    return "".join(parts)


def per_token_ns(tokenizer: Tokenizer, ids: list[int], repeat: int) -> float:
    """The best mean time of one `Detokenizer.step` (one completion over all ids), flush aside."""
    best = float("inf")
    for _ in range(repeat):
        detok = tokenizer.detokenizer(skip_special_tokens=True)
        step = detok.step
        start = time.perf_counter()
        for token_id in ids:
            step(token_id)
        best = min(best, time.perf_counter() - start)
        detok.flush()
    return best / len(ids) * 1e9


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def synthetic_byte_level(size: int) -> Any:
    """A byte-level BPE vocabulary of `size` random 2-8 byte tokens (no merges: decoding needs
    none) and 200 special tokens, the shape of Qwen2's 151,643 + 200 or so."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    rng = random.Random(0)
    char = {b: c for c, b in byte_level_alphabet().items()}
    vocab = {char[b]: b for b in range(256)}
    while len(vocab) < size:
        token = "".join(char[rng.randrange(256)] for _ in range(rng.randint(2, 8)))
        vocab.setdefault(token, len(vocab))
    tok = HFTokenizer(models.BPE(vocab, []))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([f"<|special_{i}|>" for i in range(200)])
    return tok


def measure_cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per tokenizer (trained on the standard library's sources) and held-out text: ns per
    token of `Detokenizer.step` with the per-id tables and with DecodeStream."""
    tiny = tiny_models()
    corpus = stdlib_text(args.corpus_mb)
    train, held_out = corpus[: int(len(corpus) * 0.9)], corpus[int(len(corpus) * 0.9) :]
    chunks = [train[i : i + 4096] for i in range(0, len(train), 4096)]
    builders: dict[str, Callable[[], Any]] = {
        "byte-level": lambda: tiny.make_tokenizer(args.vocab, chunks),
        "llama2": lambda: tiny.make_llama2_tokenizer(args.vocab, chunks, alphabet=200),
    }
    texts = {"code/English": held_out, "multilingual": MULTILINGUAL * 200}
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in builders.items():
            tok, train_s = timed(build)
            directory = Path(tmp) / name
            directory.mkdir()
            tok.save(str(directory / "tokenizer.json"))
            tokenizer, load_s = timed(functools.partial(Tokenizer, directory))
            vocab = tok.get_vocab(with_added_tokens=True)  # Tokenizer() reads it anyway
            _, tables_s = timed(functools.partial(load_tables, tok, vocab))
            assert tokenizer._decode_tables[True] is not None, f"{name}: no fast path"
            fallback = Tokenizer(directory)
            fallback._decode_tables = {False: None, True: None}  # DecodeStream, the old path
            for text_name, text in texts.items():
                ids = tok.encode(text, add_special_tokens=False).ids[: args.tokens]
                fast = per_token_ns(tokenizer, ids, args.repeat)
                slow = per_token_ns(fallback, ids, args.repeat)
                cases.append(
                    {
                        "tokenizer": name,
                        "vocab": tok.get_vocab_size(),
                        "text": text_name,
                        "tokens": len(ids),
                        "tables_ns_per_token": round(fast),
                        "decode_stream_ns_per_token": round(slow),
                        "speedup": round(slow / fast, 1),
                        "train_s": round(train_s, 1),
                        "tokenizer_load_s": round(load_s, 3),
                        "tables_load_s": round(tables_s, 3),
                    }
                )
    return cases


def measure_load(args: argparse.Namespace) -> dict[str, Any]:
    """The time to build and check the tables of a large synthetic byte-level vocabulary."""
    big = synthetic_byte_level(args.load_vocab)
    big_vocab = big.get_vocab(with_added_tokens=True)  # Tokenizer() reads it anyway
    _, big_s = timed(functools.partial(load_tables, big, big_vocab))
    return {"vocab": big.get_vocab_size(), "tables_load_s": round(big_s, 3), "seconds": big_s}


def emit_result(result: dict[str, Any], load_s: float) -> None:
    rows: list[list[Any]] = [
        [c["tokenizer"], c["text"], c["tokens"], c["tables_ns_per_token"]]
        + [c["decode_stream_ns_per_token"], c["speedup"]]
        for c in result["cases"]
    ]
    load = result["load"]
    rows.append([f"load tables, {load['vocab']} ids", "", "", "", "", f"{load_s:.3f} s"])
    header = ["tokenizer", "text", "tokens", "tables ns/tok", "DecodeStream ns/tok", "speedup"]
    emit(result, header, rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = measure_cases(args)
    load = measure_load(args)
    load_s = load.pop("seconds")
    result = {"benchmark": "detokenize", "machine": machine(), "cases": cases, "load": load}
    emit_result(result, load_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
