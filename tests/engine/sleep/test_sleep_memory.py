"""Sleep gives the KV cache's memory back to the system: the process's resident set shrinks by
at least the pool's size (measured in a fresh interpreter, from /proc/self/statm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KV_CACHE_BYTES = 256 << 20

SCRIPT = """
import json, os, sys
from engine import EngineConfig, LLMEngine, SamplingParams

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

config = EngineConfig(model=sys.argv[1], device="cpu", dtype="float32",
                      kv_cache_memory=int(sys.argv[2]))
engine = LLMEngine(config)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
prompt = [0, 17, 42, 99, 123, 7, 88, 5]
before_ids = engine.generate([prompt], params)[0].token_ids
kv = engine.pool.k.untyped_storage().nbytes() + engine.pool.v.untyped_storage().nbytes()
awake = rss()
outcome = engine.sleep(level=1)
asleep = rss()
engine.wake_up()
woken = rss()
after_ids = engine.generate([prompt], params)[0].token_ids
print(json.dumps({"kv": kv, "released": outcome.released_bytes, "awake": awake,
                  "asleep": asleep, "woken": woken, "same": before_ids == after_ids}))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_rss_drops_by_at_least_the_kv_cache_size_and_comes_back_on_wake(
    tiny_llama: Path,
) -> None:
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_llama), str(KV_CACHE_BYTES)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["kv"] > KV_CACHE_BYTES * 0.9 and got["released"] == got["kv"]
    assert got["awake"] - got["asleep"] >= got["kv"], got
    assert got["woken"] - got["asleep"] >= got["kv"] * 0.9, got  # reallocated and touched
    assert got["same"]
