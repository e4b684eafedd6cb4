"""The same streamed load three ways, in one run: sluice.v1 directly, Sluice's OpenAI front, and
the SMG gateway (`smg launch --backend vllm`) in front of the same server.

It starts one `python -m service` (bench/service/server.py: the prefix cache off, so no phase
reads what an earlier one left) with `--openai-port` when this checkout has the OpenAI front,
and SMG in front of it when this checkout serves the vLLM worker protocol; a path that is not
there is left out and said so. Then `--repeat` rounds, each sending every request through each
path in turn (`--concurrency` streams in flight, all sent at once), so that the paths share the
machine's state; the best round of each path counts. Prompts are text from the tests' corpus,
tokenized without special tokens as SMG does, and every request generates `--max-tokens` tokens
(ignore_eos). Reported per path: output tokens/s, TTFT and end-to-end latency p50/p99, and the
tokens/s of each HTTP path over sluice.v1's (the issue's target: >= 0.9 on the CPU suite's
model). The load generator runs `--client-niceness` below the server and the gateway.

    python -m bench.service.gateway --shape tiny --num-requests 128 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path as FilePath
from typing import Any

import aiohttp

from bench.checkpoints import add_model_flags, resolve_model
from bench.common import emit, log, machine
from bench.service.gateway_paths import Path, Record, Request, send_http, send_v1, summarize
from bench.service.server import cpu_seconds, server
from service.ops.priority import Spawner
from tests.support.smg_process import SmgProcess, free_port

MODEL = "bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64, help="streams in flight")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--prompt-words", type=int, default=24, help="words of corpus per prompt")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--repeat", type=int, default=2, help="rounds; the best of each path counts")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--service-niceness", type=int, default=10)
    p.add_argument("--client-niceness", type=int, default=10)
    args = p.parse_args(argv)
    args.max_concurrency = args.concurrency  # the server's --max-num-seqs (server.py)
    return args


def make_requests(args: argparse.Namespace, model_dir: FilePath) -> list[Request]:
    """Prompts of `--prompt-words` corpus words from a different offset each."""
    from tokenizers import Tokenizer

    from tests.support.tiny_models import CORPUS

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    words = CORPUS.split()
    requests = []
    for i in range(args.num_requests):
        start = (i * 7) % len(words)
        text = " ".join((words[start:] + words)[: args.prompt_words])
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        requests.append(Request(text, ids, args.max_tokens))
    return requests


def has_openai_front() -> bool:
    from service.cli import build_parser

    return "--openai-port" in build_parser().format_help()


def has_worker_protocol() -> bool:
    return importlib.util.find_spec("service.vllm_worker.servicer") is not None


@dataclasses.dataclass
class Fleet:
    paths: list[Path]
    server_pid: int
    smg_pid: int | None = None

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: the load generator, the service, its engine, the gateway."""
        seconds = cpu_seconds(self.server_pid)
        if self.smg_pid is not None:  # `nice` execs smg: the pid is the gateway's
            fields = FilePath(f"/proc/{self.smg_pid}/stat").read_text().rsplit(")", 1)[1].split()
            seconds["smg"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return seconds


@contextlib.contextmanager
def fleet(
    args: argparse.Namespace, model_dir: FilePath, dtype: str, spawner: Spawner | None
) -> Iterator[Fleet]:
    """The server (and SMG in front of it), up; the paths present in this checkout."""
    openai_port = free_port() if has_openai_front() else None
    flags = ["--served-model-name", MODEL]
    if openai_port is not None:
        flags += ["--openai-port", str(openai_port)]
    with (
        server(args, model_dir, dtype, spawner, flags) as (target, pid),
        contextlib.ExitStack() as s,
    ):
        running = Fleet([Path("v1", target)], pid)
        paths = running.paths
        if openai_port is not None:
            paths.append(Path("openai", f"http://127.0.0.1:{openai_port}/v1", MODEL))
        else:
            log("no --openai-port in this checkout: the OpenAI front is left out")
        if has_worker_protocol():
            logs = FilePath(s.enter_context(tempfile.TemporaryDirectory(prefix="bench-smg-")))
            # Started at the priority the benchmark began with, less --service-niceness: the
            # gateway yields to the engine as the service process does (it holds the OpenAI
            # front), and both stand above the load generator.
            popen: Any = subprocess.Popen
            if spawner is not None:
                popen = functools.partial(spawner.run, subprocess.Popen)
            gateway = SmgProcess(
                logs / "smg.log", [target], popen=popen, niceness=args.service_niceness
            )
            s.callback(gateway.stop)
            gateway.wait_ready(MODEL, timeout=args.ready_timeout)
            paths.append(Path("smg", gateway.base_url, MODEL))
            running.smg_pid = gateway.proc.pid
        else:
            log("no vLLM worker protocol in this checkout: the SMG path is left out")
        yield running


async def run_phase(path: Path, requests: list[Request], args: argparse.Namespace) -> float:
    """Every request through `path`, `--concurrency` at a time; the phase's seconds."""
    from sluice_client import AsyncClient

    limit = asyncio.Semaphore(args.concurrency)
    path.records = [Record() for _ in requests]
    connector = aiohttp.TCPConnector(limit=2 * args.concurrency)
    async with (
        AsyncClient(path.target if path.name == "v1" else "127.0.0.1:1") as v1,
        aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(300)) as http,
    ):

        async def one(request: Request, record: Record) -> None:
            async with limit:
                if path.name == "v1":
                    await send_v1(v1, request, args.temperature, record)
                else:
                    await send_http(http, path, request, args.temperature, record)

        await one(Request(requests[0].text, requests[0].ids, 2), Record())  # warm the connection
        start = time.perf_counter()
        await asyncio.gather(*(one(q, r) for q, r in zip(requests, path.records, strict=True)))
        return time.perf_counter() - start


