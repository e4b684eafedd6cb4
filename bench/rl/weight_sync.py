"""Weight sync: the process-group path (sluice_client.weight_transfer: a gloo broadcast in
packed buckets) beside the streamed-tensor path (UpdateWeights inline chunks), in one run.

The same tensors (every tensor of the checkpoint) are pushed alternately through each path to
one live server, `--rounds` times each, under CONTINUE, while a greedy request streams. For each
path: seconds per GiB (client-side, from the call to `applied`), and the pause that in-flight
request saw: the largest gap between two of its tokens around the update, against its median
gap outside it. Ratios are process group / streamed.

    python -m bench.rl.weight_sync --model small --rounds 3 --bucket-mib 64
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.checkpoints import SHAPES, ensure_checkpoint
from bench.common import emit, log, machine, revision
from bench.service.server import logged_process, wait_listening, wait_serving

TOKEN = "bench-admin"


class Streaming:
    """One long greedy request in a thread; the arrival time of each of its chunks."""

    def __init__(self, client: Any, max_tokens: int) -> None:
        self.times: list[float] = []
        self.first = threading.Event()
        self._client, self._max_tokens = client, max_tokens
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        prompt = [0, 17, 42, 99, 123, 7]
        for event in self._client.generate(
            prompt, temperature=0.0, max_tokens=self._max_tokens, ignore_eos=True
        ):
            if event.HasField("tokens"):
                self.times.append(time.monotonic())
                self.first.set()

    def join(self) -> None:
        self._thread.join()

    def pause(self, start: float, end: float) -> tuple[float, float]:
        """The largest gap between chunks spanning [start, end], and the median gap apart."""
        gaps = list(zip(self.times, self.times[1:], strict=False))
        during = [b - a for a, b in gaps if b >= start and a <= end]
        outside = [b - a for a, b in gaps if b < start or a > end]
        return max(during, default=float("nan")), statistics.median(outside)


def one_round(
    path: str, client: Any, transfer: Any, tensors: dict[str, Any], args: Any
) -> dict[str, float]:
    stream = Streaming(client, args.stream_tokens)
    stream.first.wait(120)
    time.sleep(args.settle)  # NOTE: a baseline of gaps before the update, not synchronisation
    start = time.monotonic()
    if path == "process_group":
        transfer.push(tensors, inflight="continue")
    else:
        raw = {n: ("F32", list(t.shape), t.numpy().tobytes()) for n, t in tensors.items()}
        client.update_weights_inline(raw, inflight="continue")
    end = time.monotonic()
    stream.join()
    pause, median_gap = stream.pause(start, end)
    return {"seconds": end - start, "pause_s": pause, "median_gap_s": median_gap}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mib", type=float, default=64.0)
    parser.add_argument("--stream-tokens", type=int, default=400)
    parser.add_argument("--settle", type=float, default=0.5, help="seconds of baseline gaps")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace, checkpoint: Path, tensors: dict[str, Any]) -> dict[str, Any]:
    """Each path's rounds, alternating, against one server started on `checkpoint`."""
    from sluice_client import Client
    from sluice_client.weight_transfer import WeightTransfer

    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with tempfile.TemporaryDirectory() as tmp:
        token_file = Path(tmp) / "admin.token"
        token_file.write_text(TOKEN)
        cmd = [sys.executable, "-m", "service", "--model", str(checkpoint), "--host", "127.0.0.1",
               "--port", "0", "--device", "cpu", "--dtype", "float32",
               "--admin-token-file", str(token_file), "--no-enable-prefix-cache"]  # fmt: skip
        with logged_process(cmd, {**__import__("os").environ}, "sluice-sync-", None, 30) as (
            proc,
            path,
        ):
            target = wait_listening(proc, path, 300)
            asyncio.run(wait_serving(target, 300))
            log(f"serving {args.model} ({nbytes / 2**20:.1f} MiB of weights) at {target}")
            bucket = int(args.bucket_mib * 2**20)
            with (
                Client(target, admin_token=TOKEN) as client,
                WeightTransfer(
                    target, admin_token=TOKEN, bucket_bytes=bucket, client=client
                ) as transfer,
            ):
                runs: dict[str, list[dict[str, float]]] = {"process_group": [], "streamed": []}
                for n in range(args.rounds):
                    for name in ("process_group", "streamed"):
                        runs[name].append(one_round(name, client, transfer, tensors, args))
                        log(f"round {n + 1} {name}: {runs[name][-1]}")
    return runs


def summarize(
    args: argparse.Namespace, tensors: dict[str, Any], runs: dict[str, Any]
) -> dict[str, Any]:
    """Each path's medians over its rounds, and process group over streamed."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    gib = nbytes / 2**30
    paths = {
        name: {
            "seconds": statistics.median(r["seconds"] for r in rounds),
            "seconds_per_gib": statistics.median(r["seconds"] for r in rounds) / gib,
            "pause_s": statistics.median(r["pause_s"] for r in rounds),
            "median_gap_s": statistics.median(r["median_gap_s"] for r in rounds),
            "rounds": rounds,
        }
        for name, rounds in runs.items()
    }
    pg, st = paths["process_group"], paths["streamed"]
    return {
        "benchmark": "weight_sync",
        "model": args.model,
        "weights_mib": round(nbytes / 2**20, 2),
        "tensors": len(tensors),
        "bucket_mib": args.bucket_mib,
        "paths": paths,
        "ratio_seconds_per_gib": pg["seconds_per_gib"] / st["seconds_per_gib"],
        "ratio_pause": pg["pause_s"] / st["pause_s"],
        "machine": machine(),
        "revision": revision(),
    }


def emit_result(result: dict[str, Any]) -> None:
    rows = [
        [name, p["seconds"], p["seconds_per_gib"], p["pause_s"], p["median_gap_s"]]
        for name, p in result["paths"].items()
    ]
    emit(result, ["path", "seconds", "s/GiB", "pause s", "median gap s"], rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from safetensors.torch import load_file

    checkpoint = ensure_checkpoint(args.model)
    tensors: dict[str, Any] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors |= load_file(file)
    emit_result(summarize(args, tensors, measure(args, checkpoint, tensors)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
