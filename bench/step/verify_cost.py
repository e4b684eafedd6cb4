"""What verifying a speculative draft costs, with every proposal right: the ceiling of speedup.

An oracle proposer proposes what a run without speculation produced next, k tokens at a time
(k = `--proposals`), so every proposal is kept and each step emits k + 1 tokens per request.
The same requests run without speculation first (the baseline and the oracle's source), then
once per k, each on a fresh engine with `--speculative-method ngram` (its step buffers hold the
drafts' rows) whose proposer is replaced by the oracle. Per (batch, k): process CPU seconds
per output token and the ratio to k = 0 (no speculation). The tokens must equal the
baseline's (`same_tokens`). A real proposer keeps fewer: this is what verification costs
against what it saves, the most speculation can give at that batch.

    python -m bench.step.verify_cost [--shape demo] [--batches 1 4 8] [--proposals 1 2 4]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.checkpoints import SHAPES, resolve_model
from bench.common import emit, log, machine, set_threads
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.demo.checkpoint import ensure_demo_checkpoint
from engine.scheduling.request import Request
from engine.speculative.verify import SpecDecoder


class Oracle:
    """Proposes the next tokens of the run without speculation (by request key)."""

    method = "oracle"

    def __init__(self, outputs: dict[str, list[int]], proposals: int) -> None:
        self.outputs = outputs
        self.proposals = proposals

    def propose(self, reqs: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        return [
            self.outputs[r.request_id][r.num_output_tokens :][: min(limit, self.proposals)]
            for r, limit in zip(reqs, limits, strict=True)
        ]

    def finished(self, req: Request) -> None:
        pass

    def weights_updated(self) -> None:
        pass


def engine(model: Path, dtype: str, batch: int, proposals: int) -> LLMEngine:
    spec: dict[str, Any] = {}
    if proposals:
        spec = {"speculative_method": "ngram", "num_speculative_tokens": proposals}
        spec["speculative_max_batch"] = batch
    config = EngineConfig(model=str(model), device="cpu", dtype=dtype, warmup=True, **spec)
    return LLMEngine(config)


def timed(llm: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, dict]:
    """(process CPU seconds, request id -> its tokens) of one run of `prompts` at once."""
    ids = [f"r{i}" for i in range(len(prompts))]
    start = time.process_time()
    for request_id, prompt in zip(ids, prompts, strict=True):
        llm.add_request(request_id, prompt, params)
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    while llm.has_work():
        for out in llm.step():
            outputs[out.request_id] += out.new_token_ids
    return time.process_time() - start, outputs


def first(pair: tuple[float, Any]) -> float:
    return pair[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="demo", choices=["demo", *sorted(SHAPES)])
    p.add_argument("--model", type=Path)
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--proposals", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeat", type=int, default=3, help="runs per cell; the fastest counts")
    args = p.parse_args(argv)
    set_threads(args.threads)
    if args.shape == "demo" and args.model is None:
        model, dtype = ensure_demo_checkpoint(), args.dtype or "float32"
    else:
        model, dtype = resolve_model(args)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    records, rows = [], []
    for batch in args.batches:
        prompts = [[1, 40 + i, 50 + 2 * i, 60, 70 + i] for i in range(batch)]
        off = engine(model, dtype, batch, 0)
        base, outputs = min((timed(off, prompts, params) for _ in range(args.repeat)), key=first)
        tokens = batch * args.max_tokens
        for k in [0, *args.proposals]:
            seconds, same = base, True
            if k:
                llm = engine(model, dtype, batch, k)
                llm.loop.speculate(SpecDecoder(Oracle(outputs, k), k, batch))
                runs = [timed(llm, prompts, params) for _ in range(args.repeat)]
                seconds = min(s for s, _ in runs)
                same = all(out == outputs for _, out in runs)
                llm.close()
            record = {
                "batch": batch,
                "proposals": k,
                "cpu_ms_per_token": 1000 * seconds / tokens,
                "ratio_to_off": base / seconds,
                "same_tokens": same,
            }
            records.append(record)
            rows.append([batch, k, record["cpu_ms_per_token"], record["ratio_to_off"], same])
            log(f"batch {batch} proposals {k}: {record['ratio_to_off']:.2f}x")
        off.close()
    result = {"benchmark": "verify_cost", "model": str(model), "records": records}
    result["machine"] = machine()
    emit(result, ["batch", "proposals", "cpu ms/token", "x off", "same"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
