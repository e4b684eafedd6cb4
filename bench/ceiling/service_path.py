"""The service's per-token path, piece by piece: engine outputs through the pipe, then into chunks.

Times, best of `--repeat`, on the service and engine packages found first on `sys.path` (point
PYTHONPATH at an exported older tree to time that revision with this same script):
- pickling and unpickling one StepOutput of `--outputs` one-token RequestOutputs, per output
  (what the engine and the service pay every step);
- `Completion.absorb` per token, `--tokens-per-call` one-token outputs per call (a coalesced
  chunk), without stop strings and with one, on the tiny byte-level tokenizer.

    python -m bench.ceiling.service_path
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import emit, machine

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--outputs", type=int, default=256, help="RequestOutputs per StepOutput")
    p.add_argument("--tokens-per-call", type=int, default=30)
    p.add_argument("--completions", type=int, default=200)
    p.add_argument("--repeat", type=int, default=7)
    return p.parse_args(argv)


def best(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_pipe(args: argparse.Namespace) -> dict[str, float]:
    """Seconds per output to pickle and unpickle a step of `--outputs` one-token outputs, and
    the pickled bytes per output."""
    from multiprocessing.reduction import ForkingPickler

    from engine.protocol.messages import EngineStats, RequestOutput, StepOutput

    step = StepOutput(
        [RequestOutput(f"req-{i:06d}", 0, [1000 + i], 0) for i in range(args.outputs)],
        EngineStats(),
    )
    data = bytes(ForkingPickler.dumps(step))
    return {
        "dumps": best(lambda: ForkingPickler.dumps(step), args.repeat) / args.outputs,
        "loads": best(lambda: pickle.loads(data), args.repeat) / args.outputs,
        "bytes": len(data) / args.outputs,
    }


def measure_absorb(args: argparse.Namespace) -> dict[str, float]:
    """Seconds per token that `Completion.absorb` takes on English text, without and with a
    stop string."""
    from engine.protocol.messages import RequestOutput
    from service.text.completion import Completion, OutputSettings
    from service.text.tokenizer import Tokenizer

    sys.path.insert(0, str(REPO))
    from tests.support.tiny_models import make_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        make_tokenizer(8000).save(str(Path(tmp) / "tokenizer.json"))
        tokenizer = Tokenizer(tmp)
    text = "The quick brown fox jumps over the lazy dog. " * 40
    ids = tokenizer._tok.encode(text, add_special_tokens=False).ids
    n = args.tokens_per_call
    calls = [
        [RequestOutput("r", 0, [ids[(k * n + j) % len(ids)]], 0) for j in range(n)]
        for k in range(8)
    ]

    def absorb_all(settings: OutputSettings) -> None:
        for _ in range(args.completions):
            completion = Completion("r", 0, tokenizer, settings)
            for outputs in calls:
                completion.absorb(outputs)

    tokens = args.completions * len(calls) * n
    return {
        "plain": best(lambda: absorb_all(OutputSettings()), args.repeat) / tokens,
        "stops": best(lambda: absorb_all(OutputSettings(stop=("zzz",))), args.repeat) / tokens,
    }


def summarize(
    args: argparse.Namespace, pipe: dict[str, float], absorb: dict[str, float]
) -> dict[str, Any]:
    messages = Path(sys.modules["engine.protocol.messages"].__file__ or "")
    return {
        "benchmark": "service_path",
        "settings": vars(args),
        "engine_from": str(messages.parents[2]),  # the tree whose engine/ was timed
        "pickle_us_per_output": 1e6 * pipe["dumps"],
        "unpickle_us_per_output": 1e6 * pipe["loads"],
        "pickled_bytes_per_output": pipe["bytes"],
        "absorb_us_per_token": 1e6 * absorb["plain"],
        "absorb_with_stop_strings_us_per_token": 1e6 * absorb["stops"],
        "machine": machine(),
    }


def emit_result(result: dict[str, Any]) -> None:
    header = ["pickle us/output", "unpickle us/output", "absorb us/token", "with stops"]
    keys = ["pickle_us_per_output", "unpickle_us_per_output", "absorb_us_per_token"]
    emit(result, header, [[result[k] for k in [*keys, "absorb_with_stop_strings_us_per_token"]]])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    emit_result(summarize(args, measure_pipe(args), measure_absorb(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
