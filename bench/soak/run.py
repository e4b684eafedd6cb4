"""Soak: minutes of mixed traffic, live weight updates and engine kills against one real server.

Starts `python -m service` (= `sluice serve`) on a free loopback port with Admin enabled, serving
checkpoint A; B has the same shapes and other random weights. First, greedy canaries run alone
on A, then (after a checkpoint update) on B: the expected token ids of each. Then for
`--minutes`, `--clients` load-generator processes (bench/soak/traffic.py) each keep
`--concurrency` requests in flight (Generate and GenerateStream with random lengths, n,
sampling, logprobs, stop strings, deadlines, client cancels, Cancel RPCs, and canaries), while
this process updates the weights every `--update-every` s (alternating A and B, by
checkpoint_dir or inline tensors, under each in-flight policy in turn), `kill -9`s the engine
every `--kill-every` s (and times its way back to SERVING), samples the RSS of the server and
engine processes every 10 s, and watches the served policy version once a second.

Afterwards: the requests by outcome; lost calls (still open `--lost-after` s after the traffic
stopped); duplicated or out-of-order events; canary mismatches; KV pages in use once idle; the
server's error and warning log events. A canary is compared with the weights the driver last
applied when no update overlapped it (this catches a restart that rolled the weights back), and
otherwise with the weights of the single policy version its chunks report (completions that mix
versions, as RECOMPUTE and CONTINUE make, are counted, not compared). Exits 1 when anything is
lost, duplicated, out of order or mismatched, when the version went backwards while SERVING,
when pages stay in use, or when the server's RSS grew more than `--max-rss-growth-mb`.

The parts: bench/soak/server.py (the server subprocess and its log), bench/soak/driver.py
(updates, kills, samples), bench/soak/traffic.py and bench/soak/checks.py (the load generators
and their checks of every event), bench/soak/verdict.py (canaries, the result, what fails it).

    python -m bench.soak.run --minutes 2 --clients 3 --concurrency 8
    python -m bench.soak.run --minutes 0.3 --update-every 8 --kill-every 15   # the smoke (~25 s)

The smoke's 18 s hold a checkpoint update (at 2.7 s), an inline update (10.7 s), then a kill
(12.5 s) with nothing after it: the restart must replay both updates in order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import queue
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.checkpoints import DEFAULT_ROOT, SHAPES, Shape, write_checkpoint
from bench.common import emit, log
from bench.soak.driver import CANARIES, CANARY_TOKENS, Driver
from bench.soak.server import Server
from bench.soak.traffic import TrafficPlan, traffic_main
from bench.soak.verdict import failures, report, table_rows

# The tiny shape with peaked weights (as the tests' tiny models): greedy argmax has no near-ties,
# so batching cannot flip a canary's token.
SOAK_SHAPE = Shape("llama", {**SHAPES["tiny"].config, "initializer_range": 0.1}, "soak")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=2.0, help="of traffic")
    p.add_argument("--clients", type=int, default=3, help="load-generator processes")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight per client")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, help="checkpoint A (default: a tiny random one)")
    p.add_argument("--model-b", type=Path, help="checkpoint B (default: A's weights perturbed)")
    p.add_argument("--update-every", type=float, default=30.0, help="seconds between updates")
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds between engine kills")
    p.add_argument("--lost-after", type=float, default=60.0, help="s after the traffic stops")
    p.add_argument("--max-rss-growth-mb", type=float, default=64.0, help="server RSS, gated")
    p.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    p.add_argument("--num-kv-pages", type=int, default=1024)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--workdir", type=Path, help="server log, token, weights dir (kept)")
    return p.parse_args(argv)


# ---- checkpoints ----


def soak_checkpoints(root: Path = DEFAULT_ROOT) -> tuple[Path, Path]:
    """A and B: the soak shape with seeds 0 and 1, built once into the benchmark cache."""
    paths = []
    for name, seed in (("a", 0), ("b", 1)):
        directory = root / f"soak-{name}-v1"
        if not (directory / "DONE").is_file():
            partial = root / f".{directory.name}.partial-{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            write_checkpoint(partial, SOAK_SHAPE, seed=seed)
            (partial / "DONE").write_text("soak")
            with contextlib.suppress(OSError):  # another process built it first
                partial.rename(directory)
            shutil.rmtree(partial, ignore_errors=True)
        paths.append(directory)
    return paths[0], paths[1]


def perturbed_copy(source: Path, directory: Path, seed: int = 1) -> Path:
    """A copy of checkpoint `source` whose floating-point tensors have noise of their own
    scale added: same names, shapes and dtypes, other greedy outputs."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory, ignore=shutil.ignore_patterns("*.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    for path in source.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and tensor.numel() > 1:
                noise = torch.randn(tensor.shape, generator=generator) * tensor.float().std()
                tensors[name] = (tensor.float() + noise).to(tensor.dtype)
        save_file(tensors, directory / path.name, metadata={"format": "pt"})
    return directory


