"""What a CPU engine's Sleep gives back to the system, and its decode cost per token.

Builds a small Llama (4 layers, hidden 512: 49 MiB of float32 weights) unless the directory
holds one, loads it with a 256 MiB KV pool on one thread, decodes 8 x 64 greedy tokens twice
(the second timed: wall and CPU time per token), then Sleeps at level 1, Wakes, Sleeps at level
2, Wakes, reading VmRSS and VmSize from /proc/self/status around each, and checks that the
tokens after the last Wake are those before.

    python -m bench.rl.sleep_memory /tmp/sleep-llama
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import emit, machine
from engine import EngineConfig, LLMEngine, SamplingParams

MIB = 1 << 20


def vm() -> dict[str, int]:
    """VmRSS and VmSize of this process, in MiB."""
    sizes = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmSize"):
            sizes[key] = int(value.split()[0]) // 1024
    return sizes


def ensure_checkpoint(path: Path) -> None:
    if (path / "config.json").exists():
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.support.tiny_models import make_checkpoint

    make_checkpoint(
        path,
        "llama",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    return parser.parse_args(argv)


def measure(checkpoint: Path) -> dict[str, Any]:
    """The timed decode's wall and CPU seconds and tokens, the sizes around each Sleep and
    Wake, each level's Sleep result, and the tokens before and after."""
    torch.set_num_threads(1)
    config = EngineConfig(
        model=str(checkpoint), device="cpu", dtype="float32", kv_cache_memory=256 * MIB
    )
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = [[0] + [(7 * i + j) % 200 + 3 for j in range(100)] for i in range(8)]
    engine.generate(prompts, params)
    wall, cpu = time.perf_counter(), time.process_time()
    before = [r.token_ids for r in engine.generate(prompts, params)]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    sizes = {"awake": vm()}
    level1 = engine.sleep(level=1)
    sizes["level 1"] = vm()
    engine.wake_up()
    sizes["woken"] = vm()
    level2 = engine.sleep(level=2)
    sizes["level 2"] = vm()
    engine.wake_up()
    sizes["woken again"] = vm()
    after = [r.token_ids for r in engine.generate(prompts, params)]
    return {"wall": wall, "cpu": cpu, "tokens": sum(map(len, before)), "sizes": sizes,
            "levels": (level1, level2), "same_tokens": before == after}  # fmt: skip


def summarize(m: dict[str, Any]) -> dict[str, Any]:
    level1, level2 = m["levels"]
    return {
        "machine": machine(),
        "decode_tok_s": round(m["tokens"] / m["wall"], 1),
        "cpu_ms_per_token": round(m["cpu"] * 1000 / m["tokens"], 3),
        "released_mib": {
            "level 1": level1.released_bytes // MIB,
            "level 2": level2.released_bytes // MIB,
        },
        "sizes_mib": m["sizes"],
        "same_tokens": m["same_tokens"],
    }


def emit_result(result: dict[str, Any]) -> None:
    sizes, released = result["sizes_mib"], result["released_mib"]
    drops = [
        ("level 1", sizes["awake"], sizes["level 1"], released["level 1"]),
        ("level 2", sizes["woken"], sizes["level 2"], released["level 2"]),
    ]
    rows = [
        (name, freed, a["VmRSS"] - s["VmRSS"], a["VmSize"] - s["VmSize"])
        for name, a, s, freed in drops
    ]
    emit(result, ("sleep", "released MiB", "RSS drop MiB", "VmSize drop MiB"), rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ensure_checkpoint(args.checkpoint)
    emit_result(summarize(measure(args.checkpoint)))


if __name__ == "__main__":
    main()
