"""The service's ceiling: how many tokens/s one service process streams, and at what CPU cost.

The real server (service/server.py, as `sluice serve` runs it) fronts a stand-in engine that
costs nothing (bench/ceiling/server.py): every running request gets one token per step, one step
every `--step-ms`, so the engine offers streams / step tokens/s. Client processes (spawned)
hold `--streams` concurrent `Generate` calls, each a request of `--max-tokens` tokens followed
by the next, for `--seconds` after a warm-up. Each phase is one server; each load shape runs on
this checkout and, with `--baseline-rev`, on that revision's service (exported with `git
archive`) in the same run, alternating, and the result gives the ratios.

Per phase: delivered tokens/s (tokens the clients received in the window / the window), tokens
per message, service CPU seconds per 1,000 tokens and cores used (utime + stime of the server
process from /proc, its threads included, the engine not), and each token's delay from the
engine's send to the client's receipt (p50, p99, max; time.monotonic is one clock for all
processes), and each request's time to first token from the client's send (`ttft_ms_*`: with one
Generate call per request, mostly how long grpc.aio takes to accept a new call when the service
is busy). The client processes are bench/ceiling/clients.py's. The low-load phase (`--low-streams`) checks that each token leaves alone (1 token
per message) and quickly; there the server also records when each token reached its router and
when the event carrying it was written, which gives the service's own share of the delay
(arrival -> write done, `service_delay_ms_*`).

    python -m bench.ceiling.run --streams 256 --step-ms 5 --baseline-rev main
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.ceiling.clients import client_main
from bench.common import emit, log, machine, percentile

REPO = Path(__file__).resolve().parents[2]
SERVER_SCRIPT = Path(__file__).resolve().parent / "server.py"
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps on. "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256, help="concurrent streams, high load")
    p.add_argument(
        "--step-ms",
        type=float,
        nargs="+",
        default=[5.0],
        help="engine step interval(s) at high load; offered tokens/s = streams / step",
    )
    p.add_argument("--low-streams", type=int, default=4, help="streams at low load; 0 = skip")
    p.add_argument("--low-step-ms", type=float, default=20.0)
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument(
        "--rpc",
        choices=["generate", "stream"],
        default="generate",
        help="one Generate call per request, or each client's requests over one GenerateStream",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per request")
    p.add_argument("--seconds", type=float, default=5.0, help="measured window per phase")
    p.add_argument("--warmup", type=float, default=1.5, help="seconds before the window")
    p.add_argument("--baseline-rev", help="also measure this revision's service, alternating")
    p.add_argument("--repeat", type=int, default=1, help="run every phase this often")
    p.add_argument(
        "--stream-interval",
        type=float,
        default=0.0,
        help="the server's --stream-interval, seconds (0: off, the default)",
    )
    return p.parse_args(argv)


# ---- one phase: a server, its clients, the numbers ----


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_pid(server_pid: int) -> int:
    """The server's engine: its child spawned by multiprocessing (not the resource tracker)."""
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise RuntimeError(f"no engine process under {server_pid}")


def make_model(
    directory: Path, step_interval: float, record_writes: bool, stream_interval: float = 0.0
) -> list[int]:
    """Write the stand-in's model directory; returns the prompt, a plain English text's ids.

    The stand-in sends a request's prompt back as its output, so the service detokenizes text
    that a model could write. (Arbitrary ids of a byte-level vocabulary are mostly lone bytes
    of multi-byte characters: invalid UTF-8, which costs the detokenizer about 5x as much.)
    """
    from bench.checkpoints import tiny_models

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_models().make_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    knobs = {
        "step_interval": step_interval,
        "vocab_size": tokenizer.get_vocab_size(),
        "record_writes": record_writes,
        "stream_interval": stream_interval,  # the server's
    }
    (directory / "ceiling.json").write_text(json.dumps(knobs))
    return list(tokenizer.encode(PROMPT_TEXT, add_special_tokens=False).ids)


