"""KV pages one long request holds, with and without sliding-window reclamation.

No model runs: the scheduler and the page pool (engine/kv_cache/) are driven as the engine
drives them (each step's tokens counted as computed, a token appended at the end of the
prompt and of each decode), over pools of one-float pages laid out as a model's layers:

- gpt-oss-like: 24 layers alternating a 128-token window and full attention;
- gemma-3-like: 34 layers, five sliding (window 512) to one full (Gemma 3 4B's pattern).

A request of `--prompt` tokens decodes to `--total` tokens. Printed as JSON: per shape and per
KV group, the pages held at the end and at most, and the layer-pages (pages x the group's
layers: memory) against the same model without reclamation (every group keeps every page).
The target (issue 45): a sliding group holds at most window / context of the full-attention
group's pages, plus a page or two.

    python -m bench.step.kv_pages [--total 4096] [--prompt 1024] [--page-size 16]
"""

from __future__ import annotations

import argparse
import json

import torch

from engine.kv_cache.page_pool import PagePool
from engine.kv_cache.prefix_cache import PrefixCache
from engine.models.base import LayerKV
from engine.protocol.messages import SamplingParams
from engine.scheduling.request import Request
from engine.scheduling.scheduler import Scheduler

SHAPES: dict[str, list[int | None]] = {
    "gpt-oss-like": [128 if i % 2 == 0 else None for i in range(24)],
    "gemma-3-like": [None if i % 6 == 5 else 512 for i in range(34)],
}


def run(windows: list[int | None], total: int, prompt: int, size: int, reclaim: bool) -> dict:
    """Drive one request to `total` tokens; its pages per group, at the end and at most."""
    layers = [LayerKV(1, 1, w) for w in windows]
    cpu = torch.device("cpu")
    groups_needed = len(set(windows)) * len(windows)  # generous: every group at full length
    pool = PagePool(
        groups_needed * -(-total // size), size, len(layers), 1, 1, torch.float32, cpu, layers
    )
    sched = Scheduler(PrefixCache(pool, enabled=False), max_num_seqs=1, max_num_batched_tokens=2048)
    if not reclaim:  # every group keeps every page, as a pool without reclamation would
        setattr(sched.pages, "reclaim", lambda req: None)  # noqa: B010 (an instance's method)
    req = Request("r", 0, prompt, list(range(prompt)), SamplingParams(), 0, total - prompt, 0)
    sched.add(req)
    scratch, groups = pool.scratch_page, pool.groups
    peak = [0] * groups.num_groups
    while req.num_computed_tokens < total - 1:
        batch = sched.schedule()
        for r, n in zip(batch.requests, batch.query_lens, strict=True):
            r.num_computed_tokens += n
            if r.num_computed_tokens == r.num_tokens:
                r.token_ids.append(1)
        held = [len([p for p in pages if p != scratch]) for pages in [req.pages, *req.group_pages]]
        peak = [max(a, b) for a, b in zip(peak, held, strict=True)]
    return {
        "held": held,
        "peak": peak,
        "layer_pages": sum(h * len(g) for h, g in zip(held, groups.layers, strict=True)),
        "windows": list(groups.windows),
        "layers": [len(g) for g in groups.layers],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", type=int, default=4096, help="tokens of the request")
    parser.add_argument("--prompt", type=int, default=1024, help="of which prompt tokens")
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    report = {}
    for name, windows in SHAPES.items():
        on = run(windows, args.total, args.prompt, args.page_size, reclaim=True)
        off = run(windows, args.total, args.prompt, args.page_size, reclaim=False)
        full = max(h for h, w in zip(on["held"], on["windows"], strict=True) if w is None)
        bounds = [None if w is None else w * full // args.total + 2 for w in on["windows"]]
        report[name] = {
            "groups": [
                {"window": w, "layers": n, "held": h, "peak": p, "held_without": h0, "target": b}
                for w, n, h, p, h0, b in zip(
                    on["windows"],
                    on["layers"],
                    on["held"],
                    on["peak"],
                    off["held"],
                    bounds,
                    strict=True,
                )
            ],
            "layer_pages": on["layer_pages"],
            "layer_pages_without": off["layer_pages"],
            "memory_ratio": round(on["layer_pages"] / off["layer_pages"], 3),
            "meets_target": all(
                b is None or h <= b for h, b in zip(on["held"], bounds, strict=True)
            ),
        }
    print(
        json.dumps(
            {"total": args.total, "prompt": args.prompt, "page_size": args.page_size, **report},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
