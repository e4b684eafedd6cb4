"""The nano-vllm offline workload, shared by the offline and serving benchmarks.

256 requests; prompt and output lengths each uniform in [100, 1024]; random token ids; every
request generates exactly its output length (ignore_eos); seed 0. `scale` shrinks the count and
both length bounds by the same factor, for the CPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NUM_REQUESTS = 256
MIN_LEN, MAX_LEN = 100, 1024


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float
    seed: int

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> dict[str, object]:
        return {
            "num_requests": self.num_requests,
            "prompt_len": [min(map(len, self.prompts)), max(map(len, self.prompts))],
            "output_len": [min(self.output_lens), max(self.output_lens)],
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "temperature": self.temperature,
            "ignore_eos": True,
            "seed": self.seed,
        }


def make_workload(
    vocab_size: int,
    scale: float = 1.0,
    num_requests: int | None = None,
    temperature: float = 0.6,
    seed: int = 0,
) -> Workload:
    """nano-vllm's bench.py workload (temperature 0.6 as there), scaled by `scale`."""
    count = num_requests if num_requests is not None else max(1, round(NUM_REQUESTS * scale))
    lo, hi = max(1, round(MIN_LEN * scale)), max(1, round(MAX_LEN * scale))
    rng = random.Random(seed)
    top = min(vocab_size, 10000) - 1  # nano-vllm draws ids in [0, 10000]
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(lo, hi))] for _ in range(count)]
    output_lens = [rng.randint(lo, hi) for _ in range(count)]
    return Workload(prompts, output_lens, temperature, seed)
