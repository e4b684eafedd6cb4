"""Issue 7's table: greedy generation tokens/s per shape and batch, fast path against eager.

The issue's workload: random-weight checkpoints of real shapes, 128-token prompts, 128 new
tokens, greedy, ignore_eos. For each (shape, batch) and configuration the engine generates
once untimed (warm-up: Triton compiles, torch.compile traces) and once timed. Reported:
- tokens/s over the whole generate() (prefill included, like HF `generate`), and decode
  tokens/s over the steps after every request has its first token;
- the decode roofline: bytes a step must read (every weight once, plus each request's K and V
  at the mean context) over the measured copy bandwidth, and the decode rate's fraction of it.
Configurations: `graphs` (Triton attention + CUDA graphs: the default engine), `compiled`
(+ torch.compile), `eager` (Triton, --enforce-eager), `torch_ref` (reference attention,
eager). The ratio graphs/eager at batch 1 is the issue's "CUDA graphs at least 3x" check.

    python -m bench.throughput.fast_path --shapes llama-3.2-1b llama-3-8b --batches 1 64
    python -m bench.throughput.fast_path --shapes qwen2.5-0.5b --batches 1 --configs graphs eager
    python -m bench.throughput.fast_path --device cpu --shapes tiny --batches 1 4 --new-tokens 8 \
        --dtype float32                                   # a smoke run of the script itself
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any

from bench.checkpoints import SHAPES, ensure_checkpoint
from bench.common import emit, log, machine
from bench.decode import copy_bandwidth, kv_bytes_per_token, weight_bytes

CONFIGS: dict[str, dict[str, Any]] = {
    "graphs": {"attention_backend": "triton"},
    "compiled": {"attention_backend": "triton", "compile": True},
    "eager": {"attention_backend": "triton", "enforce_eager": True},
    # The torch reference path throughout: attention, norms and activation.
    "torch_ref": {
        "attention_backend": "torch_ref",
        "layer_kernels": "torch",
        "enforce_eager": True,
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3-8b"], choices=SHAPES)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--configs", nargs="+", default=["graphs", "eager"], choices=CONFIGS)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=4096, help="caps the graphs' tables")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--deadline", type=float, default=420.0, help="seconds; later runs skipped")
    return p.parse_args(argv)


def generate(engine: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """Time one greedy generate() step by step: total, and decode after the first tokens."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for k, prompt in enumerate(prompts):
        engine.add_request(f"bench-{k}", prompt, params)
    _sync(engine)
    start = time.perf_counter()
    started: set[str] = set()
    produced = 0
    while len(started) < len(prompts):
        outputs = engine.step()
        started.update(o.request_id for o in outputs if o.new_token_ids)
        produced += sum(len(o.new_token_ids) for o in outputs)
    first_tokens = time.perf_counter()
    step_times = []
    while engine.has_work():
        t = time.perf_counter()
        produced += sum(len(o.new_token_ids) for o in engine.step())
        step_times.append(time.perf_counter() - t)
    _sync(engine)
    end = time.perf_counter()
    assert produced == len(prompts) * new_tokens, f"{produced} tokens"
    decoded = produced - len(prompts)
    return {
        "seconds": end - start,
        "tokens_per_s": produced / (end - start),
        "decode_tokens_per_s": decoded / (end - first_tokens),
        "decode_step_ms_median": statistics.median(step_times) * 1e3,
    }


def run_config(
    model_dir: Any, name: str, batches: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    import torch

    from engine import EngineConfig, LLMEngine

    tokens = args.prompt_len + args.new_tokens
    pages = max(batches) * -(-tokens // 16) + 64
    config = EngineConfig(
        model=str(model_dir),
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(2048, max(batches) * args.prompt_len),
        num_kv_pages=pages,
        max_model_len=args.max_model_len,
        **CONFIGS[name],
    )
    start = time.perf_counter()
    engine = LLMEngine(config)
    _sync(engine)
    load_s = time.perf_counter() - start
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    runs = []
    for batch in batches:
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        generate(engine, prompts[: min(batch, 4)], 8)  # warm-up
        run = {"config": name, "batch": batch, "engine_start_s": load_s}
        run |= generate(engine, prompts, args.new_tokens)
        log(f"{name} batch {batch}: {run['tokens_per_s']:,.0f} tok/s")
        runs.append(run)
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return runs


def _sync(engine: Any) -> None:
    import torch

    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def measure(args: argparse.Namespace, bandwidth: float, began: float) -> list[dict[str, Any]]:
    """Every (shape, configuration) run within `--deadline` of `began`, each batch's rate
    beside its roofline at the mean context."""
    import torch

    from engine.models.hf_config import load_model_config

    results = []
    for shape in args.shapes:
        model_dir = ensure_checkpoint(shape, dtype=args.dtype, device=args.device)
        cfg = load_model_config(model_dir)
        per_token = kv_bytes_per_token(cfg, torch.finfo(getattr(torch, args.dtype)).bits // 8)
        for name in args.configs:
            if time.monotonic() - began > args.deadline:
                log(f"deadline: {shape} {name} skipped")
                continue
            runs = run_config(model_dir, name, args.batches, args)
            weights = _weights_of(model_dir, args.dtype)
            for run in runs:
                context = args.prompt_len + args.new_tokens / 2
                step_bytes = weights + per_token * context * run["batch"]
                roofline = run["batch"] / (step_bytes / bandwidth)
                run |= {"shape": shape, "roofline_tokens_per_s": roofline}
                run["roofline_fraction"] = run["decode_tokens_per_s"] / roofline
                results.append(run)
    return results


def emit_result(result: dict[str, Any]) -> None:
    rows = [
        [f"{r['shape']}, {r['batch']}", r["config"], r["tokens_per_s"], r["decode_tokens_per_s"]]
        + [r["roofline_tokens_per_s"], f"{r['roofline_fraction']:.0%}"]
        for r in result["runs"]
    ]
    header = ["shape, batch", "config", "tok/s", "decode tok/s", "roofline tok/s", "fraction"]
    emit(result, header, rows)
    for key, ratio in result["graphs_over_eager"].items():
        log(f"graphs / eager {key}: {ratio:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    bandwidth = copy_bandwidth(args.device, 2048 if args.device == "cuda" else 256)
    log(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    results = measure(args, bandwidth, began)
    result = {
        "benchmark": "gpu_decode",
        "workload": f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy",
        "dtype": args.dtype,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "runs": results,
        "graphs_over_eager": _graph_speedups(results),
        "machine": machine(),
    }
    emit_result(result)
    return 0


def _weights_of(model_dir: Any, dtype: str) -> int:
    """Weight bytes a decode step reads, from a meta-device model (no memory)."""
    import torch

    from engine.attention.torch_ref import TorchRefAttention
    from engine.models.hf_config import load_model_config
    from engine.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(load_model_config(model_dir), TorchRefAttention(1.0))
    return weight_bytes(model.to(getattr(torch, dtype)))


def _graph_speedups(results: list[dict[str, Any]]) -> dict[str, float]:
    by_key = {(r["shape"], r["batch"], r["config"]): r for r in results}
    speedups = {}
    for (shape, batch, config), run in by_key.items():
        eager = by_key.get((shape, batch, "eager"))
        if config == "graphs" and eager is not None:
            ratio = run["decode_tokens_per_s"] / eager["decode_tokens_per_s"]
            speedups[f"{shape}, batch {batch}"] = ratio
    return speedups


if __name__ == "__main__":
    raise SystemExit(main())
