"""Sluice served over gRPC against vLLM's CPU build served over its OpenAI HTTP API, same run.

The served side of bench/peers/offline.py: each run starts one server, sends it the whole greedy
ignore_eos workload (bench/workload.py) at once with at most `--max-concurrency` streams in
flight, and stops it; `--repeat` runs alternate which engine goes first. Sluice is `python -m
service` (bench/service/server.py) driven by bench/service/serve.py's gRPC load generator (`Generate`,
one call per request); vLLM is `python -m vllm.entrypoints.openai.api_server` in the venv of
bench/peers/vllm_venv.py, driven by streaming `/v1/completions` calls on token-id prompts
(bench/peers/http_stream.py), each asking for usage after every chunk so that chunks carrying
several tokens count right. Both servers get every core (`--threads`), a 1 GiB KV cache,
max_num_seqs 128, max_num_batched_tokens 2048, `--dtype`, and prefix caching off (the prompts
share nothing; the warm-up request would be its only hit). The load generator stands for
callers on other machines: it runs `--client-niceness` levels below both servers.

Metrics as bench/service/serve.py defines them (TTFT, TPOT, ITL, output tokens/s over the phase); the
JSON has each run's numbers for both, the ratio of output tokens/s per run and its median, the
TPOT p50 of each, and each server's summed peak RSS (its process tree) and start-up seconds.

    python -m bench.peers.serve --shape llama-75m --scale 0.25 --repeat 2

vLLM's server in this build: started as a module (its console script looks for a distribution
named `vllm`); ready when GET /health answers 200; `ignore_eos` is one of its extra sampling
fields; with VLLM_CPU_OMP_THREADS_BIND on every core (bench/peers/offline.py's environment) its
API-server process shares the cores with the engine, as Sluice's service does.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.checkpoints import ensure_checkpoint
from bench.common import emit, log, machine
from bench.peers.http_stream import post_events
from bench.peers.offline import ENGINES, add_peer_flags, worker_env
from bench.peers.workers import tree_peak_rss_mib
from bench.service.serve import RecordHolder, run_phase, summarize
from bench.service.server import cpu_seconds, logged_process, server
from bench.workload import Workload, make_workload
from service.ops.priority import Spawner, lower_priority


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_peer_flags(p, default_shape="llama-75m")
    p.add_argument("--max-concurrency", type=int, default=64, help="streams in flight")
    p.add_argument("--repeat", type=int, default=2, help="runs of each, alternating the first")
    p.add_argument("--client-niceness", type=int, default=10, help="the load generator's")
    p.add_argument("--sluice-flags", nargs="*", default=[], help="more `sluice serve` flags")
    p.add_argument("--ready-timeout", type=float, default=1800, help="vLLM compiles at start")
    return p.parse_args(argv)


def sluice_phase(
    args: argparse.Namespace, model_dir: Path, workload: Workload, spawner: Spawner
) -> dict[str, Any]:
    settings = argparse.Namespace(
        device="cpu",
        max_concurrency=args.max_concurrency,
        service_niceness=0,
        threads=args.threads,
        ready_timeout=args.ready_timeout,
        client_niceness=0,  # this process lowered itself once, at its start
    )
    flags = [
        f"--max-num-seqs={args.max_num_seqs}",
        f"--max-num-batched-tokens={args.max_num_batched_tokens}",
        f"--kv-cache-memory={args.kv_cache_gib * 2**30}",
        f"--cpu-threads={args.threads}",
        *args.sluice_flags,
    ]
    start = time.perf_counter()
    with server(settings, model_dir, args.dtype, spawner, flags) as (target, pid):
        ready = time.perf_counter() - start
        phase = measured(
            pid, lambda: run_phase(target, workload, math.inf, args.max_concurrency, 0)
        )
        phase["peak_rss_tree_mib"] = tree_peak_rss_mib(pid)
    return {**phase, "ready_seconds": ready}


def vllm_phase(
    args: argparse.Namespace,
    model_dir: Path,
    workload: Workload,
    spawner: Spawner,
    vllm_python: Path,
) -> dict[str, Any]:
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    flags = [
        f"--dtype={args.dtype}",
        f"--max-num-seqs={args.max_num_seqs}",
        f"--max-num-batched-tokens={args.max_num_batched_tokens}",
        f"--max-model-len={longest}",
        "--seed=0",
        "--no-enable-prefix-caching",
    ]
    env = worker_env("vllm", args.threads, args.kv_cache_gib, vllm_python, args.vllm_env)
    start = time.perf_counter()
    with vllm_server(vllm_python, model_dir, flags, env, spawner, args.ready_timeout) as (
        port,
        pid,
    ):
        ready = time.perf_counter() - start
        phase = measured(
            pid, lambda: run_http_phase(port, str(model_dir), workload, args.max_concurrency)
        )
        phase["peak_rss_tree_mib"] = tree_peak_rss_mib(pid)
    return {**phase, "ready_seconds": ready}


def measured(pid: int, phase: Any) -> dict[str, Any]:
    """Run the coroutine `phase()` and add the cores each process kept busy meanwhile."""
    before, start = cpu_seconds(pid), time.perf_counter()
    result: dict[str, Any] = asyncio.run(phase())
    wall = time.perf_counter() - start
    after = cpu_seconds(pid)
    result["cpu_cores"] = {k: (after[k] - before[k]) / wall for k in after if k in before}
    return result


@contextmanager
def vllm_server(
    python: Path,
    model_dir: Path,
    flags: Sequence[str],
    env: dict[str, str],
    spawner: Spawner,
    timeout: float,
) -> Iterator[tuple[int, int]]:
    """vLLM's OpenAI server on 127.0.0.1; yields (port, pid) once /health answers 200."""
    with socket.socket() as probe:  # a free port; the server binds it a moment later
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    module = "vllm.entrypoints.openai.api_server"
    cmd = [str(python), "-P", "-m", module, "--model", str(model_dir), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *flags]
    with logged_process(cmd, env, "vllm-serve-", spawner, grace=60) as (proc, _):
        _wait_healthy(proc, port, timeout)
        yield port, proc.pid