def run_phase(
    args: argparse.Namespace, tree: Path, streams: int, step_ms: float, label: str
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sluice-ceiling-") as tmp:
        model = Path(tmp) / "model"
        low_load = streams == args.low_streams
        prompt = make_model(model, step_ms / 1000, low_load, args.stream_interval)
        env = {**os.environ, "SLUICE_CEILING_TREE": str(tree), "SLUICE_LOG_LEVEL": "info"}
        with open(Path(tmp) / "server.log", "wb") as server_log:
            server = subprocess.Popen(
                [sys.executable, str(SERVER_SCRIPT), str(model)],
                stdout=subprocess.PIPE,
                stderr=server_log,
                env=env,
            )
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline() or b"0")
            if not port:
                raise RuntimeError((Path(tmp) / "server.log").read_text()[-3000:])
            result = _drive(args, server.pid, f"127.0.0.1:{port}", streams, prompt)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
        steps = json.loads((model / "steps.json").read_text())
        writes = json.loads((model / "writes.json").read_text()) if low_load else None
    return summarize(result, steps, writes, streams, step_ms, label, args.rpc)


def _drive(
    args: argparse.Namespace, server_pid: int, target: str, streams: int, prompt: list[int]
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.monotonic() + 2.0  # the clients' imports and channels first
    window = (start_at + args.warmup, start_at + args.warmup + args.seconds)
    clients = min(args.clients, streams)
    procs = [
        ctx.Process(
            target=client_main,
            args=(
                args.rpc,
                target,
                list(range(c, streams, clients)),
                f"c{c}",
                prompt,
                args.max_tokens,
                start_at,
                window[1],
                out,
            ),
        )
        for c in range(clients)
    ]
    for proc in procs:
        proc.start()
    time.sleep(max(0.0, window[0] - time.monotonic()))
    engine = engine_pid(server_pid)
    cpu0, engine0 = cpu_seconds(server_pid), cpu_seconds(engine)
    client0 = sum(cpu_seconds(proc.pid) for proc in procs if proc.pid is not None)
    time.sleep(max(0.0, window[1] - time.monotonic()))
    cpu1, engine1 = cpu_seconds(server_pid), cpu_seconds(engine)
    client1 = sum(cpu_seconds(proc.pid) for proc in procs if proc.pid is not None)
    results = [out.get(timeout=120) for _ in procs]  # before join: a full queue blocks exit
    for proc in procs:
        proc.join(timeout=30)
    return {
        "window": window,
        "service_cpu": cpu1 - cpu0,
        "records": [r for records, _ in results for r in records],
        "starts": dict(start for _, starts in results for start in starts),
        "client_cpu": client1 - client0,
        "engine_cpu": engine1 - engine0,
    }


def summarize(
    result: dict[str, Any],
    steps: dict[str, Any],
    writes: dict[str, Any] | None,
    streams: int,
    step_ms: float,
    label: str,
    rpc: str,
) -> dict[str, Any]:
    start, end = result["window"]
    sent_at: list[float] = steps["steps"]
    first_step: dict[str, int] = steps["first_step"]
    tokens = messages = alone = 0
    delays: list[float] = []
    ttfts: list[float] = []  # sent by the client -> its first token received
    for rid, position, count, received in result["records"]:
        if not start <= received < end:
            continue
        if position == 0:
            ttfts.append(received - result["starts"][rid])
        tokens += count
        messages += 1
        alone += count == 1
        first = first_step[rid] + position
        delays.extend(received - sent_at[k] for k in range(first, first + count))
    written = _service_delays(writes, start, end)
    seconds = end - start
    engine_tokens = sum(n for t, n in zip(sent_at, steps["sizes"], strict=True) if start <= t < end)
    return {
        "revision": label,
        "rpc": rpc,
        "streams": streams,
        "step_ms": step_ms,
        "offered_tok_s": round(streams / step_ms * 1000),
        # Below offered: the engine was late, or had fewer than `streams` requests running
        # (new ones not yet accepted).
        "engine_tok_s": round(engine_tokens / seconds),
        "delivered_tok_s": round(tokens / seconds),
        "tokens_per_message": round(tokens / messages, 3) if messages else math.nan,
        "messages_alone": round(alone / messages, 4) if messages else math.nan,
        "service_cores": round(result["service_cpu"] / seconds, 3),
        "service_cpu_s_per_1k_tokens": round(result["service_cpu"] / tokens * 1000, 4)
        if tokens
        else math.nan,
        "delay_ms_p50": round(percentile(delays, 50) * 1000, 3),
        "delay_ms_p99": round(percentile(delays, 99) * 1000, 3),
        "delay_ms_max": round(max(delays, default=math.nan) * 1000, 3),
        "ttft_ms_p50": round(percentile(ttfts, 50) * 1000, 3),
        "ttft_ms_p99": round(percentile(ttfts, 99) * 1000, 3),
        # NaN unless measured (the low-load phase): arrival -> the service's write done.
        "service_delay_ms_p50": round(percentile(written, 50) * 1000, 3),
        "service_delay_ms_p99": round(percentile(written, 99) * 1000, 3),
        "client_cores": round(result["client_cpu"] / seconds, 3),
        "engine_cores": round(result["engine_cpu"] / seconds, 3),
        "tokens": tokens,
    }


def _service_delays(writes: dict[str, Any] | None, start: float, end: float) -> list[float]:
    """Low load: each token's time in the service, from its arrival at the router to the
    completed write of the event that carried it (none unless recorded)."""
    written: list[float] = []
    if writes is not None:
        arrived: dict[str, float] = writes["arrivals"]
        for rid, position, count, done in writes["writes"]:
            if start <= done < end:
                written.extend(
                    done - arrived[f"{rid} {k}"] for k in range(position, position + count)
                )
    return written


def export_revision(rev: str, directory: Path) -> Path:
    """The service, engine and client stubs of revision `rev`, as files under `directory`."""
    directory.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "service", "engine", "clients/python/sluice"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
    return directory


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every phase: each load shape against each tree (the baseline revision first), the whole
    schedule `--repeat` times."""
    shapes = [(args.streams, ms) for ms in args.step_ms]
    if args.low_streams:
        shapes.insert(0, (args.low_streams, args.low_step_ms))
    phases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sluice-baseline-") as tmp:
        trees = [("current", REPO)]
        if args.baseline_rev:
            trees.insert(
                0, (args.baseline_rev, export_revision(args.baseline_rev, Path(tmp) / "b"))
            )
        for _ in range(args.repeat):
            for streams, step_ms in shapes:
                for label, tree in trees:
                    log(f"{label}: {streams} streams, a step every {step_ms} ms")
                    phase = run_phase(args, tree, streams, step_ms, label)
                    log(json.dumps(phase))
                    phases.append(phase)
    return phases


def summarize_run(args: argparse.Namespace, phases: list[dict[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "service_ceiling",
        "machine": machine(),
        "settings": {k: v for k, v in vars(args).items()},
        "phases": phases,
    }
    if args.baseline_rev:
        result["ratios"] = ratios(phases, args.baseline_rev)
    return result


# The stderr table: a column per phase key, in this order.
COLUMNS = [
    ("revision", "revision"), ("rpc", "rpc"), ("streams", "streams"),
    ("offered", "offered_tok_s"), ("engine sent", "engine_tok_s"),
    ("delivered", "delivered_tok_s"), ("tok/msg", "tokens_per_message"),
    ("alone", "messages_alone"), ("cores", "service_cores"),
    ("cpu s/1k tok", "service_cpu_s_per_1k_tokens"), ("delay p50 ms", "delay_ms_p50"),
    ("p99", "delay_ms_p99"), ("max", "delay_ms_max"), ("TTFT p50", "ttft_ms_p50"),
    ("p99", "ttft_ms_p99"), ("svc p50", "service_delay_ms_p50"),
    ("svc p99", "service_delay_ms_p99"), ("client cores", "client_cores"),
    ("engine", "engine_cores"),
]  # fmt: skip


def emit_result(result: dict[str, Any]) -> None:
    rows = [[p[key] for _, key in COLUMNS] for p in result["phases"]]
    emit(result, [title for title, _ in COLUMNS], rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    emit_result(summarize_run(args, measure(args)))
    return 0


def ratios(phases: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """Current over baseline for each load shape (the best run of each when repeated)."""
    out = []
    shapes = sorted({(p["streams"], p["step_ms"]) for p in phases})
    for streams, step_ms in shapes:
        runs = [p for p in phases if (p["streams"], p["step_ms"]) == (streams, step_ms)]
        best = {
            label: max(
                (p for p in runs if p["revision"] == label), key=lambda p: p["delivered_tok_s"]
            )
            for label in {p["revision"] for p in runs}
        }
        base, cur = best[baseline], best["current"]
        out.append(
            {
                "streams": streams,
                "step_ms": step_ms,
                "delivered": round(cur["delivered_tok_s"] / base["delivered_tok_s"], 3),
                "cpu_per_token": round(
                    cur["service_cpu_s_per_1k_tokens"] / base["service_cpu_s_per_1k_tokens"], 3
                ),
            }
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