# ---- the run ----


async def soak(
    args: argparse.Namespace, server: Server, checkpoints: dict[str, Path]
) -> dict[str, Any]:
    from sluice_client import AsyncClient

    driver = Driver(server, checkpoints, args)
    if await driver.wait_serving(args.ready_timeout) is None:
        raise TimeoutError("the server did not become SERVING in time")
    async with AsyncClient(server.target) as client:
        log("greedy canaries alone on A and B")
        expected = await driver.expectations(client)
        differing = sum(a != b for a, b in zip(expected["A"], expected["B"], strict=True))
        vocab_size = (await client.info()).vocab_size
        duration = args.minutes * 60
        results = multiprocessing.get_context("spawn").Queue()
        driver.start = time.monotonic()
        stop_at = driver.start + duration
        processes = start_traffic(args, server.target, vocab_size, stop_at, results)
        log(f"traffic: {args.clients} processes x {args.concurrency} for {duration:.0f} s")
        watch = asyncio.create_task(driver.watch_versions(client, stop_at))
        samples = asyncio.create_task(driver.sample_rss(stop_at))
        await driver.schedule(duration)
        summaries = await asyncio.to_thread(
            _collect, results, processes, stop_at + args.lost_after + 120
        )
        await asyncio.gather(watch, samples)
        log("traffic done; waiting for SERVING and an idle engine")
        pages, final = None, None
        if await driver.wait_serving(120.0) is not None:
            pages = await driver.idle_pages(client)
            final = await driver.final_canaries(client, expected)
        driver.sample_rss_once()
    driver.admin.close()
    return report(args, driver, summaries, expected, differing, pages, final)


def start_traffic(
    args: argparse.Namespace, target: str, vocab_size: int, stop_at: float, results: Any
) -> list[Any]:
    """The load-generator processes, started; each puts its summary on `results`."""
    ctx = multiprocessing.get_context("spawn")
    processes = []
    for i in range(args.clients):
        plan = TrafficPlan(
            target=target,
            client=i,
            concurrency=args.concurrency,
            seed=args.seed * 100 + i,
            stop_at=stop_at,
            lost_after=args.lost_after,
            vocab_size=vocab_size,
            canaries=CANARIES,
            canary_tokens=CANARY_TOKENS,
        )
        process = ctx.Process(target=traffic_main, args=(plan, results), daemon=True)
        process.start()
        processes.append(process)
    return processes


def _collect(results: Any, processes: list[Any], deadline: float) -> list[dict[str, Any]]:
    """One summary per load-generator process (an error entry for one that died or hung)."""
    summaries: dict[int, dict[str, Any]] = {}
    while len(summaries) < len(processes):
        try:
            summary = results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except queue.Empty:
            dead = [i for i, p in enumerate(processes) if not p.is_alive() and i not in summaries]
            for i in dead:  # killed without a word (e.g. out of memory)
                summaries[i] = {"client": i, "error": f"exited {processes[i].exitcode}"}
            if time.monotonic() > deadline:
                break
            continue
        summaries[summary["client"]] = summary
    for i, process in enumerate(processes):
        process.join(10)
        if process.is_alive():
            process.kill()  # hung: one of this benchmark's own load generators
            summaries.setdefault(i, {"client": i, "error": "hung"})
    return [summaries[i] for i in sorted(summaries)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sluice-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        model_a, model_b = soak_checkpoints()
    else:
        model_a = args.model
        model_b = args.model_b or perturbed_copy(args.model, workdir / "model-b")
    server = Server(model_a, workdir, args)
    log(f"soak: server log in {server.log.path}")
    try:
        server.start(args.ready_timeout)
        result = asyncio.run(soak(args, server, {"A": model_a, "B": model_b}))
    finally:
        shutdown = server.stop()
    result["shutdown"] = shutdown
    result["server_log"] = server.log.summary()
    found = failures(result, args.max_rss_growth_mb)
    result["passed"], result["failures"] = not found, found
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    emit(result, ["metric", "value"], table_rows(result))
    for failure in found:
        log(f"FAILED: {failure}")
    if found:
        log(f"kept {workdir} (server log, weights dir)")
    elif args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