def _wait_healthy(proc: subprocess.Popen[Any], port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {proc.returncode} before ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("vLLM's server was not healthy in time")


async def run_http_phase(
    port: int, model: str, workload: Workload, concurrency: int
) -> dict[str, Any]:
    """bench.service.serve's rate-inf phase, against an OpenAI completions endpoint."""
    limit = asyncio.Semaphore(concurrency)
    holders = [RecordHolder() for _ in range(workload.num_requests)]

    def body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }

    async def one(prompt: list[int], max_tokens: int, holder: RecordHolder) -> None:
        async with limit:
            await http_request(port, body(prompt, max_tokens), holder)

    warm = RecordHolder()
    await http_request(port, body([1, 2, 3], 2), warm)
    if warm.value.error:
        raise RuntimeError(f"vLLM's warm-up request failed: {warm.value.error}")
    start = time.perf_counter()
    pairs = zip(workload.prompts, workload.output_lens, holders, strict=True)
    await asyncio.gather(*(one(p, n, h) for p, n, h in pairs))
    duration = time.perf_counter() - start
    return summarize([h.value for h in holders], duration, math.inf, concurrency, workload)


async def http_request(port: int, body: dict[str, Any], holder: RecordHolder) -> None:
    """One streamed completion into `holder`: a chunk counts when its usage grew."""
    rec = holder.value
    rec.sent = time.perf_counter()
    try:
        async for event in post_events("127.0.0.1", port, "/v1/completions", body):
            usage = event.get("usage") or {}
            produced = usage.get("completion_tokens", rec.output_tokens)
            if produced > rec.output_tokens:
                rec.add_chunk(produced - rec.output_tokens, time.perf_counter())
        rec.latency = time.perf_counter() - rec.sent
    except Exception as exc:  # counted and reported, as bench.service.serve does
        rec.error = f"{type(exc).__name__}: {exc}"


def measure(
    args: argparse.Namespace,
    model_dir: Path,
    workload: Workload,
    spawner: Spawner,
    vllm_python: Path,
) -> list[dict[str, Any]]:
    """`--repeat` runs, each serving the workload from both engines, alternating who goes first."""
    runs: list[dict[str, Any]] = []
    for index in range(args.repeat):
        order = ENGINES if index % 2 == 0 else ENGINES[::-1]
        run: dict[str, Any] = {"first": order[0]}
        for engine in order:
            if engine == "sluice":
                run[engine] = sluice_phase(args, model_dir, workload, spawner)
            else:
                run[engine] = vllm_phase(args, model_dir, workload, spawner, vllm_python)
            phase = run[engine]
            log(f"{engine}: {phase['output_tokens_per_s']:.1f} output tok/s, TPOT p50 "
                f"{phase['tpot']['p50_ms']:.1f} ms, {phase['failed']} failed")  # fmt: skip
        run["ratio_sluice_over_vllm"] = (
            run["sluice"]["output_tokens_per_s"] / run["vllm"]["output_tokens_per_s"]
        )
        runs.append(run)
    return runs


def summarize_run(
    args: argparse.Namespace, workload: Workload, runs: list[dict[str, Any]]
) -> dict[str, Any]:
    ratios = [r["ratio_sluice_over_vllm"] for r in runs]
    return {
        "benchmark": "peer_serve",
        "model": args.shape if args.model is None else str(args.model),
        "dtype": args.dtype,
        "threads": args.threads,
        "max_concurrency": args.max_concurrency,
        "workload": workload.describe(),
        "runs": runs,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "sluice_flags": args.sluice_flags,
        "machine": machine(),
    }


def emit_result(result: dict[str, Any]) -> None:
    rows = [
        [f"run {i} ({r['first']} first)", *(r[e]["output_tokens_per_s"] for e in ENGINES),
         *(r[e]["tpot"]["p50_ms"] for e in ENGINES), r["ratio_sluice_over_vllm"]]
        for i, r in enumerate(result["runs"])
    ]  # fmt: skip
    header = ["peer_serve " + result["model"], "sluice tok/s", "vllm tok/s"]
    emit(result, header + ["sluice TPOT p50", "vllm TPOT p50", "ratio"], rows)
    log(f"median ratio sluice/vllm served output tokens/s: {result['median_ratio']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model or ensure_checkpoint(args.shape, dtype=args.dtype)
    from engine.models.hf_config import load_model_config

    workload = make_workload(load_model_config(model_dir).vocab_size, args.scale,
                             args.num_requests, temperature=0.0)  # fmt: skip
    if args.vllm_python is not None:
        vllm_python = args.vllm_python
    else:
        from bench.peers.vllm_venv import ensure_vllm_python

        vllm_python = ensure_vllm_python()
    spawner = Spawner()  # starts both servers at this process's starting priority
    if args.client_niceness and sys.platform.startswith("linux"):
        lower_priority(args.client_niceness, spare=spawner.native_id)
    log(f"peer_serve: {workload.describe()} on {model_dir.name}, {args.threads} threads")
    runs = measure(args, model_dir, workload, spawner, vllm_python)
    emit_result(summarize_run(args, workload, runs))
    failed = sum(r[e]["failed"] + r[e]["wrong_length"] for r in runs for e in ENGINES)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
