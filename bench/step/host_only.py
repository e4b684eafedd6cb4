"""Host time per decode step: the forward and the sampler replaced by instant stand-ins.

`bench.decode --host-only` lands here. Each revision measured runs in a worker process of its
own (this file run as a script, with that revision's tree first on sys.path), so the working
tree and an exported baseline (`git archive REV`) are timed by the same code, alternately, in
the same run: a burst of load from another process lands on both alike.

The stand-ins patch points that every revision has: the model runner's `model.forward` and
`model.compute_logits` (instance attributes returning fixed tensors of the right shape) and
its `sampler` (fixed token ids). What is left is the host's work between forwards:
scheduling, filling the step inputs, building the sampling batch, the device-to-host copy of
the sampled ids, and postprocessing. Three numbers per batch, medians of steps of each kind
taken in turn: `host_ms_per_step`, a `step()` call; `with_outputs_ms`, the same with every
RequestOutput's fields read (what a consumer of `step()` pays when the outputs are built
lazily); `engine_process_ms`, a `step()` and the pickled StepOutput the engine process sends
for it (the revision's own `engine.process.step_message` when it has one, with the prefix
cache's events where the revision's cache records them, as in the engine process). On a
loaded machine a longer step is preempted more often, which inflates its median more than a
shorter one's: `host_ms_min` (the fastest plain step) and `host_cpu_ms` (the median plain step's
process CPU time; torch runs one thread) are the cautious comparisons.

The worker imports only the engine and the standard library: the baseline's `bench` package
need not match this one.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TOKEN = 7  # what the stand-in sampler always samples: not an EOS, and ignore_eos is set


def install_stand_ins(runner: Any, max_tokens: int) -> None:
    """Instant forward, LM head and sampler on a model runner of any revision."""
    import torch

    from engine.sampling.sampler import SamplerOutput

    cfg = runner.model.config
    hidden = torch.zeros(max_tokens, cfg.hidden_size)
    logits = torch.zeros(max_tokens, cfg.vocab_size)
    tokens = torch.full((max_tokens,), TOKEN, dtype=torch.int64)
    runner.model.forward = lambda input_ids, *args, **kwargs: hidden[: input_ids.shape[0]]
    runner.model.compute_logits = lambda h: logits[: h.shape[0]]
    runner.sampler = lambda lg, batch: SamplerOutput(tokens[: lg.shape[0]])


def measure_batch(engine: Any, batch: int, context: int, steps: int, warmup: int) -> dict:
    """Prefill `batch` requests of `context` tokens, then time `steps` decode steps."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.6, max_tokens=10**6, ignore_eos=True, seed=0)
    ids = [f"host-{batch}-{time.monotonic_ns()}-{i}" for i in range(batch)]
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    for request_id in ids:  # distinct prompts: no prefix-cache hits
        engine.add_request(request_id, [rng.randrange(1, vocab) for _ in range(context)], params)
    while engine.scheduler.waiting or any(
        r.num_tokens - r.num_computed_tokens > 1 for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(warmup):
        engine.step()
    assert len(engine.scheduler.running) == batch, "every request decodes in the timed steps"
    plain: list[float] = []
    consumed: list[float] = []
    piped: list[float] = []
    cpu: list[float] = []
    for _ in range(steps):
        cpu_start, start = time.process_time(), time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        start = time.perf_counter()
        read = [(o.request_id, o.index, o.new_token_ids, o.finish_reason) for o in engine.step()]
        consumed.append(time.perf_counter() - start)
        assert len(read) == batch
        start = time.perf_counter()
        pickle.dumps(pipe_message(engine, engine.step()), pickle.HIGHEST_PROTOCOL)
        piped.append(time.perf_counter() - start)
    engine.abort(ids)
    engine.step()
    return {
        "batch": batch,
        "host_ms_per_step": statistics.median(plain) * 1e3,
        "host_ms_min": min(plain) * 1e3,
        "host_cpu_ms": statistics.median(cpu) * 1e3,
        "with_outputs_ms": statistics.median(consumed) * 1e3,
        "engine_process_ms": statistics.median(piped) * 1e3,
    }


def pipe_message(engine: Any, outputs: Any) -> Any:
    """What the engine process sends for a step: its own `step_message` where the revision
    has one (outputs as columns, and the prefix cache's events where it records them), else a
    StepOutput of the list."""
    from engine import process
    from engine.protocol.messages import StepOutput

    stats = engine.stats()
    step_message = getattr(process, "step_message", None)
    if getattr(engine.cache, "events", None) is not None:
        return step_message(outputs, stats, engine.cache.take_events())
    if step_message is not None:
        return step_message(outputs, stats)
    return StepOutput(list(outputs), stats)


def worker(args: argparse.Namespace) -> int:
    """Build one engine, then answer one JSON line per batch size read from stdin."""
    sys.path.insert(0, str(args.tree))
    import torch

    import engine
    from engine import EngineConfig, LLMEngine

    here = Path(engine.__file__).resolve()
    assert here.is_relative_to(args.tree.resolve()), f"imported {here}, not {args.tree}'s"
    torch.set_num_threads(1)
    page_size = 16
    per_request = args.context + 4 * (3 * args.steps + args.warmup) + 128
    largest = args.max_batch
    llm = LLMEngine(
        EngineConfig(
            model=str(args.model),
            device="cpu",
            dtype="float32",
            max_num_seqs=largest,
            max_num_batched_tokens=max(4096, largest),
            page_size=page_size,
            num_kv_pages=largest * -(-per_request // page_size) + 16,
            max_model_len=per_request + 16,
        )
    )
    install_stand_ins(llm.runner, max(4096, largest))
    if hasattr(llm.cache, "events"):  # the prefix cache records its events, as when served
        llm.cache.events = []
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        batch = int(line)
        result = measure_batch(llm, batch, args.context, args.steps, args.warmup)
        print(json.dumps(result), flush=True)
    return 0


class Worker:
    """A worker process over one tree: send a batch size, read its result."""

    def __init__(self, label: str, tree: Path, model: Path, args: argparse.Namespace) -> None:
        self.label = label
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--tree",
            str(tree),
            "--model",
            str(model),
            "--max-batch",
            str(max(args.batches)),
            *("--context", str(args.context), "--steps", str(args.steps)),
            *("--warmup", str(args.warmup)),
        ]
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            command, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert json.loads(self._read()).get("ready")

    def measure(self, batch: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{batch}\n")
        self.proc.stdin.flush()
        return {"revision": self.label, **json.loads(self._read())}

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.label} worker died (exit {self.proc.wait()})")
        return line


def export_tree(rev: str, repo: Path, into: Path) -> str:
    """`git archive rev` unpacked into `into`; returns the commit's short hash."""
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def run(args: argparse.Namespace, model: Path, revision: str) -> dict[str, Any]:
    """Alternate this tree's worker and the baseline's over `rounds`; medians per batch."""
    repo = Path(__file__).resolve().parents[2]
    temp = Path(tempfile.mkdtemp(prefix="sluice-host-only-"))
    workers = [Worker(revision, repo, model, args)]
    try:
        if args.baseline_rev:
            label = export_tree(args.baseline_rev, repo, temp)
            workers.append(Worker(label, temp, model, args))
        samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            for batch in args.batches:
                order = workers if r % 2 == 0 else workers[::-1]
                for w in order:
                    samples.setdefault((w.label, batch), []).append(w.measure(batch))
        for w in workers:
            w.close()
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
        shutil.rmtree(temp, ignore_errors=True)
    results = []
    for (label, batch), runs in samples.items():
        results.append(
            {
                "revision": label,
                "batch": batch,
                "host_ms_per_step": statistics.median(s["host_ms_per_step"] for s in runs),
                "host_ms_min": min(s["host_ms_min"] for s in runs),
                "host_cpu_ms": statistics.median(s["host_cpu_ms"] for s in runs),
                "with_outputs_ms": statistics.median(s["with_outputs_ms"] for s in runs),
                "engine_process_ms": statistics.median(s["engine_process_ms"] for s in runs),
                "rounds": [round(s["host_ms_per_step"], 4) for s in runs],
            }
        )
    return {"benchmark": "decode_host_only", "context": args.context, "results": results}


def parse_worker_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--tree", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--max-batch", type=int, required=True)
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    return p.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    """The forward and sampler stand-ins' run: this tree and --baseline-rev, alternately."""
    from bench.checkpoints import ensure_checkpoint
    from bench.common import emit, machine, revision

    model_dir = ensure_checkpoint(args.shape, dtype="float32")
    result = run(args, model_dir, revision())
    result["machine"] = machine()
    keys = ["revision", "batch", "host_ms_per_step", "host_ms_min", "host_cpu_ms"]
    keys += ["with_outputs_ms", "engine_process_ms"]
    rows = [[r[k] for k in keys] for r in result["results"]]
    header = [
        "revision",
        "batch",
        "host ms/step",
        "min",
        "cpu ms",
        "outputs read",
        "engine process",
    ]
    emit(result, header, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(worker(parse_worker_args(sys.argv[1:])))
