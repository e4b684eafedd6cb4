"""Serving over gRPC: a bounded asyncio load generator with Poisson arrivals.

Sends the offline workload (same prompts as token ids, same output lengths, ignore_eos) to a
server, one `Generate` call per request over one channel, at each `--rates` value in requests/s
(`inf` = all at once), with at most `--max-concurrency` requests in flight. It starts `python
-m service` (= `sluice serve`) on 127.0.0.1 port 0 unless `--target` is given
(bench/service/server.py). The offline engine rate on the same workload and settings comes from
`python -m bench.throughput.offline --skip-hf` in a subprocess (`max_num_seqs` = the concurrency): on the
CPU right before each rate-inf phase (the server idles meanwhile), on CUDA before the server
starts. The prefix cache is off in both: every phase sends the same prompts, which a cache
would serve from memory after the first phase (bench.throughput.prefix measures the cache); give a
`--target` server `--no-enable-prefix-cache` too.

Metrics as vLLM's benchmark_serving defines them: TTFT = send -> first token; TPOT per request
= (latency - TTFT) / (output tokens - 1); ITL = the gaps between consecutive token chunks of a
request (a chunk may carry several tokens under load); p50 and p99 of each; requests/s and
output tokens/s over the phase; served/offline = output tokens/s at rate inf / the offline
engine's output tokens/s.

    python -m bench.service.serve --shape tiny --scale 0.25 --rates inf 8 --max-concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.checkpoints import add_model_flags, resolve_model
from bench.common import emit, log, machine, percentile
from bench.service.server import cpu_seconds, server
from bench.workload import Workload, make_workload
from service.ops.priority import Spawner

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--target", help="HOST:PORT of a running server (default: start one)")
    p.add_argument("--rates", nargs="+", default=["inf"], help="requests/s per phase; inf")
    p.add_argument("--max-concurrency", type=int, default=64, help="requests in flight")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--num-requests", type=int)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0, help="arrival times")
    p.add_argument("--offline-rate", type=float, help="skip the offline run; use this tok/s")
    p.add_argument("--skip-offline", action="store_true", help="no offline run, no ratio")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the offline reference and the rate-inf phase this often (alternating on the "
        "CPU); the best of each counts",
    )
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument(
        "--service-niceness",
        type=int,
        default=10,
        help="the started server's --service-niceness: its engine first in line for the CPU "
        "(for an engine that leaves the service a core: --threads below the cores, or CUDA)",
    )
    p.add_argument(
        "--client-niceness",
        type=int,
        default=10,
        help="nice levels the load generator takes once the server it started is up (Linux): "
        "it stands for callers on other machines and gets only the CPU the server leaves; the "
        "server and the offline runs keep the starting priority; 0 = compete",
    )
    return p.parse_args(argv)


@dataclass
class RequestRecord:
    sent: float = 0.0
    ttft: float = math.nan
    latency: float = math.nan
    output_tokens: int = 0
    chunks: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    last_chunk: float = 0.0

    def add_chunk(self, tokens: int, now: float) -> None:
        """A chunk of `tokens` new tokens arrived at `now`: TTFT for the first, ITL after."""
        if self.chunks == 0:
            self.ttft = now - self.sent
        else:
            self.itl.append(now - self.last_chunk)
        self.last_chunk = now
        self.chunks += 1
        self.output_tokens += tokens


async def run_request(client: Any, request: Any, record: RecordHolder) -> None:
    rec = record.value
    rec.sent = time.perf_counter()
    try:
        async for event in client.generate(request):
            kind = event.WhichOneof("event")
            now = time.perf_counter()
            if kind == "tokens" and event.tokens.token_ids:
                rec.add_chunk(len(event.tokens.token_ids), now)
            elif kind == "finished":
                rec.latency = now - rec.sent
                reason = event.finished.reason
                if reason != 3:  # FINISH_REASON_LENGTH
                    rec.error = f"finished with reason {reason}: {event.finished.message}"
    except Exception as exc:  # a failed request is counted and reported, not fatal
        rec.error = f"{type(exc).__name__}: {exc}"


@dataclass
class RecordHolder:
    value: RequestRecord = field(default_factory=RequestRecord)


async def run_phase(
    target: str, workload: Workload, rate: float, concurrency: int, seed: int
) -> dict[str, Any]:
    """Send every request of the workload at `rate` (Poisson), at most `concurrency` at once."""
    from sluice_client import AsyncClient, build_request

    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    holders = [RecordHolder() for _ in range(workload.num_requests)]
    requests = [
        build_request(
            prompt,
            request_id=f"bench-{rate}-{i}",
            max_tokens=n,
            temperature=workload.temperature,
            seed=i,
            ignore_eos=True,
        )
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True))
    ]
    async with AsyncClient(target) as client:
        await client.complete([1, 2, 3], max_tokens=2, ignore_eos=True)  # warm the channel

        async def bounded(request: Any, holder: RecordHolder) -> None:
            async with limit:
                await run_request(client, request, holder)

        tasks = []
        start = time.perf_counter()
        for request, holder in zip(requests, holders, strict=True):
            tasks.append(asyncio.create_task(bounded(request, holder)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize([h.value for h in holders], duration, rate, concurrency, workload)


def summarize(
    records: list[RequestRecord],
    duration: float,
    rate: float,
    concurrency: int,
    workload: Workload,
) -> dict[str, Any]:
    ok = [r for r in records if not r.error]
    errors = [r.error for r in records if r.error]
    expected = {i: n for i, n in enumerate(workload.output_lens)}
    short = sum(1 for i, r in enumerate(records) if not r.error and r.output_tokens != expected[i])
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [gap for r in ok for gap in r.itl]
    output = sum(r.output_tokens for r in ok)
    chunks = sum(r.chunks for r in ok)

    def stats(values: list[float]) -> dict[str, float]:
        return {
            "mean_ms": 1e3 * sum(values) / len(values) if values else math.nan,
            "p50_ms": 1e3 * percentile(values, 50),
            "p99_ms": 1e3 * percentile(values, 99),
        }

    return {
        "rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": concurrency,
        "completed": len(ok),
        "failed": len(errors),
        "errors": errors[:5],
        "wrong_length": short,
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "output_tokens": output,
        "output_tokens_per_s": output / duration,
        "tokens_per_chunk": output / chunks if chunks else math.nan,
        "ttft": stats([r.ttft for r in ok]),
        "tpot": stats(tpot),
        "itl": stats(itl),
        "e2el": stats([r.latency for r in ok]),
    }


def offline_rate(
    args: argparse.Namespace, model_dir: Path, dtype: str, spawner: Spawner | None
) -> dict[str, Any]:
    """One offline engine run on this workload and settings, in a fresh process (started by
    `spawner` when given: at the priority the benchmark started with)."""
    # --disable-prefix-cache: bench.throughput.offline's own flag (the server's is --no-enable-...)
    cmd = [
        sys.executable, "-m", "bench.throughput.offline", "--model", str(model_dir),
        "--device", args.device, "--dtype", dtype, "--scale", str(args.scale),
        "--temperature", str(args.temperature), "--max-num-seqs", str(args.max_concurrency),
        "--skip-hf", "--disable-prefix-cache",
    ]  # fmt: skip
    if args.num_requests is not None:
        cmd += ["--num-requests", str(args.num_requests)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    run = subprocess.run if spawner is None else functools.partial(spawner.run, subprocess.run)
    out = run(cmd, cwd=REPO, check=True, stdout=subprocess.PIPE, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])["engine"]
    return result


@dataclass
class Measured:
    """Every phase served and every offline reference run, in the order they ran."""

    phases: list[dict[str, Any]] = field(default_factory=list)
    offline_runs: list[dict[str, Any]] = field(default_factory=list)
    interleaved: bool = False  # each offline run right before a rate-inf phase


def measure(
    args: argparse.Namespace,
    model_dir: Path,
    dtype: str,
    workload: Workload,
    spawner: Spawner | None,
) -> Measured:
    """The offline reference runs (unless given) and every phase of `--rates`, rate inf
    `--repeat` times, against the server started here or at `--target`."""
    rates = [float(r) for r in args.rates]
    measured = Measured()

    def measure_offline() -> None:
        run = offline_rate(args, model_dir, dtype, spawner)
        measured.offline_runs.append(run)
        log(f"offline engine: {run['output_tokens_per_s']:.1f} output tokens/s")

    want_offline = args.offline_rate is None and not args.skip_offline
    # On the CPU each offline reference run goes right before a rate-inf phase (the server
    # idles meanwhile), so that both see the same load from the rest of the machine. On CUDA
    # the server's engine takes most of the device memory: the offline runs come first.
    interleave = want_offline and not args.device.startswith("cuda") and math.inf in rates
    measured.interleaved = interleave
    if want_offline and not interleave:
        log(f"serve: offline engine rate on {workload.describe()}")
        for _ in range(args.repeat):
            measure_offline()

    def run_all(target: str, server_pid: int | None) -> None:
        schedule = [r for rate in rates for r in [rate] * (args.repeat if math.isinf(rate) else 1)]
        for i, rate in enumerate(schedule):
            if interleave and math.isinf(rate):
                measure_offline()
            measured.phases.append(
                timed_phase(args, workload, target, server_pid, rate, args.seed + i)
            )

    if args.target:
        run_all(args.target, None)
    else:
        with server(args, model_dir, dtype, spawner) as (target, pid):
            run_all(target, pid)
    return measured


def timed_phase(
    args: argparse.Namespace,
    workload: Workload,
    target: str,
    server_pid: int | None,
    rate: float,
    seed: int,
) -> dict[str, Any]:
    """One phase's summary, with the cores each process kept busy over it."""
    log(f"phase: rate {rate} req/s, max concurrency {args.max_concurrency}")
    before, start = cpu_seconds(server_pid), time.perf_counter()
    phase = asyncio.run(run_phase(target, workload, rate, args.max_concurrency, seed))
    wall = time.perf_counter() - start
    after = cpu_seconds(server_pid)
    # Cores each process kept busy over the phase (1.0 = one core all the time).
    phase["cpu_cores"] = {k: (after[k] - before[k]) / wall for k in after if k in before}
    cores = ", ".join(f"{k} {v:.2f}" for k, v in phase["cpu_cores"].items())
    log(
        f"  {phase['output_tokens_per_s']:.1f} output tok/s, "
        f"TTFT p50 {phase['ttft']['p50_ms']:.1f} ms, {phase['failed']} failed; "
        f"cores busy: {cores}"
    )
    return phase


