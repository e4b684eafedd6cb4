"""One engine's run of bench/peers/offline.py, in a process of its own: `python workers.py
ENGINE SPEC OUT` reads the workload and settings from the JSON file SPEC and writes its timings
and every request's output ids to OUT.

ENGINE `sluice` runs this checkout's LLMEngine as bench/throughput/offline.py does (started as
`python -m bench.peers.workers` from the repository root, in the project's environment); `vllm`
runs `vllm.LLM(...).generate` on token-id prompts (started by path with `python -P` in the vLLM
environment, so that this folder's modules cannot shadow a library's). Both warm up on two
prompts first, as bench/throughput/offline.py does. Only the standard library is imported at the top: the
vLLM environment has no Sluice dependencies.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any


def run_sluice(spec: dict[str, Any]) -> dict[str, Any]:
    from bench.common import set_threads
    from bench.throughput.offline import run_engine
    from bench.workload import Workload

    threads = set_threads(spec["threads"])
    workload = Workload(spec["prompts"], spec["output_lens"], temperature=0.0, seed=0)
    record, tokens = run_engine(
        Path(spec["model"]),
        workload,
        "cpu",
        spec["dtype"],
        spec["max_num_seqs"],
        spec["max_num_batched_tokens"],
        kv_cache_gib=spec["kv_cache_gib"],
        threads=threads,
    )
    import torch

    return {**record, "torch_threads": torch.get_num_threads(), "token_ids": tokens}


def run_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    import vllm

    prompts: list[Any] = [{"prompt_token_ids": p} for p in spec["prompts"]]
    start = time.perf_counter()
    llm = vllm.LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=spec["max_model_len"],
        seed=0,
    )
    load_s = time.perf_counter() - start
    params = [
        vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        for n in spec["output_lens"]
    ]
    warm = vllm.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], warm, use_tqdm=False)
    start, cpu = time.perf_counter(), _cpu_seconds()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    produced = sum(map(len, tokens))
    if produced != sum(spec["output_lens"]):
        raise RuntimeError(f"vllm produced {produced} of {sum(spec['output_lens'])} tokens")
    return {
        "seconds": elapsed,
        "cpu_cores_busy": cpu / elapsed,  # this process only: not a vLLM engine-core process
        "load_seconds": load_s,
        "output_tokens": produced,
        "output_tokens_per_s": produced / elapsed,
        "total_tokens_per_s": (produced + sum(map(len, spec["prompts"]))) / elapsed,
        "requests_per_s": len(tokens) / elapsed,
        "vllm_version": vllm.__version__,
        "token_ids": tokens,
    }


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def tree_peak_rss_mib(pid: int | None = None) -> float:
    """The summed peak RSS (VmHWM) of a live process and its live descendants, in MiB.

    The parent's wait4 gives the child's own peak (or its largest reaped child's), not the sum:
    this covers an engine that keeps its model in a process of its own (vLLM's engine core)."""
    pid = os.getpid() if pid is None else pid
    total_kib = 0
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # it exited meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total_kib += int(line.split()[1])
    return total_kib / 1024


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("sluice", "vllm"):
        print("usage: python -P bench/peers/workers.py {sluice,vllm} SPEC OUT", file=sys.stderr)
        return 2
    engine, spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    record = run_sluice(spec) if engine == "sluice" else run_vllm(spec)
    record["peak_rss_tree_mib"] = tree_peak_rss_mib()
    Path(out_path).write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
