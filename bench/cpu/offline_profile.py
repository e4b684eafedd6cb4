"""Where an offline run's time goes on the CPU: torch.profiler over LLMEngine.generate, each op's
self time credited to an op class by the engine region it ran in.

    python -m bench.cpu.offline_profile --shape llama-75m --num-requests 16 --scale 0.1 --threads 2
    python -m bench.cpu.offline_profile --shape llama-75m --num-requests 16 --scale 0.1 --dtype bfloat16

Regions are marked by wrapping a few engine methods in `record_function` (this process only):
the model forward, the attention backend (and its rotary, gather and SDPA parts), the C
kernels of the CPU paths (a region's own time is its kernel's: ctypes calls are not ops), the
LM head and the sampler. "host" is the wall time no op accounts for: Python in the scheduler, the
runner's step preparation and the layers' own dispatch. The profiler's own overhead lands in
both op time and host time, so read shares, not absolute times.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict
from typing import Any

from bench.checkpoints import add_model_flags, resolve_model
from bench.workload import make_workload

LINEAR_OPS = {
    "aten::addmm",
    "aten::mm",
    "aten::linear",
    "aten::matmul",
    "mkldnn::_linear_pointwise",
}


# Regions around C calls (ctypes, not ops): each region's own time is its kernel's.
C_REGIONS = {
    "#decode_kernel": "attention: decode kernel (C)",
    "#rotary_store": "rotary and KV write (C)",
    "#cpu_ops": "norms / activation (C)",
}


def _label(cls: Any, method: str, name: str) -> None:
    import torch

    original = getattr(cls, method)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(name):
            return original(*args, **kwargs)

    setattr(cls, method, wrapped)


def mark_regions() -> None:
    from engine.attention.cpu_paged import CpuPagedAttention
    from engine.attention.torch_ref import TorchRefAttention
    from engine.layers import cpu_ops
    from engine.layers.rope import RotaryEmbedding
    from engine.models.llama import LlamaForCausalLM
    from engine.sampling.sampler import Sampler

    _label(LlamaForCausalLM, "forward", "#forward")
    _label(LlamaForCausalLM, "compute_logits", "#lm_head")
    _label(TorchRefAttention, "forward", "#attention")
    _label(TorchRefAttention, "_sdpa", "#sdpa")
    _label(CpuPagedAttention, "_decode_layer", "#decode_kernel")
    _label(CpuPagedAttention, "_rotate_and_store", "#rotary_store")
    _label(cpu_ops, "rms_norm", "#cpu_ops")
    _label(cpu_ops, "silu_and_mul", "#cpu_ops")
    _label(RotaryEmbedding, "forward", "#rotary")
    _label(Sampler, "__call__", "#sampling")


def classify(name: str, regions: list[str]) -> str:
    """The op class of one op by its name and the marked regions around it (innermost first)."""
    inner = regions[0] if regions else ""
    if inner == "#sampling":
        return "sampling"
    if inner == "#lm_head":
        return "lm head (linear)"
    if inner == "#sdpa":
        return "attention: SDPA"
    if inner in C_REGIONS:
        return C_REGIONS[inner]
    if inner == "#rotary":
        return "rotary"
    if inner == "#attention":
        if name == "aten::index_select":
            return "attention: page gather"
        if name == "aten::index_copy_":
            return "attention: KV write"
        return "attention: other"
    if inner == "#forward":
        return "linear" if name in LINEAR_OPS else "norms / activation / elementwise"
    return "step inputs and other ops"


def profile(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine import EngineConfig, LLMEngine, SamplingParams

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    mark_regions()
    model_dir, dtype = resolve_model(args)
    config = EngineConfig(
        model=str(model_dir),
        device=args.device,
        dtype=dtype,
        max_num_seqs=128,
        max_num_batched_tokens=2048,
        kv_cache_memory=2**30,
        compile=args.compile,
        enable_prefix_cache=False,  # the profiled run repeats the timed one's prompts
    )
    engine = LLMEngine(config)
    workload = make_workload(engine.info.vocab_size, args.scale, args.num_requests, temperature=0.0)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    engine.generate(workload.prompts[:2], [SamplingParams(max_tokens=8, ignore_eos=True)] * 2)
    start = time.perf_counter()
    engine.generate(workload.prompts, params)
    plain_s = time.perf_counter() - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        engine.generate(workload.prompts, params)
        wall = time.perf_counter() - start
    engine.close()
    shares, ops = credit_events(prof.events())
    shares["host (Python, dispatch)"] = max(0.0, wall - sum(shares.values()))
    return {
        "wall_s": wall,
        "unprofiled_s": plain_s,
        "output_tokens": workload.output_tokens,
        "shares": dict(shares),
        "ops": {f"{c} | {n}": s for (c, n), s in ops.items()},
    }


def credit_events(events: Any) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """(seconds per op class, seconds per (class, op)) of the profiler's top-level ops, each
    credited to the op class of the engine region it ran in; a C region's own time as its own."""
    shares: dict[str, float] = defaultdict(float)
    ops: dict[tuple[str, str], float] = defaultdict(float)
    for event in events:
        if event.name in C_REGIONS:
            shares[C_REGIONS[event.name]] += event.self_cpu_time_total / 1e6
            continue
        if event.name.startswith("#") or event.name.startswith("ProfilerStep"):
            continue
        if event.cpu_parent is not None and not event.cpu_parent.name.startswith("#"):
            # Only top-level ops: a child's time is inside its parent's total.
            continue
        regions = []
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("#"):
                regions.append(parent.name)
            parent = parent.cpu_parent
        cls = classify(event.name, regions)
        seconds = event.cpu_time_total / 1e6
        shares[cls] += seconds
        ops[(cls, event.name)] += seconds
    return shares, ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_flags(p)
    p.add_argument("--scale", type=float, default=0.1)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--top", type=int, default=12, help="ops to list")
    args = p.parse_args()
    result = profile(args)
    wall = result["wall_s"]
    print(
        f"{result['output_tokens']} output tokens: {result['output_tokens'] / result['unprofiled_s']:.0f}"
        f" tok/s unprofiled, {wall:.2f} s profiled"
    )
    for cls, s in sorted(result["shares"].items(), key=lambda kv: -kv[1]):
        print(f"  {cls:36s} {s:7.3f} s  {100 * s / wall:5.1f}%")
    print("top ops:")
    for key, s in sorted(result["ops"].items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {key:70s} {s:7.3f} s  {100 * s / wall:5.1f}%")


if __name__ == "__main__":
    main()