def summarize_run(
    args: argparse.Namespace,
    dtype: str,
    workload: Workload,
    spawner: Spawner | None,
    measured: Measured,
) -> dict[str, Any]:
    """The JSON result: the phases, the best offline run and the served/offline ratios."""
    phases, offline_runs = measured.phases, measured.offline_runs
    offline: dict[str, Any] | None = None
    if args.offline_rate is not None:
        offline = {"output_tokens_per_s": args.offline_rate, "given": True}
    elif offline_runs:
        offline = dict(max(offline_runs, key=lambda r: float(r["output_tokens_per_s"])))
        offline["all_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in offline_runs]
    inf_phases = [p for p in phases if p["rate"] == "inf"]
    inf_phase = max(inf_phases, key=lambda p: float(p["output_tokens_per_s"]), default=None)
    ratio = pair_ratios = None
    if offline is not None and inf_phase is not None:
        ratio = inf_phase["output_tokens_per_s"] / offline["output_tokens_per_s"]
    if measured.interleaved and len(offline_runs) == len(inf_phases):
        pair_ratios = [
            p["output_tokens_per_s"] / o["output_tokens_per_s"]
            for p, o in zip(inf_phases, offline_runs, strict=True)
        ]
    return {
        "benchmark": "serve",
        "model": args.shape if args.model is None else str(args.model),
        "target": args.target or "started by the benchmark",
        "device": args.device,
        "dtype": dtype,
        "engine_threads": args.threads,
        "service_niceness": None if args.target else args.service_niceness,
        "client_niceness": args.client_niceness if spawner is not None else 0,
        "workload": workload.describe(),
        "offline_engine": offline,
        "phases": phases,
        "repeat": args.repeat,
        "ratio_served_over_offline": ratio,  # best rate-inf phase / best offline run
        "pair_ratios": pair_ratios,  # each rate-inf phase / the offline run just before it
        "machine": machine(),
    }


def emit_result(result: dict[str, Any]) -> None:
    """The JSON on stdout; a row per phase and the served/offline ratio on stderr."""
    header = ["rate", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
    header += ["ITL p50", "ITL p99", "tok/chunk", "failed"]
    rows = [
        [p["rate"], p["requests_per_s"], p["output_tokens_per_s"]]
        + [p[k][q] for k in ("ttft", "tpot", "itl") for q in ("p50_ms", "p99_ms")]
        + [p["tokens_per_chunk"], p["failed"]]
        for p in result["phases"]
    ]
    emit(result, header, rows)
    if result["ratio_served_over_offline"] is not None:
        log(
            f"served/offline output tokens/s at rate inf: {result['ratio_served_over_offline']:.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir, dtype = resolve_model(args)
    from engine.models.hf_config import load_model_config

    vocab = load_model_config(model_dir).vocab_size
    workload = make_workload(vocab, args.scale, args.num_requests, args.temperature)
    # A thread that keeps the starting priority, for the offline runs (--client-niceness).
    linux = sys.platform.startswith("linux")
    spawner = Spawner() if args.client_niceness and linux and not args.target else None
    measured = measure(args, model_dir, dtype, workload, spawner)
    result = summarize_run(args, dtype, workload, spawner, measured)
    emit_result(result)
    failed = sum(p["failed"] + p["wrong_length"] for p in result["phases"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