def measure(args: argparse.Namespace, running: Fleet, requests: list[Request]) -> list[dict]:
    """`--repeat` rounds of every path in turn, each with the cores each process kept busy."""
    phases = []
    for round_ in range(args.repeat):
        for path in running.paths:
            before, start = running.cpu(), time.perf_counter()
            duration = asyncio.run(run_phase(path, requests, args))
            wall, after = time.perf_counter() - start, running.cpu()
            phase = summarize(path, duration, args.max_tokens * len(requests))
            phase["round"] = round_
            phase["cpu_cores"] = {k: (after[k] - before[k]) / wall for k in after if k in before}
            phases.append(phase)
            cores = ", ".join(f"{k} {v:.2f}" for k, v in phase["cpu_cores"].items())
            log(
                f"{path.name}: {phase['output_tokens_per_s']:.0f} output tok/s, TTFT p50 "
                f"{phase['ttft']['p50_ms']:.1f} ms p99 {phase['ttft']['p99_ms']:.1f} ms, "
                f"{phase['failed']} failed; cores busy: {cores}"
            )
    return phases


def summarize_run(args: argparse.Namespace, phases: list[dict], dtype: str) -> dict[str, Any]:
    best = {}
    for phase in phases:
        name = phase["path"]
        if name not in best or phase["output_tokens_per_s"] > best[name]["output_tokens_per_s"]:
            best[name] = phase
    v1 = best["v1"]["output_tokens_per_s"]
    return {
        "benchmark": "gateway",
        "model": args.shape if args.model is None else str(args.model),
        "device": args.device,
        "dtype": dtype,
        "engine_threads": args.threads,
        "workload": {
            "num_requests": args.num_requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_words,
            "temperature": args.temperature,
            "ignore_eos": True,
        },
        "repeat": args.repeat,
        "paths": sorted(best),
        "best": best,
        "ratio_over_v1": {n: p["output_tokens_per_s"] / v1 for n, p in best.items() if n != "v1"},
        "phases": phases,
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir, dtype = resolve_model(args)
    requests = make_requests(args, model_dir)
    linux = sys.platform.startswith("linux")
    spawner = Spawner() if args.client_niceness and linux else None
    with fleet(args, model_dir, dtype, spawner) as running:
        phases = measure(args, running, requests)
    result = summarize_run(args, phases, dtype)
    header = ["path", "out tok/s", "/ v1", "TTFT p50", "TTFT p99", "E2E p50", "E2E p99", "failed"]
    rows = [
        [name, p["output_tokens_per_s"], result["ratio_over_v1"].get(name, 1.0)]
        + [p[k][q] for k in ("ttft", "e2el") for q in ("p50_ms", "p99_ms")]
        + [p["failed"]]
        for name, p in result["best"].items()
    ]
    emit(result, header, rows)
    wrong = [p for p in phases if p["failed"] or p["output_tokens"] != p["expected_output_tokens"]]
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
