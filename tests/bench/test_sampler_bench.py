"""bench.sampler.fused times the fused kernels themselves against the torch sampler, and checks
that both pick the same tokens.

make_sampler("triton") returns the kernels behind a wrapper that hands some batches to the
torch sampler; the benchmark must time (and count the launches and programs of) the kernels
inside it. Tiny sizes, under Triton's interpreter on the CPU (a count and a check, not a timing).

NOTE: `use_triton` runs at collection: it chooses the interpreter before anything imports triton.
"""

from __future__ import annotations

import torch

from bench.sampler.fused import measure_batches, parse_args
from tests.support.triton_interpreter import use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
use_triton(DEVICE)


def test_the_fused_kernels_are_timed_and_pick_the_torch_samplers_tokens() -> None:
    args = parse_args(
        ["--device", DEVICE, "--batches", "2", "--vocab", "64", "--context", "8", "--iters", "1"]
    )
    results, taken_apart = measure_batches(args)
    assert [(r["batch"], r["setting"]) for r in results] == [(2, "greedy"), (2, "rl")]
    assert all(r["same_tokens"] for r in results)
    # Greedy is one pass and a merge; the RL setting's top-k, top-p, penalty and logprobs more.
    greedy, rl = (r["launches"] for r in results)
    assert 1 <= greedy < rl
    assert all(r["programs_per_row"] >= 1 for r in results)
    assert taken_apart == []
